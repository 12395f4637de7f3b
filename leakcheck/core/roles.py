"""What a process is to a job, as far as can be told from outside: workers and runtime helpers.

NOTE [roles from outside]: a process below a job's root is a DataLoader worker only when
something says so: the worker itself, through the mailbox (NOTE [worker mailbox] in
mailbox.py), or a tracker that heard it. Being a direct child of the root says nothing:
multiprocessing's resource tracker and fork server, a shell the job started, a compiler
subprocess and a ``sleep`` are direct children too. So a direct child is a ``worker`` only
when its identity is among the known workers, and a ``descendant`` otherwise. Runtime helpers,
the processes a library starts once and keeps for the rest of the job by design, are told
apart by their command lines (``RUNTIME_HELPERS``, the one list every module asks): like the
first CUDA context, they are a baseline, not a leak, unless they hold GPU memory or
``/dev/nvidia*`` descriptors.

This module is low in the layers: it imports only ``leakcheck.core.readings``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection

from leakcheck.core.readings import ProcessKey, Role

__all__ = [
    "DAEMON_HELPERS",
    "HELPER_FLAG",
    "HELPER_NAMES",
    "RUNTIME_HELPERS",
    "direct_child_role",
    "is_daemon_helper",
    "is_runtime_helper",
    "runtime_helper_name",
]

RUNTIME_HELPERS: tuple[str, ...] = (
    "multiprocessing.resource_tracker",
    "multiprocessing.semaphore_tracker",
    "multiprocessing.forkserver",
    "loky.backend.resource_tracker",
    "loky.backend.popen_loky_posix",
    "torch_shm_manager",
    "torch._inductor.compile_worker",
)
"""Command-line fragments of helper processes a library starts once and keeps: multiprocessing's
resource tracker (``semaphore_tracker`` before Python 3.8) and fork server, joblib/loky's
resource tracker and reusable workers, torch's shared-memory manager and inductor's compile
workers. A dotted fragment also matches as a path (``torch/_inductor/compile_worker/...``:
inductor starts its workers by file name, not by module name)."""

DAEMON_HELPERS: tuple[str, ...] = ("torch_shm_manager",)
"""Runtime helpers that leave their parent's tree by design: torch's shared-memory manager
daemonizes to PID 1 and exits once its last client is gone. Reparented, they are no orphan;
any other helper reparented away (a forkserver whose owner was killed) stays for ever."""

HELPER_NAMES: dict[str, str] = {
    "multiprocessing.resource_tracker": "resource tracker",
    "multiprocessing.semaphore_tracker": "semaphore tracker",
    "multiprocessing.forkserver": "forkserver",
    "loky.backend.resource_tracker": "loky resource tracker",
    "loky.backend.popen_loky_posix": "loky worker",
    "torch_shm_manager": "torch_shm_manager",
    "torch._inductor.compile_worker": "inductor compile worker",
    "multiprocessing.spawn": "spawn worker",
}
"""What people call each runtime helper (NOTE [process names] in names.py), and the one
process multiprocessing starts that is no helper: a spawned worker (``spawn_main``)."""

HELPER_FLAG = "helper"
"""The flag a snapshot gives a runtime helper of the job."""


def _fragment_pattern(fragment: str) -> str:
    forms = {re.escape(fragment), re.escape(fragment.replace(".", "/"))}
    # Whole names only: `my_torch_shm_manager.py` or `x.multiprocessing.forkserver_2` are
    # not helpers. Before the fragment: not part of a longer name; after: not a longer word.
    return r"(?<![\w.])(?:" + "|".join(sorted(forms)) + r")(?!\w)"


@functools.cache
def _pattern(fragments: tuple[str, ...]) -> re.Pattern[str]:
    # Compiled on first use, not at import: a snapshot of the machine without --pid never
    # asks (NOTE [lean start] in cli.py).
    return re.compile("|".join(_fragment_pattern(fragment) for fragment in fragments))


def is_runtime_helper(cmdline: str) -> bool:
    """Whether a command line is one of a runtime helper process (``RUNTIME_HELPERS``).

    Args:
        cmdline: The process's command line, arguments joined by spaces.

    Returns:
        True when a fragment of ``RUNTIME_HELPERS`` appears in it as a whole module name or
        path (``from multiprocessing.resource_tracker import main``,
        ``.../torch/bin/torch_shm_manager``, ``.../torch/_inductor/compile_worker/__main__.py``).

    """
    return _pattern(RUNTIME_HELPERS).search(cmdline) is not None


def runtime_helper_name(cmdline: str) -> str | None:
    """The name of the helper or spawned worker a command line is (``HELPER_NAMES``), or None."""
    for fragment, name in HELPER_NAMES.items():
        if _pattern((fragment,)).search(cmdline) is not None:
            return name
    return None


def is_daemon_helper(cmdline: str) -> bool:
    """Whether a command line is one of a helper that daemonizes by design (``DAEMON_HELPERS``)."""
    return _pattern(DAEMON_HELPERS).search(cmdline) is not None


def direct_child_role(key: ProcessKey, known_workers: Collection[ProcessKey] = ()) -> Role:
    """The role of a direct child of a job's root, seen from outside the job.

    See NOTE [roles from outside]: a child is a ``worker`` only when it is a known loader
    worker; otherwise a ``descendant``, since from outside it cannot be told apart from any
    other process the job started.

    Args:
        key: The child's identity.
        known_workers: Identities of the job's known loader workers (from its mailbox or
            tracker; empty when nothing is known, as for ``leakcheck snapshot --pid``).

    Returns:
        ``worker`` or ``descendant``.

    """
    return "worker" if key in known_workers else "descendant"
