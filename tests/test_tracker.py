"""Tracker on real processes (CPU): lineage per epoch, survivors, orphans, mailbox, failures.

NVML is absent here, so GPU attribution is exercised through the fake at the NVML binding
boundary (tests/fake_pynvml.py, in place of leakcheck.observe.nvml_lib) with the PIDs of real child
processes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from leakcheck.core.errors import LeakCheckError, UsageError
from leakcheck.core.model import MIB, ProcessEpoch, ProcessKey
from leakcheck.observe import mailbox, procs
from leakcheck.track.tracker import Tracker
from tests.fake_pynvml import FakeDevice, FakeProcess, FakePynvml, reset_nvml
from tests.polling import wait_for

CTX = multiprocessing.get_context("fork")


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _wait(go: object) -> None:
    go.wait(60)  # type: ignore[attr-defined]


def _spawn_orphan_and_exit(pid_file: str) -> None:
    # A worker that starts a grandchild and exits without waiting for it.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        start_new_session=False,
    )
    with open(pid_file, "w") as handle:
        handle.write(str(child.pid))


def _post_worker_record(persistent: bool, go: object) -> None:
    key = procs.process_key(os.getpid())
    assert key is not None
    mailbox.post(
        "worker",
        {"pid": key.pid, "start_ticks": key.start_ticks, "worker_id": 0, "persistent": persistent},
    )
    _wait(go)


@pytest.fixture
def kill_after() -> Iterator[list[ProcessKey]]:
    started: list[ProcessKey] = []
    yield started
    for key in started:
        if procs.is_alive(key):
            os.kill(key.pid, signal.SIGKILL)


def test_clean_epochs_record_workers_and_find_nothing() -> None:
    # Every child has exited by its epoch's end: a grace close() has no one to wait for.
    with Tracker(grace=30, interval=0.02) as tracker:
        for epoch in range(3):
            with tracker.epoch(f"e{epoch}"):
                go = CTX.Event()
                workers = [CTX.Process(target=_wait, args=(go,)) for _ in range(2)]
                for worker in workers:
                    worker.start()
                tracker.register_worker(workers[0].pid or 0)
                # A walk while both live (they wait for it): the sampler's own may come too
                # late on a loaded host, and a child that lived and exited unseen is in no
                # record.
                tracker.sample()
                go.set()
                for worker in workers:
                    worker.join()
    report = tracker.report()
    assert [epoch.label for epoch in report.epochs] == ["e0", "e1", "e2"]
    for record in report.epochs:
        born = [p for p in record.processes if p.born_in_epoch]
        assert len(born) == 2, record
        # A registered worker is a worker; an unregistered child is a descendant (a guess
        # would name any child a worker).
        assert sorted(p.role for p in born) == ["descendant", "worker"]
        assert not any(p.persistent for p in born)
        assert all(p.alive_at_end is False for p in born)
    assert report.leaks == []
    assert report.timeline.attribution == "nvml-unavailable"


def test_child_alive_after_grace_is_a_survivor(kill_after: list[ProcessKey]) -> None:
    with Tracker(grace=0.3, interval=0.02) as tracker, tracker.epoch():
        straggler = CTX.Process(target=_sleep, args=(30,))
        straggler.start()
        key = procs.process_key(straggler.pid or 0)
        assert key is not None
        kill_after.append(key)
    report = tracker.report()
    survivors = [f for f in report.leaks if f.rule == "survivor"]
    assert [f.pid for f in survivors] == [straggler.pid]
    assert survivors[0].epoch == 0
    straggler.kill()
    straggler.join()


def _exec_when_told(go: object) -> None:
    go.wait()  # type: ignore[attr-defined]
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)  # execd"])


def _has_execd(pid: int) -> bool:
    info = procs.read_proc(pid)
    return info is not None and "# execd" in info.cmdline


def _cmdline_in(tracker: Tracker, epoch: int, pid: int) -> str:
    records = [p for p in tracker.epochs()[epoch].processes if p.key.pid == pid]
    assert len(records) == 1, records
    return records[0].cmdline


def test_a_command_line_is_read_again_until_the_child_has_execd_then_never(
    monkeypatch: pytest.MonkeyPatch, kill_after: list[ProcessKey]
) -> None:
    go = CTX.Event()
    child = CTX.Process(target=_exec_when_told, args=(go,))
    reads: Counter[int] = Counter()
    read_proc = procs.read_proc

    def counted(pid: int, **kwargs: object) -> object:
        reads[pid] += 1
        return read_proc(pid, **kwargs)  # type: ignore[arg-type]

    with Tracker(grace=0.2, interval=5.0) as tracker:
        tracker.begin_epoch()
        child.start()
        assert child.pid is not None
        key = procs.process_key(child.pid)
        assert key is not None
        kill_after.append(key)
        tracker.end_epoch()
        root_cmdline = _cmdline_in(tracker, 0, os.getpid())
        assert _cmdline_in(tracker, 0, child.pid) == root_cmdline  # forked, not exec'd yet
        monkeypatch.setattr(procs, "read_proc", counted)
        tracker.begin_epoch()
        tracker.end_epoch()  # still the parent's program: read again
        assert reads[child.pid] == 1
        go.set()
        assert wait_for(lambda: _has_execd(child.pid or 0))
        reads.clear()
        tracker.begin_epoch()
        tracker.end_epoch()
        assert reads[child.pid] == 1
        assert "# execd" in _cmdline_in(tracker, 2, child.pid)
        reads.clear()
        tracker.begin_epoch()
        tracker.end_epoch()
        assert reads[child.pid] == 0, "a command line that differs from its parent's is final"
        assert "# execd" in _cmdline_in(tracker, 3, child.pid)
    child.kill()
    child.join()


def test_child_that_exits_within_grace_is_not_a_survivor() -> None:
    go = CTX.Event()
    with Tracker(grace=30, interval=0.02) as tracker:
        with tracker.epoch():
            late = CTX.Process(target=_wait, args=(go,))
            late.start()
        assert late.is_alive()  # it outlives its epoch, seen so by the epoch's end
        go.set()  # and exits within the grace, which close() waits out for it
    late.join()
    assert [f for f in tracker.report().leaks if f.rule == "survivor"] == []


@pytest.mark.parametrize("lives_s", [0.2, 30.0])
def test_a_survivor_needs_a_sighting_after_the_grace(
    monkeypatch: pytest.MonkeyPatch, kill_after: list[ProcessKey], lives_s: float
) -> None:
    """Walks only when asked: a child that exits 0.2 s after the epoch is found gone long
    after the 0.5 s grace, and is no survivor; one seen alive 1 s after the epoch (it would
    live 30 s) is one."""
    from leakcheck.track import pacing as pacing_module

    monkeypatch.setattr(pacing_module, "WALK_EVERY", 10**9)
    tracker = Tracker(grace=0.5, interval=0.02, use_nvml=False).start()
    with tracker.epoch():
        child = CTX.Process(target=_sleep, args=(lives_s,))
        child.start()
        key = procs.process_key(child.pid or 0)
        assert key is not None
        kill_after.append(key)
    ended = time.monotonic()
    time.sleep(max(0.0, ended + 1.0 - time.monotonic()))
    if lives_s < 1.0:
        child.join(30)  # gone by the walk, however late a loaded host let it exit
    child.is_alive()  # reaps it if it exited: a quick walk may take a zombie for alive
    tracker.sample()  # one walk, 1 s after the epoch: gone, or still there
    tracker.close()  # no wait: the one child was decided by that walk
    child.kill()
    child.join()
    survivors = [f.pid for f in tracker.report().leaks if f.rule == "survivor"]
    assert survivors == ([child.pid] if lives_s > 1.0 else [])


def test_reparented_grandchild_is_an_orphan(tmp_path: object, kill_after: list[ProcessKey]) -> None:
    pid_file = os.path.join(str(tmp_path), "grandchild.pid")
    with Tracker(grace=0.3, interval=0.02) as tracker, tracker.epoch():
        worker = CTX.Process(target=_spawn_orphan_and_exit, args=(pid_file,))
        worker.start()
        worker.join()
    with open(pid_file) as handle:
        grandchild_pid = int(handle.read())
    key = procs.process_key(grandchild_pid)
    assert key is not None
    kill_after.append(key)
    report = tracker.report()
    orphans = [f for f in report.leaks if f.rule == "orphan"]
    assert [f.pid for f in orphans] == [grandchild_pid]
    assert "sleep(30)" in (orphans[0].cmdline or "")


def _spawn_orphan_inside_the_epoch_and_exit(pid_file: str) -> None:
    _spawn_orphan_and_exit(pid_file)
    time.sleep(0.1)  # born well inside the epoch, not in its last clock tick


def _seen_outside_the_tree(tracker: Tracker, pid: int) -> bool:
    table = tracker.table
    assert table is not None
    with tracker.lock:
        return any(key.pid == pid and not proc.in_lineage for key, proc in table.procs.items())


def test_epoch_ends_more_often_than_ticks_do_not_starve_the_ticks(
    tmp_path: object, kill_after: list[ProcessKey]
) -> None:
    """Every epoch end plans a USS read (share 1.0) and wakes the sampler; epochs of 20 ms are
    shorter than its tick, yet its ticks (and their scans for reparented processes) still
    come: an orphan seen outside the tree by them, and gone before close(), is found."""
    pid_file = os.path.join(str(tmp_path), "grandchild.pid")
    with Tracker(grace=0.3, interval=0.05, rollup_share=1.0) as tracker:
        with tracker.epoch():
            worker = CTX.Process(target=_spawn_orphan_inside_the_epoch_and_exit, args=(pid_file,))
            worker.start()
            worker.join()
        with open(pid_file) as handle:
            grandchild_pid = int(handle.read())
        grandchild = procs.process_key(grandchild_pid)
        assert grandchild is not None
        kill_after.append(grandchild)
        # Epochs back to back until a tick's scan has seen the orphan (a generous deadline:
        # ticks starved for good never see it), then for 1 s more: an orphan gone by the
        # end is judged on sightings that span more than the grace.
        deadline = time.monotonic() + 30
        while not _seen_outside_the_tree(tracker, grandchild_pid) and time.monotonic() < deadline:
            with tracker.epoch():
                time.sleep(0.02)
        seen_until = time.monotonic() + 1.0
        while time.monotonic() < seen_until:
            with tracker.epoch():
                time.sleep(0.02)
        os.kill(grandchild_pid, signal.SIGKILL)
        assert wait_for(lambda: not procs.is_alive(grandchild))
    orphans = [f for f in tracker.report().leaks if f.rule == "orphan"]
    assert [f.pid for f in orphans] == [grandchild_pid], tracker.report().format()
    # "since" or "by" the epoch it was first seen outside the tree in, as the walks caught it
    # inside or not (test_verdict.py has the words); found at all is this test's point.
    # Started in epoch 0: said so, or it left the tree in the epoch it started in ("since").
    assert re.search(r"(started in|since) epoch 0\b", orphans[0].message), orphans[0].message


@pytest.mark.parametrize("scan", [True, False])
def test_an_epoch_end_scan_counts_the_orphans_its_end_had(
    tmp_path: object, kill_after: list[ProcessKey], scan: bool
) -> None:
    """No tick comes (an hour's interval): only the epoch end's own scan can see what was
    reparented away during the epoch."""
    pid_file = os.path.join(str(tmp_path), "grandchild.pid")
    with Tracker(grace=0.1, interval=3600.0, scan_at_epoch_end=scan) as tracker:
        with tracker.epoch():
            worker = CTX.Process(target=_spawn_orphan_and_exit, args=(pid_file,))
            worker.start()
            worker.join()
        with open(pid_file) as handle:
            grandchild = procs.process_key(int(handle.read()))
        assert grandchild is not None
        kill_after.append(grandchild)
        (first,) = tracker.epochs()
        orphans = [p.key for p in first.processes if p.role == "orphan"]
        assert orphans == ([grandchild] if scan else [])


def test_a_report_before_close_says_what_it_cannot_judge_yet() -> None:
    """A helper of the epoch still alive within the grace: not "no leaks" alone, nor a leak
    yet; close() then judges it. The report must come within the grace: 3 s covers a
    loaded host's pauses."""
    with Tracker(grace=3.0, interval=0.02) as tracker:
        with tracker.epoch():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            early = tracker.report()
            assert early.leaks == []
            assert early.summary().endswith(
                "; 1 process of recent epochs not judged yet (alive, not yet seen more than "
                "the grace of 3 s after the end of the epoch it was born in)"
                "; growth not judged (needs 4 epochs)"
            ), early.summary()
            assert early.timeline.final is not None
            assert early.timeline.final.pending_pids == (child.pid,)
            tracker.close()
            final = tracker.report()
            assert [f.pid for f in final.leaks] == [child.pid]
            assert "not judged yet" not in final.summary()
        finally:
            child.kill()
            child.wait()


def test_mailbox_registers_exact_workers_and_persistence() -> None:
    env_before = {name: os.environ.get(name) for name in (mailbox.MAILBOX_ENV, procs.SESSION_ENV)}
    with Tracker(grace=0.2, interval=0.02) as tracker:
        assert os.environ[mailbox.MAILBOX_ENV]
        assert os.environ[procs.SESSION_ENV] == tracker.session_id
        with tracker.epoch():
            go = CTX.Event()
            worker = CTX.Process(target=_post_worker_record, args=(True, go))
            worker.start()
            # It lives until its record was read and a walk saw it alive.
            assert wait_for(lambda: worker.pid in {key.pid for key in tracker.worker_keys()})
            tracker.sample()
            go.set()
            worker.join()
    assert [key.pid for key in tracker.worker_keys()] == [worker.pid]
    record = tracker.report().epochs[0]
    entry = next(p for p in record.processes if p.key.pid == worker.pid)
    assert entry.role == "worker" and entry.persistent
    # The session's variables are as they were before once the tracker closed (a pytest
    # run with --gpu-leak-check has its own per-test tag there).
    assert {name: os.environ.get(name) for name in env_before} == env_before


def test_pre_existing_children_are_never_survivors(kill_after: list[ProcessKey]) -> None:
    before = CTX.Process(target=_sleep, args=(5,))
    before.start()
    key = procs.process_key(before.pid or 0)
    assert key is not None
    kill_after.append(key)
    with Tracker(grace=0.1, interval=0.02) as tracker, tracker.epoch():
        time.sleep(0.1)
    assert tracker.report().leaks == []
    before.kill()
    before.join()


def test_own_failures_are_recorded_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise OSError("simulated /proc failure")

    with Tracker(grace=0.0, interval=0.01) as tracker:
        monkeypatch.setattr(procs, "descendants", broken)
        with tracker.epoch():
            time.sleep(0.05)
    timeline = tracker.timeline()
    assert any("simulated /proc failure" in line for line in timeline.failures)
    assert any(f.rule == "tracker-failure" for f in tracker.report().findings)


def test_a_failure_that_stops_the_sampler_thread_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside every guarded read: the thread ends, and the report says so (it said "no
    leaks" over epochs it no longer sampled)."""
    from leakcheck.track.pacing import Pacing

    def broken(self: Pacing, now_s: float) -> int:
        raise RuntimeError("unforeseen in the sampler's loop")

    monkeypatch.setattr(Pacing, "ticks_until_work", broken)
    with Tracker(grace=0.0, interval=0.01) as tracker, tracker.epoch():
        assert wait_for(lambda: any("sampler thread" in f for f in tracker.timeline().failures))
    (finding,) = [f for f in tracker.report().findings if f.rule == "tracker-failure"]
    assert "the sampler thread stopped" in finding.message
    assert "RuntimeError: unforeseen in the sampler's loop" in finding.message


def test_strict_mode_raises_own_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = Tracker(grace=0.0, interval=0.01, strict=True).start()
    monkeypatch.setattr(procs, "descendants", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    tracker.begin_epoch()
    with pytest.raises(LeakCheckError):
        tracker.end_epoch()
    monkeypatch.undo()
    tracker.close()


def test_epoch_end_reasons_follow_the_block() -> None:
    with Tracker(grace=0.0) as tracker:
        with pytest.raises(ValueError), tracker.epoch("boom"):
            raise ValueError("bad batch")
        with pytest.raises(KeyboardInterrupt), tracker.epoch("stop"):
            raise KeyboardInterrupt
        tracker.begin_epoch("left open")
    reasons = [(e.label, e.end_reason) for e in tracker.report().epochs]
    assert reasons == [("boom", "exception"), ("stop", "interrupt"), ("left open", "closed")]
    assert tracker.report().epochs[0].error == "ValueError: bad batch"


def test_an_epoch_ends_only_by_its_own_index() -> None:
    """An end for an epoch that a later one already closed ends nothing."""
    with Tracker(grace=0.0) as tracker:
        first = tracker.begin_epoch("first")
        second = tracker.begin_epoch("second")  # closes the first as "closed"
        tracker.end_epoch("break", index=first)  # late: the second goes on
        tracker.end_epoch("completed", batches=3, index=second)
        with tracker.epoch("third"):
            tracker.begin_epoch("inside")  # closes "third"; the block's end is not its own
    epochs = [(e.label, e.end_reason, e.batches) for e in tracker.report().epochs]
    assert epochs == [
        ("first", "closed", None),
        ("second", "completed", 3),
        ("third", "closed", None),
        ("inside", "closed", None),
    ]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"interval": 0}, "interval"),
        ({"tolerance": "lots"}, "tolerance"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"grace": "soon"}, "grace"),
        ({"devices": [-1]}, "devices"),
        ({"devices": 0}, "devices"),  # was a TypeError: 'int' object is not iterable
        ({"strict": "no"}, "strict"),  # was taken as true: strict on
        ({"use_nvml": "false"}, "use_nvml"),
        ({"persistent_workers": 1}, "persistent_workers"),
        ({"scan_at_epoch_end": None}, "scan_at_epoch_end"),
    ],
)
def test_bad_options_are_one_line_usage_errors(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError) as info:
        Tracker(**kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- fake NVML, real PIDs


def _hold(seconds: float) -> None:
    time.sleep(seconds)


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePynvml]:
    from leakcheck.track import pacing as pacing_module

    # A read of the fake costs this busy machine tens of microseconds of CPU, which the
    # memory share would pace out to every second or third tick: the tests that count
    # memory reads want them on every tick. The test of memory pacing sets its own share.
    monkeypatch.setattr(pacing_module, "MEMORY_SHARE", 1.0)
    # Likewise the lists: tests of gating and placement read them whenever memory moved; the
    # tests of list pacing set their own share.
    monkeypatch.setattr(pacing_module, "LIST_SHARE", 1.0)
    fake = FakePynvml([FakeDevice(total_bytes=80 * 1024 * MIB)])
    monkeypatch.setitem(sys.modules, "leakcheck.observe.nvml_lib", fake)
    reset_nvml()
    yield fake
    reset_nvml()


def _set_process(device: FakeDevice, pid: int, used_bytes: int | None) -> None:
    """Set what one process holds; the device's used bytes move with it, as on a GPU."""
    before = sum(p.usedGpuMemory or 0 for p in device.compute if p.pid == pid)
    device.compute = [p for p in device.compute if p.pid != pid]
    if used_bytes is not None:
        device.compute.append(FakeProcess(pid=pid, usedGpuMemory=used_bytes))
    device.used_bytes += (used_bytes or 0) - before


def test_gpu_bytes_attributed_to_real_pids_and_growth_found(fake_nvml: FakePynvml) -> None:
    device = fake_nvml.devices[0]
    holder = CTX.Process(target=_hold, args=(30,))
    with Tracker(grace=0.2, interval=0.02, persistent_workers=True) as tracker:
        assert tracker.timeline().attribution == "ok"
        for epoch in range(5):
            with tracker.epoch():
                if epoch == 0:
                    holder.start()
                    # A worker is one that is known to be (NOTE [roles from outside]).
                    tracker.register_worker(holder.pid or 0)
                # A persistent worker whose cache grows 64 MiB per epoch.
                _set_process(device, holder.pid or 0, (600 + 64 * epoch) * MIB)
                _set_process(device, os.getpid(), 500 * MIB)
                time.sleep(0.06)
        report_before_exit = tracker.report()
        holder.kill()
        holder.join()
        _set_process(device, holder.pid or 0, None)
    growth = [f for f in report_before_exit.leaks if f.rule == "growth"]
    assert [f.pid for f in growth] == [holder.pid]
    assert growth[0].bytes_per_epoch == pytest.approx(64 * MIB, rel=0.05)
    last = report_before_exit.epochs[-1]
    parent = next(p for p in last.processes if p.role == "parent")
    assert parent.gpu_bytes_end == {0: 500 * MIB}
    worker = next(p for p in last.processes if p.key.pid == holder.pid)
    assert worker.role == "worker"
    assert worker.gpu_bytes_end == {0: (600 + 64 * 4) * MIB}


def test_foreign_gpu_process_is_foreign(fake_nvml: FakePynvml) -> None:
    device = fake_nvml.devices[0]
    # PID 1 exists here and is not in this job's lineage.
    _set_process(device, 1, 300 * MIB)
    with Tracker(grace=0.0, interval=0.02) as tracker, tracker.epoch():
        time.sleep(0.05)
    final = tracker.timeline().final
    assert final is not None
    foreign = [p for p in final.processes if p.role == "foreign"]
    assert [p.key.pid for p in foreign] == [1]
    assert foreign[0].gpu_bytes_end == {0: 300 * MIB}


def test_unforeseen_failure_in_a_sample_is_recorded_and_sampling_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"n": 0}
    real = procs.descriptors

    def flaky(pid: int) -> procs.Descriptors | None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("unforeseen")
        return real(pid)

    monkeypatch.setattr(procs, "descriptors", flaky)
    with Tracker(grace=0.0, interval=0.01) as tracker:
        with tracker.epoch("first"):  # its end reads descriptors: the failure happens here
            time.sleep(0.03)
        with tracker.epoch("second"):
            # Ticks after the first epoch end's host reads (its USS), which the sampler
            # thread makes right after that end.
            before = tracker.cost().samples
            assert wait_for(lambda: tracker.cost().samples >= before + 2)
    timeline = tracker.timeline()
    assert any("RuntimeError: unforeseen" in line for line in timeline.failures)
    assert [e.label for e in timeline.epochs] == ["first", "second"]
    assert timeline.epochs[1].samples >= 2


def test_importing_leakcheck_and_its_core_loads_neither_torch_nor_pynvml() -> None:
    code = (
        "import sys, leakcheck; leakcheck.Tracker; leakcheck.watch; leakcheck.Report; "
        "print('torch' in sys.modules, 'pynvml' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_without_nvml_the_sampler_wakes_for_walking_ticks_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [idle ticks]: with nothing to read between walks, three ticks in four are not
    taken: the thread sleeps through them, and a new child is still found by a walk. (How
    often walks come on an idle host is the pacing's, test_pacing.py; a loaded host only
    makes them later.)"""
    from leakcheck.track import pacing as pacing_module
    from leakcheck.track.pacing import Pacing

    asked: list[int] = []
    ticks_until_work = Pacing.ticks_until_work

    def recorded(self: Pacing, now_s: float) -> int:
        asked.append(ticks_until_work(self, now_s))
        return asked[-1]

    monkeypatch.setattr(Pacing, "ticks_until_work", recorded)
    child = CTX.Process(target=_hold, args=(30,))
    with Tracker(grace=0.0, interval=0.01, use_nvml=False) as tracker, tracker.epoch():
        assert wait_for(lambda: len(asked) >= 3)
        before, started = tracker.cost().samples, time.monotonic()
        time.sleep(0.8)
        taken = tracker.cost().samples - before
        ticks = (time.monotonic() - started) / 0.01
        child.start()
        table = tracker.table
        assert table is not None
        found = wait_for(lambda: any(key.pid == child.pid for key in tuple(table.live)))
        child.kill()
        child.join()
    assert found
    # After the first wake, each one sleeps through the ticks up to the next walk...
    assert set(asked[1:]) == {pacing_module.WALK_EVERY}, asked
    # ...so no more samples than one per walking tick (the next tick is always counted from
    # the end of the last: a late one never brings a burst).
    assert taken <= ticks / pacing_module.WALK_EVERY + 1


def test_cost_counts_sampler_and_caller_time_apart_and_nested_calls_once() -> None:
    tracker = Tracker(interval=0.01, grace=0.1).start()
    try:
        with tracker.epoch():
            pass
        after_epoch = tracker.cost()
        assert after_epoch.samples >= 2  # the baseline and the epoch end at least
        assert after_epoch.caller_wall_s > 0
        # Only the sampler works meanwhile, until it has sampled twice.
        assert wait_for(lambda: tracker.cost().samples >= after_epoch.samples + 2)
        idle = tracker.cost()
        assert idle.samples > after_epoch.samples
        assert idle.sampler_cpu_s > after_epoch.sampler_cpu_s
        assert idle.sample_wall_s > after_epoch.sample_wall_s
        assert idle.caller_wall_s == after_epoch.caller_wall_s  # the caller did nothing
        # report() builds the timeline through another timed method: counted once.
        started = time.perf_counter()
        tracker.report()
        outside_s = time.perf_counter() - started
        added_s = tracker.cost().caller_wall_s - idle.caller_wall_s
        assert 0 < added_s <= outside_s
    finally:
        tracker.close()


def test_ticks_between_walks_keep_gpu_peaks_and_place_new_gpu_pids_in_the_job(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [tracker lifecycle]: ticks that do not walk /proc still read NVML where device
    memory moved; a PID new on the GPU is placed in the tree at once, never taken for a
    foreign process."""
    from leakcheck.track import pacing as pacing_module

    monkeypatch.setattr(pacing_module, "WALK_EVERY", 10**9)  # the sampler never walks
    device = fake_nvml.devices[0]
    known = CTX.Process(target=_hold, args=(30,))
    # Started without this session's tag: only the walk can tell it is the job's.
    env = {k: v for k, v in os.environ.items() if k != procs.SESSION_ENV}
    calls = fake_nvml.calls
    with Tracker(grace=0.0, interval=0.01) as tracker:
        with tracker.epoch():
            known.start()
            tracker.sample()  # one walk: the worker is known from here on
            _set_process(device, known.pid or 0, 900 * MIB)
            _wait_for_list_reads(calls, calls[_LISTS] + 1)  # a sampler tick's, no walk
            _set_process(device, known.pid or 0, 300 * MIB)
            untagged = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(30)"], env=env
            )
            _set_process(device, untagged.pid, 200 * MIB)
            _wait_for_list_reads(calls, calls[_LISTS] + 1)
        record = tracker.epochs()[-1]
        known.kill()
        known.join()
        untagged.kill()
        untagged.wait()
        _set_process(device, known.pid or 0, None)
        _set_process(device, untagged.pid, None)
    by_pid = {p.key.pid: p for p in record.processes}
    assert by_pid[known.pid or 0].gpu_bytes_peak == {0: 900 * MIB}  # seen between walks
    assert by_pid[untagged.pid].role != "foreign"
    assert by_pid[untagged.pid].gpu_bytes_peak == {0: 200 * MIB}


# Generous: CI has 2 busy cores.
_WAIT_S = 30.0


_LISTS = "nvmlDeviceGetComputeRunningProcesses"
_MEMORY = "nvmlDeviceGetMemoryInfo"


def _wait_for_list_reads(calls: Counter[str], at_least: int) -> None:
    """Wait until the lists were read ``at_least`` times and the tick that did it is over."""
    assert wait_for(lambda: calls[_LISTS] >= at_least, _WAIT_S)
    memory_reads = calls[_MEMORY]
    assert wait_for(lambda: calls[_MEMORY] > memory_reads, _WAIT_S)  # the next tick has begun


def _epoch_with_a_holder(
    fake_nvml: FakePynvml,
    monkeypatch: pytest.MonkeyPatch,
    body: Callable[[FakeDevice, int, Tracker], None],
) -> tuple[Tracker, ProcessEpoch]:
    """One epoch of a tracker whose sampler never walks, around a live child: ``body`` sets
    what the child holds on the fake device (given the device, the child's PID and the
    tracker). Returns the closed tracker and the child's record of the epoch."""
    from leakcheck.track import pacing as pacing_module

    monkeypatch.setattr(pacing_module, "WALK_EVERY", 10**9)
    device = fake_nvml.devices[0]
    holder = CTX.Process(target=_hold, args=(30,))
    try:
        with Tracker(grace=0.0, interval=0.01) as tracker:
            with tracker.epoch():
                holder.start()
                tracker.sample()  # one walk: the child is known from here on
                body(device, holder.pid or 0, tracker)
            record = tracker.epochs()[-1]
    finally:
        if holder.pid is not None:
            holder.kill()
            holder.join()
            _set_process(device, holder.pid, None)
    (proc,) = [p for p in record.processes if p.key.pid == holder.pid]
    return tracker, proc


def test_ticks_skip_process_lists_while_device_memory_is_unchanged(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [list gating]: steady device memory, no list reads; a change, read at once."""
    calls = fake_nvml.calls

    def body(device: FakeDevice, pid: int, _tracker: Tracker) -> None:
        lists_at_change = calls[_LISTS]
        _set_process(device, pid, 100 * MIB)
        _wait_for_list_reads(calls, lists_at_change + 1)
        lists_before, memory_before = calls[_LISTS], calls[_MEMORY]
        # Twenty ticks with the device's memory steady: no list read among them.
        assert wait_for(lambda: calls[_MEMORY] >= memory_before + 20, _WAIT_S)
        assert calls[_LISTS] == lists_before
        _set_process(device, pid, 500 * MIB)
        _wait_for_list_reads(calls, lists_before + 1)
        _set_process(device, pid, 200 * MIB)

    _tracker, proc = _epoch_with_a_holder(fake_nvml, monkeypatch, body)
    assert proc.gpu_bytes_peak == {0: 500 * MIB}  # read between walks, kept as the peak
    assert proc.gpu_bytes_end == {0: 200 * MIB}


def test_a_failed_list_read_is_retried_at_the_next_tick(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [list gating]: a failure must not make the unchanged memory skip the retry."""
    calls = fake_nvml.calls

    def body(device: FakeDevice, pid: int, _tracker: Tracker) -> None:
        lists_before = calls[_LISTS]
        device.list_failures = 1
        _set_process(device, pid, 700 * MIB)
        # The failed read and its retry (the fake counts failed calls too).
        _wait_for_list_reads(calls, lists_before + 2)
        assert device.list_failures == 0
        _set_process(device, pid, 100 * MIB)

    tracker, proc = _epoch_with_a_holder(fake_nvml, monkeypatch, body)
    assert proc.gpu_bytes_peak == {0: 700 * MIB}
    assert any("nvml processes" in failure for failure in tracker.timeline().failures)


@pytest.mark.parametrize(
    ("list_cpu_s", "list_wait_s", "share", "max_gap_s", "fewest", "closest_s"),
    [
        # 5 ms of CPU per read at a 1% share: a read at most every 0.5 s (about 3 in 1.5 s).
        (0.005, 0.0, 0.01, 10.0, 2, 0.5),
        # 50 ms at 1% would be one read per 5 s: the longest gap, 0.1 s, gives about 8.
        (0.05, 0.0, 0.01, 0.1, 3, 0.1),
        # A read that waits 20 ms idle (a lock another process holds) is not paced out:
        # paced by its wall time, the next would be 2 s later.
        (0.0, 0.02, 0.01, 10.0, 10, None),
    ],
    ids=["cpu-paced", "gap-capped", "waits-not-paced"],
)
def test_list_reads_are_paced_by_their_cpu_time(
    fake_nvml: FakePynvml,
    monkeypatch: pytest.MonkeyPatch,
    list_cpu_s: float,
    list_wait_s: float,
    share: float,
    max_gap_s: float,
    fewest: int,
    closest_s: float | None,
) -> None:
    """NOTE [nvml pacing]: device memory moves on every tick of a window of at least 1.5 s and
    20 memory reads (longer on a loaded host, where ticks come late); the sampler reads the
    lists as often as their CPU time and the longest gap allow (at least ``fewest`` times,
    never two within ``closest_s``), and ``sample()`` is not paced."""
    from leakcheck.track import pacing as pacing_module

    monkeypatch.setattr(pacing_module, "LIST_SHARE", share)
    monkeypatch.setattr(pacing_module, "MAX_GAP_S", max_gap_s)
    calls = fake_nvml.calls
    counted: dict[str, float] = {}

    def body(device: FakeDevice, pid: int, tracker: Tracker) -> None:
        device.list_cpu_s, device.list_wait_s = list_cpu_s, list_wait_s
        cost = tracker.cost()
        before = calls[_LISTS], calls[_MEMORY], cost.nvml_wall_s, cost.nvml_cpu_s
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < 1.5 or (
            calls[_MEMORY] - before[1] < 20 and time.monotonic() - started < 60
        ):
            step += 1
            _set_process(device, pid, (100 + step % 50) * MIB)  # moves on every tick
            time.sleep(0.005)
        counted["window_s"] = time.monotonic() - started
        counted["lists"] = calls[_LISTS] - before[0]
        counted["memory"] = calls[_MEMORY] - before[1]
        cost = tracker.cost()
        counted["nvml_s"] = cost.nvml_wall_s - before[2]
        counted["nvml_cpu_s"] = cost.nvml_cpu_s - before[3]
        lists_before_sample = calls[_LISTS]
        tracker.sample()
        counted["sample_lists"] = calls[_LISTS] - lists_before_sample
        device.list_cpu_s = device.list_wait_s = 0.0

    _epoch_with_a_holder(fake_nvml, monkeypatch, body)
    assert counted["lists"] >= fewest, counted
    if closest_s is not None:
        assert counted["lists"] <= counted["window_s"] // closest_s + 2, counted
    assert counted["memory"] >= 20, counted  # cheap reads are not paced out
    # Wall time inside NVML is counted, waits included (the last read may be in progress).
    assert counted["nvml_s"] >= (list_cpu_s + list_wait_s) * (counted["lists"] - 1), counted
    # CPU time inside NVML is counted, and a wait is not CPU time.
    assert counted["nvml_cpu_s"] >= 0.9 * list_cpu_s * (counted["lists"] - 1), counted
    if list_wait_s:
        assert counted["nvml_cpu_s"] < 0.5 * counted["nvml_s"], counted
    assert counted["sample_lists"] >= 1, counted


def test_memory_reads_take_a_quarter_of_the_nvml_share(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [nvml pacing]: at a 10% share for the lists, memory reads take 2.5%: a read that
    used 4 ms of CPU keeps the next away 160 ms, so ticks 50 ms apart read memory on one in
    three or four (late ticks, on a loaded host, read more often: the bound is counted from
    the time the ticks took); reads of no cost come on every tick. Memory holds still, so no
    tick reads the lists."""
    from leakcheck.track import pacing as pacing_module

    monkeypatch.setattr(pacing_module, "LIST_SHARE", 0.1)
    monkeypatch.setattr(pacing_module, "MEMORY_SHARE", 0.1 / 4)
    monkeypatch.setattr(pacing_module, "MAX_GAP_S", 10.0)
    device = fake_nvml.devices[0]
    holder = CTX.Process(target=_hold, args=(30,))
    calls = fake_nvml.calls

    def memory_reads_in_six_ticks(tracker: Tracker) -> tuple[int, float]:
        """The memory reads of six ticks at least 50 ms apart, and the seconds they took."""
        before, started_s = calls[_MEMORY], time.monotonic()
        for _ in range(6):
            time.sleep(0.05)
            _quick_tick(tracker, paced=True)
        return calls[_MEMORY] - before, time.monotonic() - started_s

    with Tracker(grace=0.0, interval=3600.0) as tracker, tracker.epoch():
        holder.start()
        tracker.sample()
        lists_before = calls[_LISTS]
        free_reads, _ = memory_reads_in_six_ticks(tracker)
        device.memory_cpu_s = 0.004
        memory_reads_in_six_ticks(tracker)  # the first 4 ms read starts the gap
        costly_reads, took_s = memory_reads_in_six_ticks(tracker)
        device.memory_cpu_s = 0.0
        assert calls[_LISTS] == lists_before
        holder.kill()
        holder.join()
    assert free_reads == 6
    # At least 300 ms of ticks: one read at the least; each read keeps the next 160 ms away
    # (at the lists' whole 10% share it would be 40 ms: a read on every tick).
    assert 1 <= costly_reads <= 1 + took_s / 0.16, (costly_reads, took_s)


def test_memory_moved_between_processes_is_seen_by_the_next_walking_tick(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [list gating]: what the device total cannot show, a walking tick reads."""
    from leakcheck.track import pacing as pacing_module

    monkeypatch.setattr(pacing_module, "WALK_EVERY", 3)
    device = fake_nvml.devices[0]
    first, second = (CTX.Process(target=_hold, args=(30,)) for _ in range(2))
    calls = fake_nvml.calls
    with Tracker(grace=0.0, interval=0.01) as tracker:
        with tracker.epoch():
            first.start()
            second.start()
            tracker.sample()
            _set_process(device, first.pid or 0, 300 * MIB)
            _set_process(device, second.pid or 0, 100 * MIB)
            used = device.used_bytes
            # 200 MiB move from the first to the second: the device total stays put.
            device.compute = [
                FakeProcess(first.pid or 0, 100 * MIB),
                FakeProcess(second.pid or 0, 300 * MIB),
            ]
            lists_at_move = calls[_LISTS]
            # Only a walking tick reads the lists now: the device total did not move.
            assert wait_for(lambda: calls[_LISTS] > lists_at_move, _WAIT_S)
            device.compute = [
                FakeProcess(first.pid or 0, 300 * MIB),
                FakeProcess(second.pid or 0, 100 * MIB),
            ]
            assert device.used_bytes == used
        record = tracker.epochs()[-1]
        for child in (first, second):
            child.kill()
            child.join()
        device.compute = []
    peaks = {p.key.pid: p.gpu_bytes_peak for p in record.processes}
    assert peaks[second.pid or 0] == {0: 300 * MIB}


_GRAPHICS = "nvmlDeviceGetGraphicsRunningProcesses"


def _quick_tick(tracker: Tracker, *, paced: bool = False) -> None:
    """One sampler tick without a walk, run here (the tracker's own sampler is idle);
    ``paced``: its NVML reads paced, as the sampler's are."""
    with tracker.lock:
        plan = tracker.pacing.plan(time.perf_counter(), 0)
        if not paced:
            plan = dataclasses.replace(plan, read_memory=True, lists_paced_out=False)
        tracker._sample(epoch_end=False, quick=True, tick=dataclasses.replace(plan, walk=False))


def test_ticks_leave_the_graphics_list_out_until_a_graphics_context_is_seen(
    fake_nvml: FakePynvml,
) -> None:
    """NOTE [list gating]: a CUDA job's gated ticks read the compute list only."""
    device = fake_nvml.devices[0]
    holder = CTX.Process(target=_hold, args=(30,))
    calls = fake_nvml.calls
    with Tracker(grace=0.0, interval=3600.0) as tracker:
        holder.start()
        tracker.sample()  # walks and reads both lists: no graphics context anywhere
        _set_process(device, holder.pid or 0, 100 * MIB)
        compute, graphics = calls[_LISTS], calls[_GRAPHICS]
        _quick_tick(tracker)
        assert (calls[_LISTS], calls[_GRAPHICS]) == (compute + 1, graphics)
        # The same process opens a graphics context: the next walking read sees it, and
        # from then on gated ticks read the graphics list too.
        device.graphics = [FakeProcess(holder.pid or 0, 300 * MIB)]
        device.used_bytes += 300 * MIB
        tracker.sample()
        device.graphics = [FakeProcess(holder.pid or 0, 400 * MIB)]
        device.used_bytes += 100 * MIB
        compute, graphics = calls[_LISTS], calls[_GRAPHICS]
        _quick_tick(tracker)
        assert (calls[_LISTS], calls[_GRAPHICS]) == (compute + 1, graphics + 1)
        holder.kill()
        holder.join()
        device.compute, device.graphics = [], []


def test_a_process_new_on_the_gpu_is_placed_with_one_list_read(
    fake_nvml: FakePynvml,
) -> None:
    """NOTE [list gating]: the walk that places a new GPU process reuses the tick's lists."""
    device = fake_nvml.devices[0]
    env = {k: v for k, v in os.environ.items() if k != procs.SESSION_ENV}
    calls = fake_nvml.calls
    with Tracker(grace=0.0, interval=3600.0) as tracker:
        with tracker.epoch():
            # Untagged: only the walk can tell that it is the job's, not a foreign process.
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
            _set_process(device, child.pid, 250 * MIB)
            compute = calls[_LISTS]
            _quick_tick(tracker)
            assert calls[_LISTS] == compute + 1
        record = tracker.epochs()[-1]
        child.kill()
        child.wait()
        _set_process(device, child.pid, None)
    (proc,) = [p for p in record.processes if p.key.pid == child.pid]
    assert proc.role != "foreign"
    assert proc.gpu_bytes_peak == {0: 250 * MIB}


def test_mailbox_records_are_consumed_once_read(tmp_path: object) -> None:
    folder = str(tmp_path)
    assert mailbox.post("worker", {"pid": 1, "start_ticks": 100}, directory=folder)
    assert mailbox.post("teardown", {"pid": 1, "start_ticks": 100}, directory=folder)
    inbox = mailbox.Inbox(folder)
    kinds = sorted(r["kind"] for r in inbox.read())
    assert kinds == ["teardown", "worker"]
    assert os.listdir(folder) == []  # the folder stays small over a long run
    # Posted again under a name already read: skipped, and removed too.
    assert mailbox.post("worker", {"pid": 1, "start_ticks": 100}, directory=folder)
    assert inbox.read() == []
    assert os.listdir(folder) == []


def test_timeline_of_the_last_epochs_leaves_the_open_one_and_older_ones_out() -> None:
    with Tracker(grace=0.0, interval=0.05) as tracker:
        for _ in range(4):
            with tracker.epoch():
                pass
        tracker.begin_epoch("open")
        assert [rec.index for rec in tracker.timeline(last_epochs=2).epochs] == [2, 3]
        assert [rec.index for rec in tracker.timeline(last_epochs=9).epochs] == [0, 1, 2, 3]
        assert [rec.index for rec in tracker.timeline().epochs] == [0, 1, 2, 3]
        assert [rec.index for rec in tracker.report(last_epochs=1).epochs] == [3]
        for bad in (0, -1, True, 1.5, "2"):
            with pytest.raises(UsageError, match="last_epochs: expected a positive int"):
                tracker.timeline(last_epochs=bad)  # type: ignore[arg-type]


# --- truth from the source (NOTE [worker reports]) and reports about now -----------------


def _report_and_exit(held: dict[int, int] | None, cuda: bool) -> None:
    """A worker that registers itself, then reports what it held at exit (or nothing)."""
    key = procs.process_key(os.getpid())
    assert key is not None
    mailbox.post("worker", {"pid": key.pid, "start_ticks": key.start_ticks, "persistent": False})
    if held is not None:
        mailbox.post(
            "teardown",
            {
                "pid": key.pid,
                "start_ticks": key.start_ticks,
                "cuda_initialized": cuda,
                "gpu_bytes_by_device": {str(d): b for d, b in held.items()},
                "monotonic_s": time.monotonic(),
            },
        )


def test_a_workers_own_report_fills_the_peak_no_sample_saw(fake_nvml: FakePynvml) -> None:
    """Three workers live and die between the sampler's walks; NVML never lists them. One
    reports 700 MiB, one reports it never used CUDA, one reports nothing: 700 MiB reported,
    0 reported, unknown (never 0)."""
    del fake_nvml
    with Tracker(grace=0.2, interval=3600.0) as tracker:
        with tracker.epoch():
            children = [
                CTX.Process(target=_report_and_exit, args=({0: 700 * MIB}, True)),
                CTX.Process(target=_report_and_exit, args=({}, False)),
                CTX.Process(target=_report_and_exit, args=(None, False)),
            ]
            for child in children:
                child.start()
            for child in children:
                child.join()
        (record,) = tracker.epochs()
    by_pid = {p.key.pid: p for p in record.processes}
    reported, no_cuda, silent = (by_pid[c.pid or 0] for c in children)
    assert (reported.gpu_peak_source, reported.total_gpu_bytes_peak) == ("reported", 700 * MIB)
    assert reported.gpu_bytes_end == {}  # gone at the end: holds nothing
    assert (no_cuda.gpu_peak_source, no_cuda.total_gpu_bytes_peak) == ("reported", 0)
    assert (silent.gpu_peak_source, silent.total_gpu_bytes_peak) == ("unknown", None)
    assert all(p.role == "worker" for p in (reported, no_cuda, silent))


def test_peak_is_never_below_the_end(fake_nvml: FakePynvml) -> None:
    """Memory that rises after the last tick is read at the epoch end: the peak has it."""
    device = fake_nvml.devices[0]
    holder = CTX.Process(target=_hold, args=(30,))
    try:
        with Tracker(grace=0.0, interval=3600.0, persistent_workers=True) as tracker:
            with tracker.epoch():
                holder.start()
                tracker.sample()
                _set_process(device, holder.pid or 0, 100 * MIB)
                tracker.sample()
                _set_process(device, holder.pid or 0, 300 * MIB)  # no sample after this
            (record,) = tracker.epochs()
    finally:
        holder.kill()
        holder.join()
        _set_process(device, holder.pid or 0, None)
    (proc,) = [p for p in record.processes if p.key.pid == holder.pid]
    assert proc.gpu_bytes_end == {0: 300 * MIB}
    assert proc.gpu_bytes_peak == {0: 300 * MIB}


def _start_grandchild_and_exit(pid_file: str) -> None:
    _spawn_orphan_and_exit(pid_file)


def test_report_before_close_reads_the_orphan_and_its_memory_now(
    fake_nvml: FakePynvml, tmp_path: object
) -> None:
    """A grandchild that takes GPU memory after the last epoch ended is reported by a
    report() taken before close(), with that memory (not as an orphan holding nothing)."""
    device = fake_nvml.devices[0]
    pid_file = os.path.join(str(tmp_path), "grandchild")
    grandchild = 0
    try:
        with Tracker(grace=0.2, interval=3600.0) as tracker:
            with tracker.epoch():
                worker = CTX.Process(target=_start_grandchild_and_exit, args=(pid_file,))
                worker.start()
                worker.join()
            grandchild = int(Path(pid_file).read_text())
            _set_process(device, grandchild, 256 * MIB)
            report = tracker.report()
            assert report.timeline.final is not None and not report.timeline.final.closed
            (orphan,) = [f for f in report.leaks if f.rule == "orphan"]
            assert orphan.pid == grandchild
            assert orphan.gpu_bytes == 256 * MIB
            assert "holds GPU0 256 MiB" in orphan.message
    finally:
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)
            _set_process(device, grandchild, None)


def test_a_survivor_of_an_early_epoch_is_found_by_a_quick_close(
    kill_after: list[ProcessKey],
) -> None:
    """Three short epochs; a helper started in epoch 0 still runs. close() right after the
    last epoch waits for epoch 0's grace too, and judges the helper a survivor."""
    with Tracker(grace=0.5, interval=0.02) as tracker:
        with tracker.epoch():
            helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            key = procs.process_key(helper.pid)
            assert key is not None
            kill_after.append(key)
        for _ in range(2):
            with tracker.epoch():
                pass
    report = tracker.report()
    (survivor,) = [f for f in report.leaks if f.rule == "survivor"]
    assert (survivor.pid, survivor.epoch) == (helper.pid, 0)
    helper.kill()
    helper.wait()


def _register_and_exit() -> None:
    _report_and_exit(None, False)


def test_the_drivers_accounting_gives_an_exited_workers_peak_where_it_is_on(
    fake_nvml: FakePynvml,
) -> None:
    """Accounting mode switched on by an administrator: the driver's maximum for a worker
    that exited unseen and unreported is its peak; a tracker never switches the mode on."""
    device = fake_nvml.devices[0]
    worker = CTX.Process(target=_register_and_exit)
    with Tracker(grace=0.2, interval=3600.0) as tracker:
        with tracker.epoch():
            worker.start()
            worker.join()
            assert device.accounting_mode is False
            device.accounting_mode = True  # what `nvidia-smi -am 1` does, by someone else
        (record,) = tracker.epochs()
    (proc,) = [p for p in record.processes if p.key.pid == worker.pid]
    assert (proc.gpu_peak_source, proc.total_gpu_bytes_peak) == ("unknown", None)

    device.accounting_mode = True
    worker = CTX.Process(target=_register_and_exit)
    with Tracker(grace=0.2, interval=3600.0) as tracker:
        with tracker.epoch():
            worker.start()
            worker.join()
            device.accounting[worker.pid or 0] = (900 * MIB, 10, False)
        (record,) = tracker.epochs()
    (proc,) = [p for p in record.processes if p.key.pid == worker.pid]
    assert (proc.gpu_peak_source, proc.total_gpu_bytes_peak) == ("reported", 900 * MIB)
    assert fake_nvml.calls["nvmlDeviceSetAccountingMode"] == 0


def test_a_trackers_state_is_read_only() -> None:
    """``closed``, ``root_pid`` and ``mailbox_dir`` are read, never set, from outside."""
    tracker = Tracker()
    for name, value in (("closed", True), ("root_pid", 1), ("mailbox_dir", "/tmp")):
        with pytest.raises(AttributeError):
            setattr(tracker, name, value)
    assert tracker.closed is False and tracker.root_pid == os.getpid()


def test_an_epoch_end_named_later_names_only_an_unnamed_exception() -> None:
    """An error found after its epoch's end names that epoch once: a named end keeps its line."""
    with Tracker(interval=0.05) as tracker:
        tracker.begin_epoch()
        tracker.end_epoch("exception", "RuntimeError: first")
        tracker.begin_epoch()
        tracker.end_epoch("exception")
        for index in (0, 1):
            tracker.name_end(index, "exception", "RuntimeError: later")
        ends = [(e.end_reason, e.error) for e in tracker.epochs()]
    assert ends == [("exception", "RuntimeError: first"), ("exception", "RuntimeError: later")]
