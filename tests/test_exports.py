"""Trackers' exported variables as layers (leakcheck/track/exports.py)."""

from __future__ import annotations

import os

import pytest

from leakcheck.track import exports

NAME = "LEAKCHECK_TEST_EXPORTS"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    monkeypatch.setattr(exports, "_layers", {})


@pytest.mark.parametrize("order", ["made", "reverse"])
def test_layers_withdrawn_in_either_order_leave_the_value_from_before(order: str) -> None:
    os.environ[NAME] = "before"
    first = exports.export({NAME: "first"})
    second = exports.export({NAME: "second"})
    tokens = [first, second] if order == "made" else [second, first]
    exports.withdraw(tokens[0])
    assert os.environ[NAME] == ("second" if order == "made" else "first")
    exports.withdraw(tokens[1])
    assert os.environ[NAME] == "before"


def test_a_value_set_from_outside_between_layers_comes_back_not_the_stale_layer() -> None:
    """The pytest plugin sets each test's tag itself: a tracker of a module fixture (older
    layer), then the next test's tag, then a tracker inside that test."""
    fixture = exports.export({NAME: "fixture-tracker"})
    os.environ[NAME] = "test-2"
    inner = exports.export({NAME: "test-tracker"})
    exports.withdraw(inner)
    assert os.environ[NAME] == "test-2"
    exports.withdraw(fixture)
    assert os.environ[NAME] == "test-2"


def test_a_variable_unset_from_outside_stays_unset() -> None:
    token = exports.export({NAME: "tracker"})
    del os.environ[NAME]
    exports.withdraw(token)
    assert NAME not in os.environ


def test_exports_since_a_mark_are_listed() -> None:
    exports.export({NAME: "old"})
    mark = exports.mark()
    exports.export({NAME: "new"})
    assert exports.exported_since(mark, NAME) == ["new"]
