"""Run a GPU scenario as its own job: a script file, the job's root, that prints its result.

Each scenario runs in its own interpreter, so CUDA is never initialised in the pytest process
and each job's lineage is its own. A file, not ``python -c``: spawned children re-import
``__main__`` by its path to find their targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_PREFIX = "RESULT "


def run_job(path: str, timeout_s: float) -> dict[str, Any]:
    """Run the script at ``path`` with leakcheck importable; return its last RESULT line."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, path],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"no result; stdout: {done.stdout[-2000:]} stderr: {done.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return result


def leaks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The findings of severity ``leak`` in a ``Report.to_dict()``."""
    return [f for f in report["findings"] if f["severity"] == "leak"]


def processes(report: dict[str, Any], role: str) -> list[dict[str, Any]]:
    """Every epoch's processes of ``role`` in a ``Report.to_dict()``, epoch by epoch."""
    return [p for e in report["epochs"] for p in e["processes"] if p["role"] == role]


def reported_gpu_bytes(report: dict[str, Any]) -> dict[tuple[int, int], int]:
    """(pid, start_ticks) -> the GPU bytes each worker reported holding as it exited."""
    return {
        (t["key"]["pid"], t["key"]["start_ticks"]): sum(t["gpu_bytes_by_device"].values())
        for t in report["teardowns"]
    }


def key_of(process: dict[str, Any]) -> tuple[int, int]:
    """A process's (pid, start_ticks), as ``reported_gpu_bytes`` keys it."""
    return process["key"]["pid"], process["key"]["start_ticks"]
