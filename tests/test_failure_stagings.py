"""``leakcheck sweep --scenario oom|shm-full|hang``: each failure staged for real, on a CPU machine.

The real command in a fresh interpreter, as a user runs it (NOTE [failure stagings] in
workload.py): the kernel's OOM killer under a memory cgroup the sweep makes for itself, a
private /dev/shm too small for the batches, a worker blocked in ``__getitem__``. A machine
that cannot stage one (no writable memory cgroup, no right to mount) gets a one-line usage
error, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from leakcheck.commands.cli import main
from leakcheck.observe import machine

REPO = Path(__file__).resolve().parents[1]


def sweep(scenario: str, tmp_path: Path, *extra: str, prefix: tuple[str, ...] = ()) -> Any:
    """Run the staging; its exit status, stderr and JSON (None where none was written)."""
    out = tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    command = [sys.executable, "-m", "leakcheck", "sweep", "--scenario", scenario]
    done = subprocess.run(
        [*prefix, *command, "--epochs", "1", "--grace", "0.5", "--json", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,  # each ends on its own in seconds; a loaded machine gets room
    )
    data = json.loads(out.read_text()) if out.exists() else None
    return done, data


def _own_cgroup() -> str:
    found = machine.own_memory_cgroup()
    assert found is not None
    return found[0]


def findings(data: dict[str, Any], rule: str) -> list[dict[str, Any]]:
    [config] = data["configurations"]
    return [f for f in config["report"]["findings"] if f["rule"] == rule]


def test_oom_a_worker_the_kernel_kills_under_the_jobs_memory_limit_is_named(
    tmp_path: Path,
) -> None:
    done, data = sweep("oom", tmp_path, "--workers", "1")
    unstageable = ("no writable memory cgroup", "cannot limit a memory cgroup")
    if done.returncode == 2 and any(why in done.stderr for why in unstageable):
        # e.g. a cgroup v2 parent that does not delegate the memory controller (the H200 host)
        own = _own_cgroup()
        assert not [n for n in os.listdir(own) if n.startswith("leakcheck-oom-")]
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    [died] = findings(data, "died")
    assert "was killed by the OOM killer (SIGKILL) in epoch 0" in died["message"]
    assert "OOM kills of its memory cgroup +1" in died["message"]
    assert "exited unexpectedly" in data["configurations"][0]["failure"]
    own = _own_cgroup()  # the sweep's cgroup is gone with it
    assert not [name for name in os.listdir(own) if name.startswith("leakcheck-oom-")]


def test_oom_without_a_writable_memory_cgroup_is_a_one_line_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(machine, "CGROUP_ROOT", str(tmp_path / "no-cgroups"))
    assert main(["sweep", "--scenario", "oom", "--workers", "1", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leakcheck sweep: --scenario oom: no writable memory cgroup here (")
    assert len(err.splitlines()) == 1


def test_shm_full_the_batches_meet_a_small_private_dev_shm(tmp_path: Path) -> None:
    """torch reserves each segment (posix_fallocate), so a full /dev/shm fails the batch in the
    worker (ENOSPC, or EAGAIN) rather than killing it with SIGBUS: the loader's error, the failed
    segments torch left behind, and (where a read caught it) the use near full are what
    leakcheck sees."""
    done, data = sweep("shm-full", tmp_path, "--workers", "2")
    if done.returncode == 2 and "--scenario shm-full: cannot" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    # ENOSPC from torch 2.13's posix_fallocate; torch 2.11 on the H200 host said EAGAIN (11)
    assert "unable to allocate shared memory" in data["configurations"][0]["failure"]
    left = [f for f in findings(data, "shm") if f["shm_name"]]
    assert left and all(f["shm_name"].startswith("torch_") for f in left)
    assert all("reservation failed: /dev/shm was full" in f["message"] for f in left)
    for item in left:  # in the job's own /dev/shm, gone with it: the machine's is untouched
        assert not os.path.exists(os.path.join("/dev/shm", item["shm_name"]))


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv to drop capabilities")
def test_shm_full_without_the_right_to_mount_is_a_one_line_usage_error(tmp_path: Path) -> None:
    no_caps = ("setpriv", "--inh-caps=-all", "--bounding-set=-all", "--")
    done, data = sweep("shm-full", tmp_path, "--workers", "1", prefix=no_caps)
    assert done.returncode == 2 and data is None
    assert done.stderr == (
        "leakcheck sweep: --scenario shm-full: cannot give the job a /dev/shm "
        "(Operation not permitted)\n"
    )


def test_hang_a_blocked_worker_is_shown_and_the_sweep_ends(tmp_path: Path) -> None:
    done, data = sweep("hang", tmp_path, "--workers", "1")
    assert done.returncode == 0, done.stderr
    [hang] = findings(data, "hang")
    assert "in epoch 0" in hang["message"]
    assert "in _stage_in_worker (workload.py:" in hang["message"]  # the worker, where it waits
    assert "in __getitem__" in hang["stack"] and "the loop's process" in hang["stack"]
    assert "the stacks of the job" in done.stderr
    assert data["configurations"][0]["failure"] is None  # the loop went on
