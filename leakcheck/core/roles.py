"""What a process is to a job, as far as can be told from outside: workers and runtime helpers.

NOTE [roles from outside]: a process below a job's root is a DataLoader worker only when
something says so: the worker itself, through the mailbox (NOTE [worker mailbox] in
mailbox.py), a tracker that heard it, or torch's name for its process (``pt_data_worker``, for
the pytest plugin, which has no mailbox). Being a direct child of the root says nothing (the
resource tracker, a shell, a compiler and a ``sleep`` are too): a direct child is a ``worker``
only when it is a known worker, else a ``descendant``. Runtime helpers, processes a library
starts once and keeps by design, are told by their command lines (``HELPER_NAMES``, the one
table every module asks): like the first CUDA context, a baseline, not a leak, unless they
hold GPU memory or ``/dev/nvidia*`` descriptors.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection

from leakcheck.core.readings import ProcessKey, Role

HELPER_NAMES: dict[str, str] = {
    "multiprocessing.resource_tracker": "resource tracker",
    "multiprocessing.semaphore_tracker": "semaphore tracker",
    "multiprocessing.forkserver": "forkserver",
    "loky.backend.resource_tracker": "loky resource tracker",
    "loky.backend.popen_loky_posix": "loky worker",
    "torch_shm_manager": "torch_shm_manager",
    "torch._inductor.compile_worker": "inductor compile worker",
    "multiprocessing.spawn": "spawn worker",  # a spawned worker: named, no helper
}
"""Command-line fragments of runtime helpers (a dotted one also matches as a path: inductor
starts its workers by file name), with what people call them (NOTE [process names])."""

RUNTIME_HELPERS = tuple(name for name in HELPER_NAMES if name != "multiprocessing.spawn")

DAEMON_HELPERS = ("torch_shm_manager",)
"""Helpers (by name) that leave their parent's tree by design (torch's shared-memory manager
daemonizes and exits after its last client): reparented, no orphan, unlike any other."""

HELPER_FLAG = "helper"  # the flag a snapshot gives a runtime helper of the job


@functools.cache
def _pattern(fragment: str) -> re.Pattern[str]:
    # Compiled on first use, not at import (NOTE [lean start] in cli.py). Whole names only:
    # `my_torch_shm_manager.py` or `x.multiprocessing.forkserver_2` are not helpers.
    forms = "|".join(sorted({re.escape(fragment), re.escape(fragment.replace(".", "/"))}))
    return re.compile(r"(?<![\w.])(?:" + forms + r")(?!\w)")


def runtime_helper_name(cmdline: str) -> str | None:
    """The name of the helper or spawned worker a command line is (``HELPER_NAMES``), or None."""
    return next(
        (name for fragment, name in HELPER_NAMES.items() if _pattern(fragment).search(cmdline)),
        None,
    )


def is_runtime_helper(cmdline: str) -> bool:
    """Whether a ``RUNTIME_HELPERS`` fragment is in a command line as a whole name or path."""
    return runtime_helper_name(cmdline) not in (None, "spawn worker")


def is_daemon_helper(cmdline: str) -> bool:
    """Whether a command line is of a helper that daemonizes by design (``DAEMON_HELPERS``)."""
    return runtime_helper_name(cmdline) in DAEMON_HELPERS


LOADER_WORKER_NAME = "pt_data_worker"  # the name torch gives a DataLoader worker's process


def direct_child_role(
    key: ProcessKey, known_workers: Collection[ProcessKey] = (), *, name: str = ""
) -> Role:
    """``worker`` if known or torch-named a loader worker, else ``descendant`` (NOTE above)."""
    return "worker" if key in known_workers or name == LOADER_WORKER_NAME else "descendant"
