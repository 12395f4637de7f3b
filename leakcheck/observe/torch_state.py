"""Whether this process has a CUDA context through torch, asked without making one.

leakcheck never imports torch for the user and never initialises CUDA: reading the allocator,
emptying its cache or resetting a device in a process that had no context would create one
(hundreds of MiB on the GPU), and in a forked child of a CUDA parent it would fail. So every
module that touches torch's CUDA state asks here first.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def initialized_cuda() -> Any | None:
    """``torch.cuda`` where torch is imported and CUDA is initialised in this process.

    Returns None where torch was never imported (it is not imported here), where CUDA was
    never initialised, in a forked child of a CUDA parent (whose inherited state must not be
    touched), or where asking raised.
    """
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
    """Give back what torch's libraries keep in the allocator (cuBLAS workspaces).

    After the first matrix product cuBLAS keeps a workspace per handle and stream in torch's
    allocator: allocated bytes that no tensor of the caller's holds. Anything that judges
    "still allocated" clears them first. Best effort: a torch without the call is left as is.
    """
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    clear = getattr(torch_c, "_cuda_clearCublasWorkspaces", None)
    if callable(clear):
        with contextlib.suppress(Exception):
            clear()


def current_device() -> int | None:
    """The current CUDA device index of torch in this process, where CUDA is initialised here.

    None where it is not (asking would make a context), or where asking raised.
    """
    cuda = initialized_cuda()
    if cuda is None:
        return None
    try:
        return int(cuda.current_device())
    except Exception:
        return None
