"""The epoch a process was born in, from its create time.

NOTE [born epoch] in leakcheck/track/sampler.py.
"""

from __future__ import annotations

import os

from leakcheck.core.readings import ProcessKey, ProcInfo
from leakcheck.observe.hostmem import HostMemory
from leakcheck.track.book import EpochBook
from leakcheck.track.table import ProcessTable

TICK_S = 0.01


def _book(*spans: tuple[float, float | None]) -> EpochBook:
    book = EpochBook(grace_s=1.0)
    for start_s, end_s in spans:
        book.begin(None, start_s)
        book.epochs[-1].end_s = end_s
    return book


def test_a_birth_inside_an_epoch_is_that_epochs() -> None:
    book = _book((1.0, 2.0), (2.5, 3.5), (4.0, None))
    assert [book.born_in(at_s, TICK_S) for at_s in (1.5, 3.0, 9.0)] == [0, 1, 2]


def test_a_worker_forked_in_the_tick_its_epoch_opened_is_that_epochs() -> None:
    """Create times are truncated to the tick: it can read a few ms before the opening."""
    book = _book((1.0, 2.0), (2.004, None))
    assert book.born_in(2.0, TICK_S) == 1


def test_a_birth_between_epochs_or_before_the_first_is_none() -> None:
    book = _book((1.0, 2.0), (3.0, 4.0))
    assert [book.born_in(at_s, TICK_S) for at_s in (0.5, 2.5, 4.5)] == [None, None, None]


def test_close_waits_from_the_end_of_the_epoch_a_process_was_born_in() -> None:
    """A helper found epochs after its birth has had its grace since its birth epoch ended."""
    book = _book((0.0, 1.0), (1.0, 2.0), (2.0, 3.0))
    root = ProcessKey(os.getpid(), 10_000)
    table = ProcessTable(root, None, session="s", persistent_workers=False)
    late, between = (
        table.add(
            ProcInfo(ProcessKey(pid, 10_100), root.pid, "python", "python helper.py"),
            now=3.1,
            born_epoch=2,
        )
        for pid in (4001, 4002)
    )
    late.birth_epoch = 0  # created in epoch 0, placed when found in epoch 2
    between.birth_epoch = None  # created between epochs: counted from where it was placed
    pending, deadline_s = book.pending_survivors(table)
    assert [proc.key.pid for proc in pending] == [4002]
    assert deadline_s == 4.0


MIB = 2**20


def _reading(shared_mib: float, private_mib: float) -> HostMemory:
    return HostMemory(
        int(private_mib * MIB), None, None, None, "smaps_rollup",
        shared_dirty_bytes=int(shared_mib * MIB), private_dirty_bytes=int(private_mib * MIB),
    )  # fmt: skip


def _worker(table: ProcessTable, pid: int, *, forked: bool | None) -> ProcessKey:
    key = ProcessKey(pid, 10100)
    table.add(ProcInfo(key, table.root.pid, "python", "python train.py"), now=0.0, born_epoch=0)
    table.note_birth(key, forked, _reading(200, 9))
    return key


def test_copies_are_kept_per_epoch_with_when_they_first_passed_the_tolerance() -> None:
    """In-epoch reads, the end's read and the exit report each measure from the birth; the
    epoch keeps the most, and the first reading above the tolerance says when."""
    root = ProcessKey(os.getpid(), 10000)
    table = ProcessTable(root, None, session="s", persistent_workers=True)
    kept, gone, spawned = (
        _worker(table, 4001, forked=True),
        _worker(table, 4002, forked=True),
        _worker(table, 4003, forked=False),
    )
    assert table.copy_watched() == [kept, gone]  # what an in-epoch read reads
    book = EpochBook(grace_s=1.0, copy_tolerance_bytes=64 * MIB)
    book.begin(None, 10.0)
    book.apply_inside(table, {kept: _reading(180, 29), spawned: _reading(0, 300)}, 12.0)
    book.apply_inside(table, {kept: _reading(100, 109), gone: _reading(190, 19)}, 15.5)
    assert book.apply_report(gone, 16.0, {}, _reading(120, 89))
    table.mark_exited(table.procs[gone], 16.5)
    book.end(table, now=20.0, reason="completed", error=None, devices=())
    book.apply_rollup(0, {kept: _reading(110, 99)})  # the end: a little given back since
    (record,) = book.records(table)
    by_pid = {p.key.pid: p for p in record.processes}
    first = by_pid[4001]
    assert (first.forked, first.private_bytes_birth, first.shared_bytes_birth) == (
        True, 9 * MIB, 200 * MIB,
    )  # fmt: skip
    assert first.copied_bytes_peak == 100 * MIB and first.copied_bytes_end == 90 * MIB
    assert first.shared_bytes_end == 110 * MIB
    assert first.copied_over_after_s == 5.5  # the 15.5 s read, not the end's
    second = by_pid[4002]
    assert second.copied_bytes_peak == second.copied_bytes_end == 80 * MIB
    assert second.copied_over_after_s == 6.0  # its exit report
    third = by_pid[4003]
    assert third.forked is False and third.copied_bytes_peak is None  # never a copy figure
    # A state read now, with the next epoch open: that epoch's copies so far.
    book.begin(None, 30.0)
    rollup = {kept: _reading(100, 109)}
    now = {p.key: p for p in book.final(table, {}, rollup, 32.0)}
    assert now[kept].copied_bytes_peak == 100 * MIB and now[kept].copied_over_after_s == 2.0
