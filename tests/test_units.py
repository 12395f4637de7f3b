"""Sizes and durations: whole bytes, exact units, and one-line errors for every bad value."""

from __future__ import annotations

import pytest

from leakcheck.core.errors import UsageError
from leakcheck.core.units import parse_duration, parse_size

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("16MiB", 16 * MIB),
        ("1GB", 10**9),
        ("4096", 4096),
        ("4096.0", 4096),
        ("0.5GiB", 512 * MIB),
        ("1.5kB", 1500),
        # A unit may leave a fraction of a byte: rounded down.
        ("0.0001KiB", 0),
        ("0.1GB", 10**8),  # exact: float arithmetic gives 100000000.00000001
        (4096, 4096),
        (2.0, 2),
        (0, 0),
    ],
)
def test_sizes(value: str | int | float, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        # A byte count is whole: 1.5 used to become 1 byte, silently.
        (1.5, "expected a whole number of bytes such as 4096, got 1.5"),
        ("1.5", "expected a whole number of bytes such as 4096, got '1.5'"),
        ("1.5 B", "expected a whole number of bytes such as 4096, got '1.5 B'"),
        # These raised TypeError, OverflowError and ValueError instead of a usage error.
        (None, "expected a size such as 16MiB, 1GB or 4096 (bytes), got None"),
        ([16], "expected a size such as 16MiB, 1GB or 4096 (bytes), got [16]"),
        (float("inf"), "expected a finite size such as 16MiB, 1GB or 4096 (bytes), got inf"),
        (float("nan"), "got nan"),
        (True, "got True"),
        (-1, "expected a size of 0 or more, got -1"),
        ("", "got ''"),
        # Past Python's 4300-digit limit int() raises ValueError: still a usage error.
        ("9" * 5000, "expected a size such as 16MiB"),
    ],
)
def test_bad_sizes_are_usage_errors(value: object, needle: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(value, source="tolerance")
    message = str(info.value)
    assert message.startswith("tolerance: ")
    assert needle in message
    assert "\n" not in message


def test_huge_text_size_is_exact_not_a_float_overflow() -> None:
    # float("9" * 400) is inf: the size was converted through a float and overflowed.
    assert parse_size("9" * 400) == int("9" * 400)
    assert parse_size("1" + "0" * 400 + "KiB") == 10**400 * 1024


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (None, "grace: expected seconds such as 2 or 500ms, got None"),
        ([2], "grace: expected seconds such as 2 or 500ms, got [2]"),
        # The bound is 1e9 seconds itself: the message used to say "a finite number".
        (1e9, "grace: expected a finite number of seconds below 1e9"),
        ("1e9", "grace: expected a finite number of seconds below 1e9"),
        ("inf", "grace: expected a finite number of seconds below 1e9"),
        (-3, "grace: expected 0 seconds or more such as 2 or 500ms, got -3"),
        ("nan", "grace: expected a number of seconds such as 2 or 500ms, got 'nan'"),
        ("", "grace: expected seconds such as 2 or 500ms, got ''"),
    ],
)
def test_bad_durations_are_usage_errors(value: object, needle: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_duration(value, source="grace")
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message


def test_duration_just_below_the_bound_is_accepted() -> None:
    assert parse_duration(999_999_999) == 999_999_999.0
    assert parse_duration("500ms") == 0.5
