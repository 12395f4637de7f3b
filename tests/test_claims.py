"""Ownership among trackers: which epoch a process's create time falls in (NOTE [claims]).

The registry's epochs are set directly, in seconds since boot, and a process's create time is
given as /proc gives it: whole clock ticks, truncated.
"""

from __future__ import annotations

import pytest

from leakcheck import procs
from leakcheck.model import ProcessKey
from leakcheck.sampling import claims

Epochs = list[tuple[str, float, float | None]]


def _owner(monkeypatch: pytest.MonkeyPatch, epochs: Epochs, born_tick_s: float) -> str:
    monkeypatch.setattr(claims, "_epochs", list(epochs))
    monkeypatch.setattr(claims, "_owners", {})
    key = ProcessKey(pid=4242, create_time=procs.boot_time_s() + born_tick_s)
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
