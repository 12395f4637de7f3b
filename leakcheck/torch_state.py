"""Whether this process has a CUDA context through torch, asked without making one.

leakcheck never imports torch for the user and never initialises CUDA: reading the allocator,
emptying its cache or resetting a device in a process that had no context would create one
(hundreds of MiB on the GPU), and in a forked child of a CUDA parent it would fail. So every
module that touches torch's CUDA state asks here first.
"""

from __future__ import annotations

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
