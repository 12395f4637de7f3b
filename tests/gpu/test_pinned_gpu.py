"""The loop's pinned host memory on the GPU: ``pin_memory=True`` batches, kept or not.

The loop runs in its own interpreter (tests/gpu/pinned_job.py: CUDA is never initialised in
the pytest process), through ``watch()`` and unmodified under ``leakcheck run``. What grows is
torch's caching host allocator, read with ``torch.cuda.host_memory_stats()``.
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

JOB = Path(__file__).with_name("pinned_job.py")
ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _job(mode: str, tmp_path: Path, *, run: bool) -> tuple[dict[str, Any], str]:
    """The report of one run of the job (``watch()``'s, or its loader's under ``run``)."""
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = [sys.executable, str(JOB), mode, "plain" if run else "watch", str(out)]
    command = [sys.executable, "-m", "leakcheck", "run", "--json", str(out), "--", *job]
    done = subprocess.run(
        command if run else job, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    if run:
        [loader] = data["loaders"]
        data = {**loader["report"], "pid": loader["pid"]}
    return data, done.stderr


@pytest.mark.parametrize("run", [False, True], ids=["watch", "run"])
def test_pinned_batches_kept_across_steps_are_named_as_growth(tmp_path: Path, run: bool) -> None:
    report, stderr = _job("keep", tmp_path, run=run)
    reserved = [e["pinned_reserved_bytes"] for e in report["epochs"]]
    assert None not in reserved and reserved[-1] - reserved[1] >= 3 * 64 * MIB, reserved
    [finding] = [f for f in report["findings"] if f["rule"] == "pinned-growth"]
    assert finding["pid"] == report["pid"] and finding["role"] == "parent", finding
    assert "pinned host memory grows" in finding["message"]
    assert finding["bytes_per_epoch"] >= 60 * MIB
    if run:
        assert "pinned host memory grows" in stderr
    else:
        assert "pinned MiB" in report["text"]


@pytest.mark.parametrize("run", [False, True], ids=["watch", "run"])
def test_pinned_batches_dropped_after_their_step_are_clean(tmp_path: Path, run: bool) -> None:
    report, _ = _job("clean", tmp_path, run=run)
    reserved = [e["pinned_reserved_bytes"] for e in report["epochs"]]
    allocated = [e["pinned_allocated_bytes"] for e in report["epochs"]]
    assert None not in reserved and reserved[0] > 0, reserved  # read: CUDA was in use
    assert None not in allocated, allocated
    assert not [f for f in report["findings"] if f["rule"] == "pinned-growth"], reserved
