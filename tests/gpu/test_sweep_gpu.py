"""``leakcheck sweep`` on a real GPU: the built-in workload's scenarios, as a user runs them.

Every sweep runs as ``python -m leakcheck sweep`` in its own interpreter, so CUDA is never
initialised in the pytest process. The sweep drives ``watch()``'s code path, so every worker
reports who it is and, at exit, what it held (``--no-teardown``: it only reports). Each test
prints the sweep's text output (``-s`` shows it) for the GPU test log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from leakcheck.observe import procs

pytestmark = pytest.mark.gpu

MIB = 2**20
REPO = Path(__file__).resolve().parents[2]
CACHE_MIB_PER_EPOCH = 64  # WorkloadSpec.cache_bytes_per_epoch
ORPHAN_MIB = 256  # WorkloadSpec.orphan_bytes


def sweep(
    tmp_path: Path, name: str, *args: str, timeout: float = 580
) -> tuple[int, str, dict[str, Any]]:
    json_path = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    done = subprocess.run(
        [sys.executable, "-m", "leakcheck", "sweep", *args, "--json", str(json_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(f"$ leakcheck sweep {' '.join(args)}  -> exit {done.returncode}")
    print(done.stdout)
    if done.returncode not in (0, 1):
        pytest.fail(f"sweep exited {done.returncode}: {done.stderr[-2000:]}")
    return done.returncode, done.stdout, json.loads(json_path.read_text())


def findings(config: dict[str, Any], rule: str | None = None) -> list[dict[str, Any]]:
    return [f for f in config["report"]["findings"] if rule is None or f["rule"] == rule]


def test_default_sweep_has_no_leaks(tmp_path: Path) -> None:
    status, text, data = sweep(
        tmp_path, "default", "--workers", "0,4,8", "--epochs", "5", "--fail-on-leak",
        "--plot", str(tmp_path / "default.png"),
    )  # fmt: skip
    assert status == 0, text
    assert data["gpu"]["available"] is True
    assert data["leak_count"] == 0
    attributed = 0
    for config in data["configurations"]:
        # Advice only (the parent keeps its context after the 0-worker run; clocks stay high).
        assert {f["severity"] for f in findings(config)} <= {"info"}, findings(config)
        assert len(config["rows"]) == 5
        if config["num_workers"]:
            teardown = config["teardown"]
            assert teardown["workers"] == 5 * config["num_workers"]
            assert teardown["contexts_released"] == teardown["workers"]
            # Workers really used the GPU: each held a context during the epoch.
            for row in config["rows"]:
                assert row["worker_count"] == config["num_workers"]
                assert row["workers_peak_unknown"] == 0, row
                assert row["workers_peak_reported"] == config["num_workers"], row
                assert row["workers_gpu_bytes_peak"] >= config["num_workers"] * 200 * MIB
                assert row["alive_after"] == 0 and row["orphans"] == 0
            attributed += assert_peaks_are_what_workers_reported(config)
    assert (tmp_path / "default.png").read_bytes()[:4] == b"\x89PNG"
    print(f"every worker of every epoch attributed within 2 MiB of what it reported: {attributed}")


def assert_peaks_are_what_workers_reported(config: dict[str, Any]) -> int:
    """Each worker's epoch peak is within 2 MiB of what it reported at exit, per device.

    The report's ``teardowns`` (what each worker read of its own NVML entry just before the
    release) against the epoch's ``ProcessEpoch.gpu_bytes_peak`` of that worker. Returns
    how many workers were checked.
    """
    teardowns: dict[int, list[dict[str, Any]]] = {}
    for record in config["report"]["teardowns"]:
        teardowns.setdefault(record["key"]["pid"], []).append(record)
    checked = 0
    for epoch in config["report"]["epochs"]:
        workers = [p for p in epoch["processes"] if p["role"] == "worker"]
        assert len(workers) == config["num_workers"], epoch["processes"]
        for proc in workers:
            key = proc["key"]
            (teardown,) = [
                t
                for t in teardowns.get(key["pid"], [])
                if t["key"]["start_ticks"] == key["start_ticks"]
            ]
            held = teardown["gpu_bytes_by_device"]
            assert held is not None, teardown
            assert proc["gpu_peak_source"] == "reported", proc
            peak = proc["gpu_bytes_peak"]
            for device in set(held) | set(peak):
                difference = abs(peak.get(device, 0) - held.get(device, 0))
                assert difference <= 2 * MIB, (epoch["index"], proc, teardown)
            checked += 1
    return checked


def test_persistent_cache_growth_per_worker(tmp_path: Path) -> None:
    status, text, data = sweep(
        tmp_path, "cache", "--scenario", "persistent-cache", "--workers", "0,2",
        "--epochs", "5", "--fail-on-leak",
    )  # fmt: skip
    assert status == 1, text
    parent_run, worker_run = data["configurations"]
    growth = [f for f in findings(parent_run, "growth") if f["role"] == "parent"]
    assert len(growth) == 1, findings(parent_run)
    assert growth[0]["bytes_per_epoch"] / MIB == pytest.approx(CACHE_MIB_PER_EPOCH, abs=4)
    growth = [f for f in findings(worker_run, "growth") if f["role"] == "worker"]
    assert len(growth) == 2, findings(worker_run)
    for finding in growth:
        assert finding["bytes_per_epoch"] / MIB == pytest.approx(CACHE_MIB_PER_EPOCH, abs=4)
    assert worker_run["persistent_workers"] is True


def test_orphan_found_with_its_memory_and_cleaned_up(tmp_path: Path) -> None:
    status, text, data = sweep(
        tmp_path, "orphan", "--scenario", "orphan", "--workers", "2", "--epochs", "2",
        "--fail-on-leak",
    )  # fmt: skip
    assert status == 1, text
    (config,) = data["configurations"]
    orphans = findings(config, "orphan")
    assert len(orphans) == 4, findings(config)  # one per worker per epoch
    for finding in orphans:
        assert finding["gpu_bytes"] >= ORPHAN_MIB * MIB
    cleaned = {(c["pid"], c["outcome"]) for c in config["cleanup"]}
    assert cleaned == {(f["pid"], "terminated") for f in orphans}
    for finding in orphans:  # gone, or the PID was reused
        assert procs.process_key(finding["pid"]) != (finding["pid"], finding["start_ticks"])


def test_teardown_frees_each_workers_context(tmp_path: Path) -> None:
    args = ("--workers", "2", "--epochs", "2", "--fail-on-leak")
    status_on, _, with_policy = sweep(tmp_path, "teardown", *args)
    status_off, _, without = sweep(tmp_path, "no-teardown", *args, "--no-teardown")
    assert status_on == 0
    on = with_policy["configurations"][0]["teardown"]
    off = without["configurations"][0]["teardown"]
    assert on["workers"] == 4 and on["contexts_released"] == 4
    assert on["gpu_bytes_before_per_worker"] >= 200 * MIB  # about one CUDA context each
    assert off["workers"] == 0  # the policy released nothing...
    assert off["reported"] == 4  # ... and each worker still said what it held at exit
    print(
        f"teardown freed {on['gpu_bytes_before_per_worker'] / MIB:.0f} MiB per worker "
        f"({on['left_nvml']} of {on['workers']} left NVML before exiting)"
    )
    assert status_off in (0, 1)
