"""Where benchmark results go: ``benchmarks/results/<stem>.json`` and ``.md``, side by side.

A stem names the benchmark, the machine and the variant, never a date
(``watch-h200``, ``snapshot-cpu-64children``, ``watch-h200-control``): each run overwrites the
current result of its benchmark on its machine, and git keeps the ones before it.
"""

from __future__ import annotations

import json
import os
import platform
import re
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
    from leakcheck.observe import nvml
    handle = nvml.get()
    return {
        "gpu": handle.memory()[0].name,
        "driver": handle.driver_version() or "unknown",
    }


def machine() -> str:
    """The machine a result belongs to: GPU 0's model where NVML sees one (``h200``), or ``cpu``."""
    from leakcheck.observe import nvml
    ok, _reason = nvml.availability()
    devices = nvml.get().memory() if ok else ()
    if not devices:
        return "cpu"
    model = devices[0].name.lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "gpu"


def result_stem(benchmark: str, *variants: str) -> str:
    """A result file's stem: ``<benchmark>-<machine>``, then each non-empty variant.

    Args:
        benchmark: The benchmark, with its operation where it has one (``driver-context``).
        variants: What sets this result apart from the benchmark's default run on the machine
            (``64children``, ``control``); empty strings are left out.

    """
    return "-".join([benchmark, machine(), *(variant for variant in variants if variant)])


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
