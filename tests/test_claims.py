"""Ownership among trackers: which epoch a process's start falls in (NOTE [claims]).

The registry's epochs are set directly, in seconds since boot, and a process's start is
given as /proc gives it: whole clock ticks since boot, truncated (``_ticks``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import leakcheck
from leakcheck.core.model import ProcessKey
from leakcheck.core.readings import ProcInfo
from leakcheck.observe import procs
from leakcheck.track import claims
from leakcheck.track.book import EpochBook
from leakcheck.track.table import ProcessTable

Epochs = list[tuple[str, float, float | None]]


def _ticks(since_boot_s: float) -> int:
    """Start ticks of a process born ``since_boot_s`` seconds after boot."""
    return round(since_boot_s * procs.clock_ticks())


def _owner(monkeypatch: pytest.MonkeyPatch, epochs: Epochs, born_tick_s: float) -> str:
    monkeypatch.setattr(claims, "_epochs", list(epochs))
    monkeypatch.setattr(claims, "_live", {})
    key = ProcessKey(pid=4242, start_ticks=_ticks(born_tick_s))
    return claims.claim(key, None, "placing")


def test_a_process_born_as_the_next_trackers_epoch_opened_is_that_trackers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two loaders' epochs back to back: the first closed 7 ms before the second opened, and
    a process born after the second opened reads a tick earlier, before the first closed."""
    epochs: Epochs = [("first", 10.000, 10.4807), ("second", 10.4876, None)]
    assert _owner(monkeypatch, epochs, 10.48) == "second"


def test_an_inner_epoch_opened_just_after_a_birth_does_not_take_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training epoch open for seconds; the validation loader opens its epoch 3 ms into the
    tick in which a training worker was forked: the training epoch covers the whole tick."""
    epochs: Epochs = [("train", 9.0, None), ("val", 10.483, None)]
    assert _owner(monkeypatch, epochs, 10.48) == "train"


def test_a_birth_well_inside_a_closed_epoch_is_that_epochs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    epochs: Epochs = [("first", 10.0, 10.5), ("second", 10.6, None)]
    assert _owner(monkeypatch, epochs, 10.2) == "first"


def test_the_innermost_epoch_covering_the_birth_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    epochs: Epochs = [("train", 9.0, None), ("val", 10.1, 10.9)]
    assert _owner(monkeypatch, epochs, 10.5) == "val"


def test_a_birth_in_no_epoch_goes_to_the_tracker_placing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    epochs: Epochs = [("first", 10.0, 10.5)]
    assert _owner(monkeypatch, epochs, 11.0) == "placing"


def _fresh_registry(monkeypatch: pytest.MonkeyPatch, epochs: Epochs) -> None:
    monkeypatch.setattr(claims, "_epochs", list(epochs))
    monkeypatch.setattr(claims, "_live", {})
    monkeypatch.setattr(claims, "_gone", {})
    monkeypatch.setattr(claims, "_taken", {})
    monkeypatch.setattr(claims, "_roots", {})


def test_a_workers_report_takes_along_what_it_started_before_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The validation worker was forked in the tick its epoch opened, so its start reads
    before the opening and the training epoch claims it; its helper follows it, and
    both move to validation when the worker's own report arrives (rule 1 before rule 2)."""
    _fresh_registry(monkeypatch, [("train", 9.0, None), ("val", 10.483, None)])
    worker = ProcessKey(pid=500, start_ticks=_ticks(10.48))
    helper = ProcessKey(pid=501, start_ticks=_ticks(10.50))
    grandchild = ProcessKey(pid=502, start_ticks=_ticks(10.52))
    assert claims.claim(worker, None, "train") == "train"
    assert claims.claim(helper, worker, "train") == "train"
    assert claims.claim(grandchild, helper, "train") == "train"
    claims.claim_worker(worker, "val")
    assert [claims.owner_of(key) for key in (worker, helper, grandchild)] == ["val"] * 3


def test_a_child_with_a_report_of_its_own_stays_with_its_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's child that reported itself to another loader (a loader made inside a
    worker) is that loader's, whatever the parent's claim becomes."""
    _fresh_registry(monkeypatch, [("train", 9.0, None)])
    worker = ProcessKey(pid=600, start_ticks=_ticks(9.5))
    inner = ProcessKey(pid=601, start_ticks=_ticks(9.6))
    claims.claim(worker, None, "train")
    claims.claim(inner, worker, "train")
    claims.claim_worker(inner, "inner")
    claims.claim_worker(worker, "val")
    assert (claims.owner_of(worker), claims.owner_of(inner)) == ("val", "inner")
    claims.forget([worker, inner])
    assert claims._live == {}


def test_a_heir_seen_gone_leaves_no_entry_under_its_living_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A persistent worker that starts a helper per sample: its list must not grow."""
    _fresh_registry(monkeypatch, [("train", 9.0, None)])
    worker = ProcessKey(pid=700, start_ticks=_ticks(9.5))
    claims.claim(worker, None, "train")
    for index in range(3):
        helper = ProcessKey(pid=701 + index, start_ticks=_ticks(9.6 + index))
        claims.claim(helper, worker, "train")
        claims.forget([helper])
    assert list(claims._live) == [worker]


def test_a_report_read_after_its_worker_was_seen_gone_still_corrects_its_first_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fresh_registry(monkeypatch, [("train", 9.0, None), ("val", 10.483, None)])
    worker = ProcessKey(pid=800, start_ticks=_ticks(10.48))
    assert claims.claim(worker, None, "train") == "train"
    claims.forget([worker])
    claims.claim_worker(worker, "val")
    assert claims.taken_from("train") == {worker}
    assert claims.taken_from("train") == set() and claims.taken_from("val") == set()


def test_corrections_for_a_tracker_that_never_asks_again_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fresh_registry(monkeypatch, [("closed", 9.0, None)])
    for pid in range(1000, 1000 + 3 * claims._KEPT_GONE):
        worker = ProcessKey(pid=pid, start_ticks=_ticks(9.5))
        assert claims.claim(worker, None, "closed") == "closed"
        claims.claim_worker(worker, "other")
    assert len(claims._taken) == claims._KEPT_GONE
    latest = ProcessKey(pid=999 + 3 * claims._KEPT_GONE, start_ticks=_ticks(9.5))
    assert latest in claims.taken_from("closed") and not claims._taken


def test_a_late_report_moves_the_workers_child_seen_gone_with_it_and_claims_nothing_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fresh_registry(monkeypatch, [("train", 9.0, None), ("val", 10.483, None)])
    worker = ProcessKey(pid=800, start_ticks=_ticks(10.48))
    child = ProcessKey(pid=801, start_ticks=_ticks(10.6))
    assert claims.claim(worker, None, "train") == "train"
    assert claims.claim(child, worker, "train") == "train"  # rule 2: its worker's owner
    claims.forget([worker, child])
    claims.claim_worker(worker, "val")
    assert claims.taken_from("train") == {worker, child}
    assert not claims._live  # both gone: no claim made again
    assert claims.claim(child, worker, "train") == "val"


def test_a_worker_known_from_its_report_alone_leaves_no_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fresh_registry(monkeypatch, [("val", 9.0, None)])
    root = ProcessKey(os.getpid(), 10_000)
    val = ProcessTable(root, None, session="val", persistent_workers=False)
    worker = ProcessKey(_GONE_PID + 1, _ticks(9.5))
    assert val.register_worker(worker, False, now=10.0, born_epoch=0).own
    assert claims.owner_of(worker) is None  # seen gone: no live claim
    assert claims.claim(worker, None, "train") == "val"


# A PID above any pid_max: /proc never shows it, so the table sees it gone once unlisted.
_GONE_PID = 4_194_400


def _val_worker_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[ProcessKey, ProcInfo, ProcessTable, ProcessTable, EpochBook]:
    _fresh_registry(monkeypatch, [("train", 9.0, None), ("val", 10.483, None)])
    root = ProcessKey(os.getpid(), 10_000)
    worker = ProcessKey(_GONE_PID, _ticks(10.48))
    info = ProcInfo(worker, root.pid, "python", "python train.py")
    train = ProcessTable(root, None, session="train", persistent_workers=False)
    val = ProcessTable(root, None, session="val", persistent_workers=False)
    book = EpochBook(grace_s=1.0)
    book.begin("train epoch 2", 9.0)
    return worker, info, train, val, book


@pytest.mark.parametrize("train_sees_it_gone_first", [False, True])
def test_a_validation_worker_the_training_tracker_placed_first_is_not_in_its_epoch(
    monkeypatch: pytest.MonkeyPatch, train_sees_it_gone_first: bool
) -> None:
    """The flake of test_clean_fit_tracks_train_and_val_epochs_apart: a validation worker
    forked in the tick its epoch opened is claimed by the training tracker's walk before its
    report is read, and is gone before that tracker walks again. Whichever tracker sees it
    gone first, the report must take it out of the training epoch's record."""
    worker, info, train, val, book = _val_worker_tables(monkeypatch)
    train.apply_walk([info], now=10.5, quick=False, born_epoch=0)
    assert train.procs[worker].own  # rule 3: its start reads before val's opening
    book.note_sample(train, None)
    val.apply_walk([info], now=10.51, quick=False, born_epoch=0)
    if train_sees_it_gone_first:
        train.apply_walk([], now=10.6, quick=False, born_epoch=0)
        val.register_worker(worker, False, now=10.61, born_epoch=0)  # the report, read late
        val.apply_walk([], now=10.62, quick=False, born_epoch=0)
    else:
        val.register_worker(worker, False, now=10.6, born_epoch=0)
        val.apply_walk([], now=10.61, quick=False, born_epoch=0)
        train.apply_walk([], now=10.62, quick=False, born_epoch=0)
    book.end(train, now=11.0, reason="completed", error=None, devices=())

    (record,) = book.records(train)
    assert [p.key for p in record.processes] == [train.root]
    assert not train.procs[worker].own and val.procs[worker].own


def test_a_listing_taken_before_its_process_was_seen_gone_claims_it_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Train lists W; val reads W's report and sees it gone; train then places W from its
    listing: W stays val's (rule 3 would have said train's)."""
    _fresh_registry(monkeypatch, [("train", 9.0, None), ("val", 10.483, None)])
    worker = ProcessKey(pid=800, start_ticks=_ticks(10.48))
    claims.claim_worker(worker, "val")
    claims.forget([worker])
    assert claims.claim(worker, None, "train") == "val"
    assert claims.owner_of(worker) is None


def test_a_child_of_a_trackers_own_root_is_that_trackers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``Tracker(root_pid=S)`` beside a tracker of this process: the outer one placed S,
    and may place S's children first, in the tick the inner epoch opened."""
    _fresh_registry(monkeypatch, [("outer", 9.0, None), ("inner", 10.483, None)])
    me, other = ProcessKey(os.getpid(), 10_000), ProcessKey(4001, 10_100)
    claims.add_root(me, "outer")
    child = ProcessKey(pid=801, start_ticks=_ticks(10.48))
    root = ProcessKey(pid=800, start_ticks=_ticks(5.0))
    assert claims.claim(root, me, "outer") == "outer"
    claims.add_root(root, "inner")
    assert claims.claim(child, root, "outer") == "inner"
    # This process's own trackers share their root: rule 3 tells them apart.
    claims.add_root(me, "inner")
    sibling = ProcessKey(pid=802, start_ticks=_ticks(10.48))
    assert claims.claim(sibling, me, "inner") == "outer"
    assert claims.claim(ProcessKey(4002, 10_200), other, "inner") == "inner"


def test_a_tracker_of_a_child_process_judges_its_tree_beside_a_tracker_of_this_one() -> None:
    """Real processes: the helper a watched child starts is the inner tracker's survivor."""
    script = (
        "import subprocess, sys, time\n"
        "sys.stdin.readline()\n"
        "helper = subprocess.Popen(['sleep', '30'])\n"
        "print(helper.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    helper_pid = None
    try:
        with leakcheck.Tracker(use_nvml=False, grace=0.2) as outer, outer.epoch("outer"):
            outer.sample()  # the outer tracker places the child first
            with leakcheck.Tracker(root_pid=child.pid, use_nvml=False, grace=0.2) as inner:
                with inner.epoch("e0"):
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    helper_pid = int(child.stdout.readline())
                    outer.sample()  # and the helper too
                    inner.sample()
                with inner.epoch("e1"):
                    time.sleep(0.5)
        assert [(f.rule, f.pid) for f in inner.report().leaks] == [("survivor", helper_pid)]
        assert helper_pid not in {f.pid for f in outer.report().findings}
    finally:
        if helper_pid is not None:
            os.kill(helper_pid, 15)
        child.kill()
        child.wait()


def test_a_corrected_worker_seen_gone_by_its_owner_first_stays_out_of_the_other_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Train took the correction while the worker lived; val then saw it gone and dropped
    its claim: train's next walk must not take the missing claim for its own."""
    worker, info, train, val, book = _val_worker_tables(monkeypatch)
    train.apply_walk([info], now=10.5, quick=False, born_epoch=0)
    book.note_sample(train, None)
    val.apply_walk([info], now=10.51, quick=False, born_epoch=0)
    val.register_worker(worker, False, now=10.52, born_epoch=0)
    train.apply_walk([info], now=10.55, quick=False, born_epoch=0)  # takes the correction
    book.note_sample(train, None)
    val.apply_walk([], now=10.6, quick=False, born_epoch=0)  # val sees it gone first
    train.apply_walk([], now=10.62, quick=False, born_epoch=0)
    book.end(train, now=11.0, reason="completed", error=None, devices=())
    (record,) = book.records(train)
    assert [p.key for p in record.processes] == [train.root]


def test_a_correction_that_comes_after_the_epoch_ended_reaches_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, info, train, val, book = _val_worker_tables(monkeypatch)
    train.apply_walk([info], now=10.5, quick=False, born_epoch=0)
    book.note_sample(train, None)
    book.end(train, now=10.7, reason="completed", error=None, devices=())  # still train's
    val.register_worker(worker, False, now=10.8, born_epoch=None)  # the report, read late
    train.apply_walk([info], now=10.9, quick=False, born_epoch=None)
    (record,) = book.records(train)
    assert [p.key for p in record.processes] == [train.root]


def test_a_closed_trackers_root_leaves_the_rooted_rule_to_the_live_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An earlier ``Tracker(root_pid=S)``, closed, stays out of S's children: the live one
    rooted at S takes them, though this process's tracker places them first."""
    _fresh_registry(monkeypatch, [("outer", 9.0, None), ("inner", 10.483, None)])
    monkeypatch.setattr(claims, "_closed", {})
    root = ProcessKey(pid=800, start_ticks=_ticks(5.0))
    claims.add_root(root, "earlier")
    claims.session_closed("earlier")
    claims.add_root(root, "inner")
    child = ProcessKey(pid=801, start_ticks=_ticks(10.48))
    assert claims.claim(child, root, "outer") == "inner"


def test_a_helper_a_closed_tracker_claimed_does_not_take_a_later_trackers_process() -> None:
    """Real processes, one after the other in this process (as tests in one pytest worker):
    a helper born in the first tracker's epoch is that tracker's, and stays so after it
    closed; the child the helper starts in the second tracker's epoch is the second's, and
    its survivor (the parent's owner took it, and a closed tracker judges nothing)."""
    script = (
        "import subprocess, sys, time\n"
        "sys.stdin.readline()\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    helper: subprocess.Popen[str] | None = None
    child_pid = None
    try:
        with leakcheck.Tracker(use_nvml=False, grace=0.2) as first, first.epoch():
            helper = subprocess.Popen(
                [sys.executable, "-c", script],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            first.sample()  # the first tracker places (claims) the helper
        assert helper.stdin is not None and helper.stdout is not None
        with leakcheck.Tracker(use_nvml=False, grace=0.2) as second, second.epoch():
            helper.stdin.write("go\n")
            helper.stdin.flush()
            child_pid = int(helper.stdout.readline())
            second.sample()  # places the child while it lives
        assert [(f.rule, f.pid) for f in second.report().leaks] == [("survivor", child_pid)]
        assert [(f.rule, f.pid) for f in first.report().leaks] == [("survivor", helper.pid)]
    finally:
        if child_pid is not None:
            os.kill(child_pid, 15)
        if helper is not None:
            helper.kill()
            helper.wait()
