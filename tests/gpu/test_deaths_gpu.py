"""Deaths and hangs inside a CUDA training loop (the ``died`` and ``hang`` rules) on the GPU.

The loop runs in its own interpreter (tests/gpu/deaths_job.py: CUDA is never initialised in
the pytest process); its workers hold CUDA contexts. The OOM kill is real: the job runs in a
memory cgroup the test makes and limits (skipped, with the reason, where none can be made).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def _memory_cgroup(limit_bytes: int) -> Path:
    """A new memory cgroup of ``limit_bytes`` (v2 or v1), or the reason none can be made here."""
    name = f"leakcheck-oom-{os.getpid()}"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists():
        if "memory" not in (v2 / "cgroup.subtree_control").read_text().split():
            pytest.skip("cgroup v2 without the memory controller for child cgroups here")
        folder = v2 / name
        folder.mkdir()
        (folder / "memory.max").write_text(str(limit_bytes))
        if (folder / "memory.swap.max").exists():
            (folder / "memory.swap.max").write_text("0")
        return folder
    v1 = Path("/sys/fs/cgroup/memory")
    if not v1.is_dir():
        pytest.skip("no memory cgroup controller mounted")
    folder = v1 / name
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return folder


def test_a_worker_the_oom_killer_ends_under_a_memory_limit_is_named_oom(tmp_path: Path) -> None:
    """A real OOM kill: the job runs in a memory cgroup of 12 GiB; one worker grows past it."""
    try:
        folder = _memory_cgroup(12 * 2**30)
    except OSError as exc:
        pytest.skip(f"no memory cgroup can be made here: {exc}")
    os.environ["LEAKCHECK_TEST_CGROUP"] = str(folder)
    try:
        data = _run("oom", tmp_path)
    finally:
        del os.environ["LEAKCHECK_TEST_CGROUP"]
        for _ in range(50):  # empty once the job's processes are gone
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    assert "DataLoader worker" in data["error"], data
    [died] = [f for f in data["findings"] if f["rule"] == "died"]
    assert died["pid"] in data["workers"]
    assert "was killed by the OOM killer (SIGKILL)" in died["message"], died
    assert "OOM kills of its memory cgroup +1" in died["message"], died
