"""Torch's CUDA state in this process, asked without making a context.

leakcheck never imports torch nor initialises CUDA: touching a device in a process without a
context would make one (hundreds of MiB), and in a forked child of a CUDA parent it would
fail. Every module that touches torch's CUDA state asks here first.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any


def initialized_cuda() -> Any | None:
    """``torch.cuda`` where torch is imported and CUDA initialised here (not inherited by fork)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized() or cuda._is_in_bad_fork():
            return None
    except Exception:
        return None
    return cuda


def clear_library_workspaces() -> None:
    """Give back the cuBLAS workspaces torch keeps after a first matrix product (best effort).

    Allocated bytes no tensor holds: anything that judges "still allocated" clears them first.
    """
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    clear = getattr(torch_c, "_cuda_clearCublasWorkspaces", None)
    if callable(clear):
        with contextlib.suppress(Exception):
            clear()


def current_device() -> int | None:
    """The current CUDA device of torch; None where CUDA is not initialised, or asking raised."""
    cuda = initialized_cuda()
    if cuda is None:
        return None
    try:
        return int(cuda.current_device())
    except Exception:
        return None


def pinned_host_bytes() -> tuple[int, int] | None:
    """``(allocated, reserved)`` bytes of torch's caching host (pinned) allocator here.

    Allocated: blocks handed out to tensors (``active_bytes``); reserved: every block it owns
    (``allocated_bytes``). None as ``current_device``, or where the call is missing.
    """
    stats = getattr(initialized_cuda(), "host_memory_stats", None)
    if stats is None:
        return None
    try:
        found = stats()
        return int(found["active_bytes.current"]), int(found["allocated_bytes.current"])
    except Exception:
        return None


def allocator_bytes(*, collect: bool = False) -> tuple[dict[int, int], dict[int, int]] | None:
    """``(allocated, reserved)`` bytes of torch's CUDA allocator per device here.

    ``collect`` first frees what only cycles, the cache and cuBLAS workspaces hold (NVML still
    counts cached blocks). None as ``initialized_cuda``.
    """
    cuda = initialized_cuda()
    if cuda is None:
        return None
    try:
        if collect:
            gc.collect()
            clear_library_workspaces()
            cuda.empty_cache()
        devices = range(int(cuda.device_count()))
        allocated = {d: int(cuda.memory_allocated(d)) for d in devices}
        return allocated, {d: int(cuda.memory_reserved(d)) for d in devices}
    except Exception:
        return None
