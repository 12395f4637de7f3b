"""Ranks from torchrun's environment, and the device-mismatch rule, on made-up data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from leakcheck.core.model import Finding, RankInfo, RuleConfig
from leakcheck.core.ranks import (
    EXPORTED_RANK_ENV,
    export_rank,
    physical_device,
    rank_from_environ,
)
from leakcheck.judge import verdict
from leakcheck.judge.job import judge_job
from leakcheck.judge.report import build_report, leak_short
from leakcheck.observe import procs
from tests.timelines import device, epoch, final_state, mib, parent, proc, timeline

ROOT = Path(__file__).resolve().parents[1]
CONFIG = RuleConfig(tolerance_bytes=mib(16), grace_s=2.0)

TORCHRUN_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RUN_ID": "job-7",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


# --------------------------------------------------------------------------- parsing


def test_rank_from_torchrun_environment() -> None:
    assert rank_from_environ(TORCHRUN_ENV) == RankInfo(
        rank=3,
        local_rank=1,
        world_size=4,
        node_rank=1,
        run_id="job-7",
        restart_count=2,
        device=1,
    )


def test_no_rank_outside_a_distributed_job() -> None:
    assert rank_from_environ({}) is None
    assert rank_from_environ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}) is None


def test_a_rank_lightnings_ddp_launcher_started_is_its_local_rank_on_one_node() -> None:
    lightning = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}  # no RANK
    assert rank_from_environ(lightning) == RankInfo(rank=1, local_rank=1, world_size=2, device=1)
    # Another node's global rank is not its local one: unknown there.
    assert rank_from_environ({**lightning, "NODE_RANK": "1"}) is None


@pytest.mark.parametrize("bad", ["", "-1", "one", "1.0", "\uff12"])
def test_malformed_rank_is_no_rank(bad: str) -> None:
    assert rank_from_environ({"RANK": bad}) is None


def test_malformed_optional_variables_are_unknown() -> None:
    info = rank_from_environ({"RANK": "1", "LOCAL_RANK": "x", "WORLD_SIZE": "", "GROUP_RANK": "?"})
    assert info == RankInfo(rank=1)


def test_device_follows_cuda_visible_devices() -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    info = rank_from_environ(env)
    assert info is not None and info.device == 3
    assert physical_device(0, {"CUDA_VISIBLE_DEVICES": "5"}) == 5
    assert physical_device(1, {"CUDA_VISIBLE_DEVICES": "5"}) is None  # not visible
    assert physical_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-1234"}) is None  # a UUID: unknown
    assert physical_device(4, {}) == 4


def test_a_rank_leakcheck_exported_is_read_back_and_rank_wins() -> None:
    """NOTE [exported rank]: a spawned rank's rank, in what it starts."""
    info = RankInfo(rank=3, local_rank=1, world_size=4, device=1)
    env: dict[str, str] = {}
    export_rank(info, env)
    assert env == {EXPORTED_RANK_ENV: "3,1,4"}
    assert rank_from_environ(env) == info
    assert rank_from_environ({**env, "CUDA_VISIBLE_DEVICES": "2,5"}) == replace(info, device=5)
    unknown: dict[str, str] = {}
    export_rank(RankInfo(rank=0), unknown)
    assert unknown == {EXPORTED_RANK_ENV: "0,,"}
    assert rank_from_environ(unknown) == RankInfo(rank=0)
    # Written only where the environment does not say that rank already.
    launched = dict(TORCHRUN_ENV)
    export_rank(RankInfo(rank=3, local_rank=1, world_size=4), launched)  # RANK says it
    assert launched == TORCHRUN_ENV
    inherited = {EXPORTED_RANK_ENV: "0,0,2"}  # from the process that started this one
    export_rank(RankInfo(rank=1, local_rank=1, world_size=2), inherited)
    assert inherited == {EXPORTED_RANK_ENV: "1,1,2"}
    assert rank_from_environ({**env, **TORCHRUN_ENV}) == rank_from_environ(TORCHRUN_ENV)
    for bad in ("", "x,1,2", "1,2", "-1,,", ",,"):
        assert rank_from_environ({EXPORTED_RANK_ENV: bad}) is None, bad


def test_a_short_leak_carries_the_rank_where_known() -> None:
    finding = Finding("orphan", "leak", "m", "r", pid=123, role="worker", rank=1)
    assert leak_short(finding) == "orphan rank 1 worker PID 123"
    assert leak_short(replace(finding, rank=None)) == "orphan worker PID 123"


def test_environ_variables_reads_a_real_process() -> None:
    env = {**os.environ, "RANK": "5", "LOCAL_RANK": "0"}
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        # Read once it has exec'd: before, /proc/PID/environ is still this process's.
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        found = procs.environ_variables(child.pid, ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        assert found == {"RANK": "5", "LOCAL_RANK": "0"}
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    assert procs.environ_variables(child.pid, ("RANK",)) is None  # gone: unknown


# --------------------------------------------------------------------------- device mismatch


def test_worker_with_a_context_on_another_gpu_is_a_device_mismatch() -> None:
    worker = replace(proc(201, gpu_mib={0: 520}), rank=1, rank_device=1)
    rank_parent = replace(parent({1: 700}), rank=1, rank_device=1)
    tl = timeline([epoch(0, [rank_parent, worker], [device(0, 520), device(1, 700)])])
    found = verdict.device_mismatch(tl, CONFIG)
    assert len(found) == 1
    finding = found[0]
    assert (finding.rule, finding.severity, finding.pid, finding.rank) == (
        "device-mismatch",
        "leak",
        201,
        1,
    )
    assert finding.device_index == 0 and finding.gpu_bytes == mib(520)
    assert "rank 1 worker of worker_201.py (PID 201)" in finding.message
    assert "GPU0 520 MiB" in finding.message and "trains on GPU1" in finding.message
    assert "device-mismatch" in [f.rule for f in verdict.judge(tl, CONFIG)]


def test_a_device_mismatch_seen_from_outside_counts_for_its_rank() -> None:
    """The outside tracker (``leakcheck run``'s) judges rank 1's stray context: the finding
    carries the rank, so it is named with it and counted as rank 1's leak, not the job's."""
    worker = replace(proc(201, gpu_mib={0: 520}), rank=1, rank_device=1)
    rank_parent = replace(parent({1: 700}), rank=1, rank_device=1)
    tl = timeline([epoch(0, [rank_parent, worker], [device(0, 520), device(1, 700)])])
    outside = build_report(tl, CONFIG)
    (finding,) = outside.leaks
    assert (finding.rule, finding.rank) == ("device-mismatch", 1)
    assert leak_short(finding) == "device-mismatch rank 1 worker PID 201 (520 MiB)"
    assert "LEAK device-mismatch  rank 1 worker of worker_201.py (PID 201) " in outside.format()
    job = judge_job([], [outside])
    assert [(r.rank, r.verdict) for r in job.ranks] == [(1, "leak")]
    assert job.ranks[0].leaks == (finding,) and job.leaks == (finding,)
    assert "; 1 leak: device-mismatch rank 1 worker PID 201 (520 MiB)" in job.format()


def test_memory_on_the_rank_own_gpu_is_no_mismatch() -> None:
    worker = replace(proc(201, gpu_mib={1: 520}), rank=1, rank_device=1)
    tl = timeline([epoch(0, [parent(None), worker])])
    assert verdict.device_mismatch(tl, CONFIG) == ()


def test_set_device_record_wins_over_local_rank() -> None:
    # LOCAL_RANK says GPU0, but the rank called torch.cuda.set_device(1): GPU1 is its own.
    worker = replace(proc(201, gpu_mib={1: 520}), rank=1, rank_device=0)
    tl = replace(timeline([epoch(0, [worker])]), rank_devices={1: 1})
    assert verdict.device_mismatch(tl, CONFIG) == ()
    stray = replace(proc(202, gpu_mib={0: 520}), rank=1, rank_device=0)
    tl = replace(timeline([epoch(0, [stray])]), rank_devices={1: 1})
    assert [f.pid for f in verdict.device_mismatch(tl, CONFIG)] == [202]


GPUS_0_TO_3 = [device(index) for index in range(4)]


def test_peak_on_another_gpu_counts_even_when_freed_by_the_end() -> None:
    worker = replace(proc(201, gpu_mib={}, peak_mib={0: 600}), rank=0, rank_device=1)
    tl = timeline([epoch(0, [worker])], baseline=GPUS_0_TO_3)
    (finding,) = verdict.device_mismatch(tl, CONFIG)
    assert finding.gpu_bytes == mib(600)


def test_below_tolerance_unknown_rank_or_no_per_pid_bytes_is_not_judged() -> None:
    small = replace(proc(201, gpu_mib={0: 8}), rank=1, rank_device=1)
    unranked = proc(202, gpu_mib={0: 520})
    no_device = replace(proc(203, gpu_mib={0: 520}), rank=1, rank_device=None)
    tl = timeline([epoch(0, [small, unranked, no_device])])
    assert verdict.device_mismatch(tl, CONFIG) == ()
    stray = replace(proc(204, gpu_mib={0: 520}), rank=1, rank_device=1)
    blind = timeline([epoch(0, [stray])], attribution="blind-namespace")
    assert verdict.device_mismatch(blind, CONFIG) == ()


def test_orphan_after_the_job_on_another_gpu_is_named_once_per_device() -> None:
    orphan = replace(proc(301, "orphan", gpu_mib={0: 610}), rank=2, rank_device=2)
    rec = epoch(0, [parent(None)])
    tl = timeline([rec], final=final_state([orphan], after_last_epoch=[rec]), baseline=GPUS_0_TO_3)
    findings = verdict.judge(tl, CONFIG)
    mismatch = [f for f in findings if f.rule == "device-mismatch"]
    assert len(mismatch) == 1 and "after the job" in mismatch[0].message
    named = [f for f in findings if f.rule == "orphan"]
    assert named and named[0].rank == 2 and "rank 2 orphan_301.py --flag (PID 301)" in (
        named[0].message
    )


def test_ranks_sharing_the_one_gpu_there_is_are_no_mismatch() -> None:
    """Two ranks on a one-GPU machine: rank 1's LOCAL_RANK names a GPU1 that does not exist,
    so its processes on GPU0 are where they must be; its device is unknown, not GPU1."""
    rank_1 = replace(parent({0: 700}), rank=1, rank_device=1)
    worker = replace(proc(201, gpu_mib={0: 520}), rank=1, rank_device=1)
    tl = timeline([epoch(0, [rank_1, worker], [device(0, 1220)])])
    assert verdict.device_mismatch(tl, CONFIG) == ()
    # The same on a machine with a GPU1: rank 1 belongs there, and its worker's GPU0 is not.
    two_gpus = timeline([epoch(0, [rank_1, worker], [device(0, 1220), device(1)])])
    assert sorted(f.pid or 0 for f in verdict.device_mismatch(two_gpus, CONFIG)) == [100, 201]


# --------------------------------------------------------------------------- other ranks

SIBLING_JOB = """
import json, sys
from leakcheck.observe import nvml
from leakcheck.track.tracker import Tracker
from tests.fake_pynvml import FakeDevice, FakeProcess, FakePynvml, reset_nvml

sibling, stranger = int(sys.argv[1]), int(sys.argv[2])
stranger_mib, held_before, unexplained_mib = (int(v) * 2**20 for v in sys.argv[3:6])
fake = FakePynvml([FakeDevice(total_bytes=80 * 2**30)])
sys.modules["leakcheck.observe.nvml_lib"] = fake
reset_nvml()
device = fake.devices[0]
# Another rank of this job on the shared GPU, maybe with memory before tracking starts.
if held_before:
    device.compute = [FakeProcess(pid=sibling, usedGpuMemory=held_before)]
    device.used_bytes += held_before
with Tracker(grace=0.1, interval=3600.0) as tracker:
    with tracker.epoch():
        # The other rank grows to 700 MiB; a process of no rank of this job, and memory no
        # process holds, maybe.
        device.compute = [FakeProcess(pid=sibling, usedGpuMemory=700 * 2**20)]
        if stranger_mib:
            device.compute.append(FakeProcess(pid=stranger, usedGpuMemory=stranger_mib))
        device.used_bytes += 700 * 2**20 - held_before + stranger_mib + unexplained_mib
        tracker.sample()
print("RESULT " + json.dumps(tracker.report().to_dict()))
"""


def _sleeper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


@pytest.mark.parametrize(
    ("stranger_mib", "held_before_mib", "unexplained_mib"),
    [(0, 0, 0), (500, 0, 0), (0, 600, 0), (0, 600, 300)],
)
def test_another_rank_of_the_job_on_the_shared_gpu_is_the_jobs_memory(
    stranger_mib: int, held_before_mib: int, unexplained_mib: int
) -> None:
    """NOTE [other ranks]: rank 0's tracker sees rank 1 (same TORCHELASTIC_RUN_ID, a sibling
    under the agent) holding 700 MiB of the shared GPU: the job's memory, not a residual nor
    a foreign holder; a process of another run holding 500 MiB is still named. What rank 1
    held before tracking started is in the baseline, once: 300 MiB nobody holds is found."""
    job = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run-a"}
    other = {**job, "TORCHELASTIC_RUN_ID": "run-b"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("LEAKCHECK_")}
    sibling, stranger = _sleeper({**base, **job}), _sleeper({**base, **other})
    try:
        root_env = {**base, **job, "RANK": "0", "LOCAL_RANK": "0", "PYTHONPATH": str(ROOT)}
        numbers = (sibling.pid, stranger.pid, stranger_mib, held_before_mib, unexplained_mib)
        done = subprocess.run(
            [sys.executable, "-c", SIBLING_JOB, *(str(n) for n in numbers)],
            env=root_env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for proc in (sibling, stranger):
            proc.kill()
            proc.wait()
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT ") :])
    findings = report["findings"]
    assert not [f for f in findings if f["pid"] == sibling.pid], findings
    residual = [f for f in findings if f["rule"] == "residual"]
    if stranger_mib:
        (finding,) = residual
        assert f"(PID {stranger.pid})" in finding["message"]
        assert f"PID {sibling.pid}" not in finding["message"]
    elif unexplained_mib:
        (finding,) = residual
        assert "300 MiB of it not held by the job" in finding["message"]
    else:
        assert residual == [], findings


def test_only_a_live_other_rank_of_the_same_run_and_restart_is_another_ranks() -> None:
    """NOTE [other ranks]: the root's own rank, another restart, another run, torchrun's
    default run id "none" (no run), and a process no longer below the root's parent."""
    from leakcheck.track.table import _same_job

    child = _sleeper(dict(os.environ))
    try:
        ours = RankInfo(rank=0, run_id="run-a", restart_count=0)
        agent = os.getpid()  # the child's parent, as the agent is a rank's

        def same(other: RankInfo, ancestor: int = agent) -> bool:
            return _same_job(ours, ancestor, other, child.pid)

        assert same(RankInfo(rank=1, run_id="run-a", restart_count=0))
        assert not same(RankInfo(rank=0, run_id="run-a", restart_count=0))  # our own rank
        assert not same(RankInfo(rank=1, run_id="run-a", restart_count=1))  # a restart
        assert not same(RankInfo(rank=1, run_id="run-b", restart_count=0))  # another run
        assert not same(RankInfo(rank=1, run_id="run-a", restart_count=0), ancestor=1)
        none = RankInfo(rank=0, run_id="none", restart_count=0)
        # torchrun's default id names no run: the rest decides (below the same parent).
        assert _same_job(none, agent, RankInfo(rank=1, run_id="none", restart_count=0), child.pid)
        assert not _same_job(none, agent, RankInfo(rank=1, run_id="run-b"), child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_registered_worker_has_its_environment_read_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [rank read]: a forked child with its parent's command line and no rank is looked
    at again on the next walks (it may be a rank between fork and exec); once the mailbox
    names it a loader's worker, its environment is not read again (a read per worker per
    walk was most of a walk's cost)."""
    from leakcheck.track.table import ProcessTable

    pid = os.fork()
    if pid == 0:  # a forked worker that never execs
        import time

        time.sleep(30)
        os._exit(0)
    try:
        root_info = procs.read_proc(os.getpid())
        assert root_info is not None
        table = ProcessTable(root_info.key, root_info, session="s", persistent_workers=False)
        info = procs.read_proc(pid)
        assert info is not None
        reads: list[int] = []
        real = procs.environ_variables

        def counting(read_pid: int, names: tuple[str, ...]) -> dict[str, str] | None:
            reads.append(read_pid)
            return real(read_pid, names)

        monkeypatch.setattr(procs, "environ_variables", counting)
        table.apply_walk([info], now=0.0, quick=True, born_epoch=0)
        table.apply_walk([info], now=0.1, quick=True, born_epoch=0)
        before = reads.count(pid)
        table.apply_walk([info], now=0.2, quick=True, born_epoch=0)
        assert reads.count(pid) == before + 1  # still pending: looked at on every walk
        table.register_worker(info.key, False, now=0.3, born_epoch=0)
        table.apply_walk([info], now=0.4, quick=True, born_epoch=0)
        assert reads.count(pid) == before + 1
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
