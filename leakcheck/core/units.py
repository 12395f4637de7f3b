"""Sizes and durations as people write them, parsed and printed in one place."""

from __future__ import annotations

import math
import re

from leakcheck.core.errors import UsageError
from leakcheck.core.readings import MIB

# Below threading.TIMEOUT_MAX (~9.2e9 s; Event.wait() overflows past it); longer than any job.
MAX_SECONDS = 1e9
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1} | {
    prefix + suffix: base**power
    for power, prefix in enumerate("kmgt", start=1)
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}
_SIZE_EXAMPLE = "such as 16MiB, 1GB or 4096 (bytes)"


def parse_size(value: object, source: str = "value") -> int:
    """Parse a size such as ``16MiB``, ``1GB``, ``0.5GiB`` or ``4096`` into bytes.

    A count of bytes must be whole; with a unit the result is rounded down. Text is converted
    exactly, never through a float; ``source`` names the value in the error.

    Raises:
        UsageError: Not a size, negative, not finite, or a fractional number of bytes.

    """

    def refused(expected: str = f"a size {_SIZE_EXAMPLE}") -> UsageError:
        return UsageError(f"{source}: expected {expected}, got {value!r}")

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise refused()
    if isinstance(value, float) and not math.isfinite(value):
        raise refused(f"a finite size {_SIZE_EXAMPLE}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise refused("a size of 0 or more")
        if isinstance(value, float) and not value.is_integer():
            raise refused("a whole number of bytes such as 4096")
        return int(value)
    match = _SIZE_RE.match(value)
    scale = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or scale is None:
        raise refused()
    # Imported here: fractions (with decimal) would add milliseconds to every CLI start.
    from fractions import Fraction

    try:
        size = Fraction(match.group(1)) * scale
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        raise refused() from None
    if scale == 1 and size.denominator != 1:
        raise refused("a whole number of bytes such as 4096")
    return math.floor(size)


def _figure(value: float) -> str:
    """One decimal below 10 (of any unit), none above."""
    return f"{value:.1f}" if abs(value) < 10 and value != 0 else f"{value:.0f}"


def format_mib(num_bytes: int | float | None, *, signed: bool = False) -> str:
    """Format bytes as MiB with one decimal below 10 MiB; ``-`` for None."""
    if num_bytes is None:
        return "-"
    return ("+" if signed and num_bytes > 0 else "") + _figure(num_bytes / MIB)


def format_size(num_bytes: int) -> str:
    """Format a size in the largest unit that keeps it readable: ``16 MiB``, ``100 B``."""
    size = abs(num_bytes)
    if size >= 1024**3:
        return f"{num_bytes / 1024**3:.1f} GiB"
    if size >= MIB:
        return f"{_figure(num_bytes / MIB)} MiB"
    if size >= 1024:
        return f"{_figure(num_bytes / 1024)} KiB"
    return f"{num_bytes} B"


def plural(count: int, word: str, plural_word: str | None = None) -> str:
    """``1 worker``, ``2 workers`` (``plural_word`` where adding an s is wrong)."""
    return f"{count} {word if count == 1 else (plural_word or word + 's')}"


def parse_duration(value: object, source: str = "value", *, negative_ok: bool = False) -> float:
    """Parse a duration in seconds (``2``, ``0.5``, ``2s``, ``500ms``) into seconds.

    ``negative_ok``: for a caller whose own floor says what is expected.

    Raises:
        UsageError: Not a duration, negative, NaN, or not below ``MAX_SECONDS``.

    """

    def refused(expected: str = "seconds") -> UsageError:
        return UsageError(f"{source}: expected {expected} such as 2 or 500ms, got {value!r}")

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise refused()
    if isinstance(value, str):
        text = value.strip().lower()
        scale = 0.001 if text.endswith("ms") else 1.0
        try:
            seconds = float(text.removesuffix("ms" if scale < 1 else "s")) * scale
        except ValueError:
            raise refused() from None
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an int past the float range
            seconds = math.inf
    if math.isnan(seconds):
        raise refused("a number of seconds")
    if seconds < 0 and not negative_ok:
        raise refused("0 seconds or more")
    if seconds >= MAX_SECONDS:  # also infinity
        raise refused("a finite number of seconds below 1e9 (about 31 years)")
    return seconds
