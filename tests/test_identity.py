"""A process is ``(pid, start ticks since boot)`` in every process that names it.

NOTE [process identity] in observe/procs.py: the boot time in /proc/stat moves with the wall
clock, so a worker that reads it afresh (spawn) or later than its parent can see another
second than the tracker did. These tests give the workers of real DataLoaders a boot time
shifted by a second, at the /proc boundary (what ``/proc/stat`` says in the worker), and
check that the loader's tracker still knows its workers; and that a worker whose record
reaches the tracker only after its epoch ended is still that loader's worker.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.observe import procs
from leakcheck.track.tracker import Tracker
from leakcheck.worker.teardown import WorkerInit
from tests.polling import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

_BTIME = re.compile(rb"^btime (\d+)$", re.MULTILINE)
_unshifted_read = procs._read


def _unshifted_boot_time() -> int:
    """The boot time /proc/stat says, read past any shift."""
    match = _BTIME.search(_unshifted_read("/proc/stat", 65536, whole=True) or b"")
    assert match is not None
    return int(match.group(1))


def _shift_boot_time(shift_s: int) -> None:
    """From now on this process reads a boot time ``shift_s`` later in ``/proc/stat``.

    What a worker sees when the wall clock was stepped (or slewed across a second) between
    its parent's read and its own: the kernel derives ``btime`` from the wall clock.
    """
    read = procs._read

    def shifted(path: str, *args: Any, **kwargs: Any) -> bytes | None:
        data = read(path, *args, **kwargs)
        if path != "/proc/stat" or not data:
            return data
        return _BTIME.sub(lambda m: b"btime %d" % (int(m.group(1)) + shift_s), data)

    procs._read = shifted
    procs.boot_time_s.cache_clear()


_fork_shift_s = 0
"""The shift forked children apply as they start (while a test sets it)."""


def _shift_in_forked_child() -> None:
    if _fork_shift_s:
        _shift_boot_time(_fork_shift_s)


os.register_at_fork(after_in_child=_shift_in_forked_child)


class BootTimes(Dataset[torch.Tensor]):
    """Items say which process made them and how far off the boot time it reads is.

    Unpickled in a spawn worker before its ``worker_init_fn`` runs, so the shift is in place
    when the worker posts its identity; a fork worker gets it from ``_shift_in_forked_child``.
    """

    def __init__(self, shift_s: int) -> None:
        self.shift_s = shift_s

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _shift_boot_time(self.shift_s)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        shift_s = int(procs.boot_time_s()) - _unshifted_boot_time()
        return torch.tensor([os.getpid(), shift_s], dtype=torch.float64)


@pytest.fixture
def fork_shift() -> Iterator[None]:
    yield
    global _fork_shift_s
    _fork_shift_s = 0


@pytest.mark.parametrize("shift_s", [1, -1])
@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_workers_that_read_another_boot_time_are_still_the_loaders_workers(
    context: str, shift_s: int, fork_shift: None
) -> None:
    global _fork_shift_s
    _fork_shift_s = shift_s if context == "fork" else 0
    loader: DataLoader[torch.Tensor] = DataLoader(
        BootTimes(shift_s),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    watched = leakcheck.watch(loader, on_leak="ignore", grace=0.5)
    seen: dict[int, int] = {}
    with watched:
        for _ in range(3):
            for batch in watched:
                seen.update((int(pid), int(shift)) for pid, shift in batch.tolist())
        workers = set(watched.tracker.worker_keys())
        live = {procs.process_key(pid) for pid in seen}
        watched.drop_loader()
    # The workers did read the shifted boot time (the injection reached them)...
    assert len(seen) == 2 and set(seen.values()) == {shift_s}, seen
    # ... and the tracker knows them as its workers, by their own records.
    assert workers == live, (workers, live)
    report = watched.report()
    assert report.leaks == [], report.format()
    for record in report.epochs:
        roles = {p.key.pid: p.role for p in record.processes if p.key.pid in seen}
        assert roles == dict.fromkeys(seen, "worker"), (record.index, roles)


class Pids(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getpid()])


def _records(folder: Path, *, count: int) -> list[str]:
    """The names of the ``count`` records posted to ``folder`` (each is whole once named)."""

    def names() -> list[str]:
        return [name for name in os.listdir(folder) if name.endswith(".json")]

    assert wait_for(lambda: len(names()) == count, timeout_s=30), os.listdir(folder)
    return names()


def test_a_worker_whose_record_comes_after_its_epoch_ended_is_still_the_loaders_worker(
    tmp_path: Path,
) -> None:
    """The workers post to a holding folder; their records reach the tracker's mailbox only
    once the epoch that started them has ended (as when a loop breaks before a worker's
    first batch). The epoch's record still names them its loader's workers."""
    held = tmp_path / "held"
    held.mkdir()
    init = WorkerInit(persistent=True, release=False, mailbox_dir=str(held))
    loader: DataLoader[torch.Tensor] = DataLoader(
        Pids(), batch_size=2, num_workers=2, persistent_workers=True, worker_init_fn=init
    )
    pids: set[int] = set()
    with Tracker(grace=0.5, persistent_workers=False) as tracker:
        with tracker.epoch():
            for batch in loader:
                pids.update(batch.flatten().tolist())
        assert len(pids) == 2 and tracker.worker_keys() == []  # nothing came yet
        assert tracker.mailbox_dir is not None
        for name in _records(held, count=2):
            os.replace(held / name, Path(tracker.mailbox_dir) / name)
        tracker.sample()
        assert {key.pid for key in tracker.worker_keys()} == pids
        with tracker.epoch():
            for _batch in loader:
                pass
        del loader  # stops the persistent workers
        report = tracker.report()
    assert report.leaks == [], report.format()
    first = report.epochs[0]
    assert {p.key.pid: p.role for p in first.processes if p.key.pid in pids} == dict.fromkeys(
        pids, "worker"
    )
    assert all(p.persistent for p in first.processes if p.key.pid in pids)
