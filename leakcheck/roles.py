"""What a process is, from its command line: the one list of runtime helpers.

Libraries start some processes once and keep them for the rest of the process's life, by
design: multiprocessing's resource tracker and fork server, joblib's reusable executor,
torch's shared-memory manager and compile workers. Like the first CUDA context, they are a
baseline, not a leak (unless they hold GPU memory or ``/dev/nvidia*`` descriptors, which
the callers check). Every adapter asks here.
"""

from __future__ import annotations

__all__ = ["RUNTIME_HELPERS", "is_runtime_helper"]

RUNTIME_HELPERS: tuple[str, ...] = (
    "multiprocessing.resource_tracker",
    "multiprocessing.semaphore_tracker",
    "multiprocessing.forkserver",
    "loky.backend.resource_tracker",
    "loky.backend.popen_loky_posix",
    "torch_shm_manager",
    "torch._inductor.compile_worker",
)
"""Command-line fragments of the helper processes a library starts once and keeps."""


def is_runtime_helper(cmdline: str) -> bool:
    """Whether a command line is one of the runtime helpers (``RUNTIME_HELPERS``)."""
    return any(fragment in cmdline for fragment in RUNTIME_HELPERS)
