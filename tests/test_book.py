"""The epoch a process was born in, from its create time.

NOTE [born epoch] in leakcheck/track/sample_reader.py.
"""

from __future__ import annotations

import os

from leakcheck.core.readings import ProcessKey, ProcInfo
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
