"""The tracker's host memory and /dev/shm reads, on real processes (CPU).

Each epoch end reads every process's RSS (status) and, paced, the parent's USS and PSS
(smaps_rollup) on the loop's thread and persistent workers' on the sampler's; workers that
live one epoch report their own at exit; the job's /dev/shm files are listed per epoch and
judged at close.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import leakcheck
from leakcheck.core.model import ProcessEpoch, ProcessKey
from leakcheck.judge.verdict import judge
from leakcheck.observe import hostmem
from leakcheck.track.book import EpochBook
from leakcheck.track.sampler import Sampler
from leakcheck.track.tracker import Tracker
from tests.polling import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

SHM = Path("/dev/shm")

# Creates /dev/shm/<argv[1]> (4 KiB), holds it open, says so, and waits for stdin to close.
HOLDER = """
import os, sys
fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.write(fd, b"x" * 4096)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """/dev/shm names a test makes; every one is removed at the end."""
    names: list[str] = []
    yield names
    for name in names:
        (SHM / name).unlink(missing_ok=True)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait()


def _sleeper(children: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True
    )
    children.append(child)
    return child


def _by_role(processes: tuple[ProcessEpoch, ...], role: str) -> list[ProcessEpoch]:
    return [p for p in processes if p.role == role]


def test_epoch_ends_read_rss_of_every_process_and_uss_of_the_long_lived(
    children: list[subprocess.Popen[str]],
) -> None:
    with Tracker(rollup_share=1.0, grace=0.1) as tracker:
        worker = _sleeper(children)
        helper = _sleeper(children)
        tracker.register_worker(worker.pid, persistent=True)
        for index in range(3):
            with tracker.epoch():
                time.sleep(0.05)
            tracker.finish_reads()
            record = tracker.epochs()[index]
            (parent,) = _by_role(record.processes, "parent")
            (listed_worker,) = _by_role(record.processes, "worker")
            (descendant,) = [p for p in record.processes if p.key.pid == helper.pid]
            for proc in (parent, listed_worker):
                # USS (smaps_rollup) for the parent and the persistent worker...
                assert proc.host_source == "uss"
                assert proc.host_bytes_end and proc.pss_bytes_end and proc.rss_bytes_end
                assert proc.host_bytes_end <= proc.rss_bytes_end
                assert proc.rss_bytes_peak and proc.rss_bytes_peak >= proc.rss_bytes_end
                assert proc.anon_bytes_end and proc.anon_bytes_end <= proc.rss_bytes_end
            # ... RSS for the others (status only: cheap).
            assert descendant.host_source == "rss" and descendant.pss_bytes_end is None
            assert descendant.host_bytes_end == descendant.rss_bytes_end
        for child in children:
            child.stdin.close()  # type: ignore[union-attr]
            child.wait()
    final = tracker.timeline().final
    assert final is not None
    (parent,) = _by_role(final.processes, "parent")
    assert parent.host_source == "uss" and parent.pss_bytes_end


def test_paced_out_epoch_ends_say_rss_never_an_older_uss() -> None:
    # A share so small that after one read no other fits in the run; epochs 1-3 are the
    # host rule's first points after the warm-up, read whatever the pacing says (a child
    # alive may share the parent's pages); the warm-up's end, which no rule judges, reads none.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        with Tracker(rollup_share=1e-9, grace=0.1, warmup_epochs=1) as tracker:
            for _ in range(6):
                with tracker.epoch():
                    time.sleep(0.02)
                tracker.finish_reads()
    finally:
        child.communicate()
    parents = [_by_role(e.processes, "parent")[0] for e in tracker.epochs()]
    assert [p.host_source for p in parents] == ["rss"] + ["uss"] * 3 + ["rss"] * 2
    for parent in parents[:1] + parents[4:]:
        assert parent.host_bytes_end == parent.rss_bytes_end and parent.pss_bytes_end is None


def test_unpaced_reads_read_every_epoch_end_the_warm_up_too() -> None:
    with Tracker(rollup_share=1.0, grace=0.1, warmup_epochs=2) as tracker:
        for _ in range(6):
            with tracker.epoch():
                time.sleep(0.02)
            tracker.finish_reads()
    parents = [_by_role(e.processes, "parent")[0] for e in tracker.epochs()]
    assert [p.host_source for p in parents] == ["uss"] * 6


def _rollups_of(calls: list[tuple[str, list[int]]], pid: int) -> list[str]:
    return [thread for thread, pids in calls if pid in pids]


def _read_times(calls: list[tuple[str, list[int]]], pid: int, times: int) -> bool:
    return len(_rollups_of(calls, pid)) == times


def test_the_loops_process_is_read_as_its_epoch_ends_the_workers_on_the_sampler_thread(
    monkeypatch: pytest.MonkeyPatch, children: list[subprocess.Popen[str]]
) -> None:
    """What the loop does after an epoch's end is not that epoch's (NOTE [host pacing])."""
    calls: list[tuple[str, list[int]]] = []  # (thread, PIDs) of each smaps_rollup read
    real = hostmem.read_host_memories

    def recording(targets: Any, *, rollup: bool = True) -> Any:
        targets = list(targets)
        if rollup:
            calls.append((threading.current_thread().name, [key.pid for key in targets]))
        return real(targets, rollup=rollup)

    monkeypatch.setattr(hostmem, "read_host_memories", recording)
    with Tracker(rollup_share=1.0, grace=0.1) as tracker:
        worker = _sleeper(children)
        tracker.register_worker(worker.pid, persistent=True)
        for index in range(2):
            with tracker.epoch():
                time.sleep(0.02)
            # Read before the end returned: on this thread, nothing of the loop's since.
            assert _rollups_of(calls, os.getpid()) == ["MainThread"] * (index + 1)
            assert wait_for(functools.partial(_read_times, calls, worker.pid, index + 1))
        assert set(_rollups_of(calls, worker.pid)) == {"leakcheck-sampler"}
        epochs = tracker.epochs()
        worker.stdin.close()  # type: ignore[union-attr]
        worker.wait()
    assert all(p.host_source == "uss" for e in epochs for p in e.processes)


def test_the_sampler_threads_host_reads_are_counted_apart_in_its_cost(
    monkeypatch: pytest.MonkeyPatch, children: list[subprocess.Popen[str]]
) -> None:
    """``cost().host_read_cpu_s``: the sampler's CPU in the reads after epoch ends (a
    persistent worker's), part of its CPU; nothing before an epoch ended."""
    real = hostmem.read_host_memories

    def costly(targets: Any, *, rollup: bool = True) -> Any:
        if rollup:  # CPU the reads' own would take for a large process
            until = time.thread_time() + 0.02
            while time.thread_time() < until:
                pass
        return real(targets, rollup=rollup)

    monkeypatch.setattr(hostmem, "read_host_memories", costly)
    with Tracker(rollup_share=1.0, grace=0.1, interval=3600.0) as tracker:
        worker = _sleeper(children)
        tracker.register_worker(worker.pid, persistent=True)
        assert tracker.cost().host_read_cpu_s == 0.0
        with tracker.epoch():
            time.sleep(0.02)
        # The sampler thread reads the worker on its wake after the epoch end.
        assert wait_for(lambda: tracker.cost().host_read_cpu_s > 0.0)
        cost = tracker.cost()
        worker.stdin.close()  # type: ignore[union-attr]
        worker.wait()
    assert 0.015 < cost.host_read_cpu_s <= cost.sampler_cpu_s, cost


def test_a_read_made_after_the_next_epoch_ended_is_not_given_to_the_earlier_one() -> None:
    book = EpochBook(grace_s=1.0)
    key = ProcessKey(os.getpid(), 100)
    memory = hostmem.HostMemory(1, 2, 3, None, "smaps_rollup")
    book.begin(None, 0.0)
    book.epochs[0].end_s = 1.0
    book.begin(None, 1.0)
    assert book.apply_rollup(0, {key: memory})  # epoch 1 is still open: a fair read of 0
    book.epochs[1].end_s = 2.0
    assert not book.apply_rollup(0, {key: memory})  # read after epoch 1 ended: not epoch 0's
    assert book.apply_rollup(1, {key: memory})


def test_workers_that_live_one_epoch_report_their_host_memory_at_exit() -> None:
    import torch
    from torch.utils.data import DataLoader

    import leakcheck

    data = torch.arange(64, dtype=torch.float32)
    # torch types a dataset as Dataset; a Tensor serves as one (indexable, with a length).
    loader: DataLoader[torch.Tensor] = DataLoader(
        data,  # type: ignore[arg-type]
        batch_size=8,
        num_workers=2,
        multiprocessing_context="fork",
    )
    with leakcheck.watch(loader, grace=30) as watched:  # close() waits only for the living
        for _ in range(2):
            for _batch in watched:
                pass
    report = watched.report()
    assert report.leaks == []
    for record in report.epochs:
        workers = _by_role(record.processes, "worker")
        assert len(workers) == 2
        for worker in workers:
            assert not worker.alive_at_end  # gone by the end: what it said as it exited
            assert worker.host_source == "uss" and worker.host_bytes_end
            assert worker.rss_bytes_peak and worker.rss_bytes_end
    assert all(t.host_uss_bytes and t.host_rss_peak_bytes for t in report.timeline.teardowns)


def test_the_jobs_shm_files_per_epoch_and_what_is_left_at_close(shm_names: list[str]) -> None:
    token = uuid.uuid4().hex[:10]
    held, mine, stranger = f"lc_{token}_held", f"lc_{token}_{os.getpid()}", f"lc_{token}_x"
    made = f"lc_{token}_made"  # by the job's root, named after nobody (NOTE [made here])
    semaphore = f"sem.lc_{token}_{os.getpid()}"  # named after the job, yet never judged
    shm_names.extend([held, mine, stranger, semaphore, made])
    with Tracker(grace=0.1) as tracker:
        with tracker.epoch():
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, held],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            (SHM / mine).write_bytes(b"y" * 100)  # named after the job's root: its own
            (SHM / made).write_bytes(b"m" * 10)
            # Made by a child that is gone, named after none: nothing ties it to the job.
            code = f"open({str(SHM / stranger)!r}, 'wb').write(b'z' * 10)"
            subprocess.run([sys.executable, "-c", code], check=True)
            (SHM / semaphore).write_bytes(b"s" * 32)
        first = tracker.epochs()[0]
        # The job's: the one its child holds, the one named after its root, the one it made.
        listed = {item.name: item for item in first.shm_files}
        assert set(listed) == {held, mine, made}
        assert (listed[held].holder_pid, listed[held].holder_role) == (holder.pid, "descendant")
        assert listed[mine].holder_pid is None
        assert first.shm_bytes == 4096 + 100 + 10
        assert first.shm_total_bytes and first.shm_used_peak_bytes
        with tracker.epoch():
            holder.stdin.close()  # type: ignore[union-attr]
            holder.wait()
            holder.stdout.close()
    files = {item.name: item for item in tracker.timeline().shm_files}
    assert set(files) >= {held, mine, stranger} and semaphore not in files
    findings = {f.shm_name: f for f in judge(tracker.timeline(), tracker.config) if f.shm_name}
    # Held by a process of the job at an epoch end, now by nobody: left behind.
    assert findings[held].severity == "leak"
    assert f"/dev/shm/{held} (4 KiB) left behind, held by nobody" in findings[held].message
    assert findings[mine].severity == "leak"
    assert findings[made].severity == "leak"
    assert findings[stranger].severity == "info"
    said = findings[stranger].message
    assert "nothing ties it to the work" in said or "older than the work" in said


def test_a_file_the_parent_still_holds_at_close_is_said_not_blamed(shm_names: list[str]) -> None:
    name = f"lc_{uuid.uuid4().hex[:10]}_open"
    shm_names.append(name)
    with Tracker(grace=0.1) as tracker, tracker.epoch():
        fd = os.open(SHM / name, os.O_CREAT | os.O_RDWR, 0o600)
        os.write(fd, b"x" * 10)
    try:
        (item,) = [f for f in tracker.timeline().shm_files if f.name == name]
        assert item.in_use and item.holder_role == "parent"
        (finding,) = [f for f in judge(tracker.timeline(), tracker.config) if f.shm_name == name]
        assert finding.severity == "info" and "held by the parent" in finding.message
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("context", "persistent", "workers"),
    [("fork", True, 2), ("fork", False, 2), ("spawn", True, 2), ("spawn", False, 1)],
)
def test_clean_loaders_over_ten_epochs_have_no_host_finding(
    context: str, persistent: bool, workers: int
) -> None:
    import torch
    from torch.utils.data import DataLoader

    from leakcheck.adapters.dataloader import WatchedLoader

    # The data in one tensor: reading it writes no reference counts, nothing is copied.
    data = torch.arange(20_000 * 16, dtype=torch.float32).reshape(20_000, 16)
    loader: DataLoader[torch.Tensor] = DataLoader(
        data,  # type: ignore[arg-type]  # a Tensor serves as a Dataset
        batch_size=500,
        shuffle=True,
        num_workers=workers,
        persistent_workers=persistent,
        multiprocessing_context=context,
    )
    # Every worker exits by the end: a grace for a loaded host, which close() waits out only
    # for what is still alive.
    tracker = Tracker(rollup_share=1.0, persistent_workers=persistent, grace=30)
    watched = WatchedLoader(loader, tracker=tracker, on_leak="ignore", teardown=True)
    del loader
    with watched:
        for _ in range(10):
            for batch in watched:
                batch.sum()
        watched.drop_loader()
    report = watched.report()
    # (Files other tests make in /dev/shm meanwhile are said, as info, never blamed.)
    assert [f for f in report.findings if f.rule == "host-growth"] == []
    assert report.leaks == [], report.format()
    # Host memory was read: USS for the parent at every epoch end.
    parents = [_by_role(e.processes, "parent")[0] for e in report.epochs]
    assert all(p.host_source == "uss" for p in parents)


def test_a_loop_that_starts_keeping_memory_late_leaks_with_its_uss_paced_out() -> None:
    """USS read at the host rule's first three ends only; from epoch 5 on the loop keeps
    40 MiB an epoch: judged on RssAnon, read at every end."""
    from torch.utils.data import DataLoader

    kept: list[bytearray] = []
    loader = leakcheck.watch(
        DataLoader(torch.arange(64.0), batch_size=16, num_workers=1),  # type: ignore[arg-type]
        on_leak="ignore",
        rollup_share=1e-9,
    )
    with loader:
        for index in range(10):
            for batch in loader:
                batch.sum()
            if index >= 5:
                kept.append(bytearray(40 << 20))
    report = loader.report()
    parents = [_by_role(e.processes, "parent")[0] for e in report.epochs]
    # Epochs 2-3 read USS only while another process may share the parent's pages (left by a test).
    sources = [p.host_source for p in parents]
    assert sources[1] == "uss" and sources[4:] == ["rss"] * 6, sources
    (found,) = [f for f in report.findings if f.rule == "host-growth"]
    assert (found.severity, found.role) == ("leak", "parent"), report.format()
    assert "host memory (RssAnon) grows" in found.message


@pytest.mark.parametrize("script", ["copy_on_read_leak.py", "copy_on_read_fixed.py"])
def test_the_copy_on_read_examples(script: str) -> None:
    """The classic shape: copied in epoch 0, flat after; found there by the copy-on-read rule
    (the host-growth rule sees no growth). 400k rows: each worker copies ~115 MiB."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    done = subprocess.run(
        [sys.executable, str(repo / "examples" / script), "400000"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "LEAK host-growth" not in done.stdout
    found = [line for line in done.stdout.splitlines() if line.startswith("LEAK copy-on-read")]
    if script == "copy_on_read_leak.py":
        (line,) = found
        assert "2 forked workers of PID" in line and "into epoch 0" in line, done.stdout
    else:
        assert found == [] and "no leaks in 4 epochs" in done.stdout, done.stdout
    # Every epoch end printed each worker's copy: read at every end (rollup_share=1.0).
    copies = [line for line in done.stdout.splitlines() if line.startswith("  worker ")]
    assert len(copies) == 8 and all("copied ?" not in line for line in copies)


def test_the_first_epoch_ends_the_host_rule_judges_read_uss_whatever_the_pacing() -> None:
    """The pacing would put the next read 1000 s away; the epoch ends after the warm-up (the
    host-growth rule's first three points) read USS anyway where a process may share the
    parent's pages, later ones wait for the pacing."""
    from leakcheck.core.readings import ProcInfo
    from leakcheck.observe import procs
    from leakcheck.track.reads import Failures, HostReads
    from leakcheck.track.table import ProcessTable

    root = procs.process_key(os.getpid())
    assert root is not None
    table = ProcessTable(root, procs.read_proc(os.getpid()), session="s", persistent_workers=True)
    host = HostReads(Failures(strict=False), rollup_share=0.001, warmup_epochs=1)
    host.due_s = time.perf_counter() + 1000.0  # as after 1 s of CPU at 0.1%
    # The parent alone: no process shares its pages, its RssAnon tells what USS would.
    assert [host.plan(index, table) for index in range(6)] == [False] * 6
    child = ProcessKey(root.pid + 100_000, root.start_ticks + 100)
    table.add(ProcInfo(child, root.pid, "python", "python child.py"), now=0.0, born_epoch=0)
    assert [host.plan(index, table) for index in range(6)] == [
        False, True, True, True, False, False,
    ]  # fmt: skip


def test_a_forked_workers_first_end_and_long_epochs_read_it_whatever_the_pacing() -> None:
    """The copy-on-read rule's evidence (NOTE [copy on read] in hostmem.py): a forked worker
    that reported its birth is read at the first epoch end it is alive at, however the
    pacing stands; inside an epoch, reads come once it has lasted a second, a second apart
    at most, and as the pacing allows."""
    from leakcheck.core.readings import ProcInfo
    from leakcheck.observe import procs
    from leakcheck.track.reads import INSIDE_AFTER_S, INSIDE_GAP_S, Failures, HostReads
    from leakcheck.track.table import ProcessTable

    root = procs.process_key(os.getpid())
    assert root is not None
    table = ProcessTable(root, procs.read_proc(os.getpid()), session="s", persistent_workers=False)
    worker = ProcessKey(root.pid + 100_000, root.start_ticks + 100)
    table.add(ProcInfo(worker, root.pid, "python", "python train.py"), now=0.0, born_epoch=0)
    host = HostReads(Failures(strict=False), rollup_share=0.001, warmup_epochs=1)
    assert not host.plan(0, table)  # a warm-up end, no birth report: nothing to read
    assert host.plan_inside(table, 0, 0.0, 5.0) is None
    born = hostmem.HostMemory(1, None, 2, None, "smaps_rollup", shared_dirty_bytes=1,
                              private_dirty_bytes=1)  # fmt: skip
    table.note_birth(worker, True, born)
    host.due_s = time.perf_counter() + 1000.0  # as after 1 s of CPU at 0.1%
    assert host.plan(0, table) and host.pending is not None
    assert host.pending.keys == (worker,)
    assert not host.plan(4, table)  # read once: later ends wait for the pacing
    assert host.plan_inside(table, 4, 0.0, 5.0) is None  # paced out inside too
    host.due_s = 0.0
    assert host.plan_inside(table, 4, 0.0, INSIDE_AFTER_S / 2) is None  # too young
    plan = host.plan_inside(table, 4, 0.0, INSIDE_AFTER_S)
    assert plan is not None and plan.keys == (worker,) and plan.epoch_index == 4
    assert host.plan_inside(table, 4, 0.0, INSIDE_AFTER_S + INSIDE_GAP_S / 2) is None
    assert host.plan_inside(table, 4, 0.0, INSIDE_AFTER_S + INSIDE_GAP_S) is not None
    assert host.plan_inside(table, None, None, 100.0) is None  # no epoch open
    table.note_birth(worker, False, born)  # spawned: nothing to measure a copy against
    assert host.plan_inside(table, 4, 0.0, 100.0) is None


class _Tiny(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(2)


def _host_sources_of_tiny_epochs(epochs: int, **options: Any) -> list[dict[str, str | None]]:
    """Epochs of milliseconds of a watched loader of 2 persistent workers: per epoch, where
    each role's host memory came from (``uss``, ``rss``)."""
    loader = torch.utils.data.DataLoader(
        _Tiny(), batch_size=2, num_workers=2, persistent_workers=True
    )
    with leakcheck.watch(loader, grace=0.2, **options) as watched:
        for _ in range(epochs):
            for _batch in watched:
                pass
    return [{p.role: p.host_source for p in e.processes} for e in watched.report().epochs]


@pytest.mark.parametrize(
    ("share", "sources"),
    [
        (None, [("rss", "uss"), ("uss", "uss"), ("uss", "uss"), ("uss", "uss")]),
        (1.0, [("uss", "uss")] * 6),
    ],
)
def test_watched_epochs_of_milliseconds_read_uss_where_the_pacing_says(
    share: float | None, sources: list[tuple[str, str]]
) -> None:
    """The ends that always read (the host rule's first three; a forked worker's first end,
    for the copy-on-read rule) and, unpaced, every end have their USS before the next epoch
    begins: the wrapper makes the planned reads itself, so the sampler's thread, late,
    neither loses them nor reads a later moment for them."""
    found = _host_sources_of_tiny_epochs(6, rollup_share=share)
    for index, (parent_source, worker_source) in enumerate(sources):
        expected = {"parent": parent_source, "worker": worker_source}
        assert found[index] == expected, (index, found)


@pytest.mark.parametrize("on_leak", ["warn", "ignore"])
def test_reads_the_sampler_did_not_make_are_made_before_the_next_epoch(
    monkeypatch: pytest.MonkeyPatch, on_leak: Literal["warn", "ignore"]
) -> None:
    """A sampler thread that never comes to the reads (its wakes dropped, as a thread late
    behind epochs of milliseconds): the caller's thread makes them, as it judges or, with
    leaks ignored (``leakcheck run``'s wrappers), as the next epoch opens, so the host rule's
    first ends have USS."""
    monkeypatch.setattr(Sampler, "_wake", lambda self: None)
    sources = _host_sources_of_tiny_epochs(4, on_leak=on_leak)
    assert sources[1:] == [{"parent": "uss", "worker": "uss"}] * 3, sources
