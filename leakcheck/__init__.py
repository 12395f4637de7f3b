"""leakcheck: find and stop GPU memory and process leaks caused by data-loader workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leakcheck.core.errors import (
    GPULeakError,
    GPULeakWarning,
    LeakCheckError,
    LeakError,
    LeakWarning,
    NVMLUnavailable,
)

__version__ = "0.1.0"

__all__ = [
    "GPULeakError",
    "GPULeakWarning",
    "LeakCheckError",
    "LeakError",
    "LeakWarning",
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
    "Tracker": "leakcheck.track.tracker",
    "Report": "leakcheck.judge.report",
    "watch": "leakcheck.adapters.dataloader",
    "gather_reports": "leakcheck.adapters.distributed",
    "worker_init_fn": "leakcheck.worker.teardown",
    "register_resource": "leakcheck.worker.teardown",
    "release_device": "leakcheck.worker.teardown",
}

if TYPE_CHECKING:
    from leakcheck.adapters.dataloader import watch
    from leakcheck.adapters.distributed import gather_reports
    from leakcheck.judge.report import Report
    from leakcheck.track.tracker import Tracker
    from leakcheck.worker.teardown import register_resource, release_device, worker_init_fn


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'leakcheck' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
