"""Deaths and hangs inside a CUDA training loop (the ``died`` and ``hang`` rules) on the GPU.

The loop runs in its own interpreter (tests/gpu/deaths_job.py: CUDA is never initialised in
the pytest process); its workers hold CUDA contexts. A real OOM kill needs a memory cgroup
the test may set a limit on: not staged here (tests/test_deaths.py fakes the counter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

JOB = Path(__file__).with_name("deaths_job.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(JOB), mode, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    data["stderr"] = done.stderr
    return data


def test_a_worker_killed_in_a_cuda_loop_is_named_and_the_loaders_error_stays(
    tmp_path: Path,
) -> None:
    data = _run("kill", tmp_path)
    assert "DataLoader worker" in data["error"]  # the DataLoader's own error, unchanged
    died = [f for f in data["findings"] if f["rule"] == "died"]
    assert len(died) == 1, data
    assert died[0]["pid"] in data["workers"]
    assert "SIGKILL" in died[0]["message"], died[0]


def test_a_worker_blocked_in_a_cuda_loop_has_its_stack_shown_and_the_loop_goes_on(
    tmp_path: Path,
) -> None:
    data = _run("hang", tmp_path)
    assert data["error"] == "", data
    [hang] = [f for f in data["findings"] if f["rule"] == "hang"]
    assert hang["stack"] is not None and "in __getitem__" in hang["stack"], (hang, data)
    assert "the loop's process" in hang["stack"]
    assert "the stacks of the job" in data["stderr"]
