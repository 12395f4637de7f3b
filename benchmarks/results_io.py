"""Where benchmark results go: ``benchmarks/results/<stem>.json`` and ``.md``, side by side."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def host_meta() -> dict[str, Any]:
    """When and where a benchmark ran: date, host, CPU count and Python version."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def gpu_meta() -> dict[str, str]:
    """Name of GPU 0 and the driver version, as the results record them (NVML must work)."""
    from leakcheck import nvml

    handle = nvml.get()
    return {
        "gpu": handle.memory()[0].name,
        "driver": handle.driver_version() or "unknown",
    }


def stamped(kind: str) -> str:
    """A result file's stem: its kind, then the local date and time (``sweep-20261130-012215``)."""
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_result(stem: str, payload: Any, text: str) -> str:
    """Write the run's data as JSON and its table as Markdown; return the path stem."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, stem)
    with open(path + ".json", "w") as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")
    with open(path + ".md", "w") as handle:
        handle.write(text + "\n")
    return path
