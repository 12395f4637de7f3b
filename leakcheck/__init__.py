"""leakcheck: find and stop GPU memory and process leaks caused by data-loader workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leakcheck.errors import GPULeakError, GPULeakWarning, LeakCheckError, NVMLUnavailable

__version__ = "0.1.0"

__all__ = [
    "GPULeakError",
    "GPULeakWarning",
    "LeakCheckError",
    "NVMLUnavailable",
    "Report",
    "Tracker",
    "__version__",
    "gather_reports",
    "register_resource",
    "release_device",
    "watch",
    "worker_init_fn",
]

# Imported on first use: `import leakcheck` must stay cheap (the pytest plugin imports it in
# every session, flag on or off) and must never import torch.
_LAZY = {
    "Tracker": "leakcheck.tracker",
    "Report": "leakcheck.report",
    "watch": "leakcheck.dataloader",
    "gather_reports": "leakcheck.distributed",
    "worker_init_fn": "leakcheck.teardown",
    "register_resource": "leakcheck.teardown",
    "release_device": "leakcheck.teardown",
}

if TYPE_CHECKING:
    from leakcheck.dataloader import watch
    from leakcheck.distributed import gather_reports
    from leakcheck.report import Report
    from leakcheck.teardown import register_resource, release_device, worker_init_fn
    from leakcheck.tracker import Tracker


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'leakcheck' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
