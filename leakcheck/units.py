"""Sizes and durations as people write them, parsed and printed in one place."""

from __future__ import annotations

import re

from leakcheck.errors import UsageError
from leakcheck.model import MIB

# Beyond this a wait would overflow the OS timers (threading.TIMEOUT_MAX is ~2**32 s).
_MAX_SECONDS = 1e9
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(value: str | int | float, *, source: str = "value") -> int:
    """Parse a size such as ``16MiB``, ``1GB``, ``0.5GiB`` or ``4096`` into bytes.

    Args:
        value: The text (or a number of bytes).
        source: Where the value came from, named in the error (``--gpu-leak-tolerance``).

    Returns:
        The size in bytes, rounded down.

    Raises:
        UsageError: The value is negative, not a number, or has an unknown unit.

    """
    if isinstance(value, bool):
        raise UsageError(f"{source}: expected a size such as 16MiB, 1GB or 4096, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise UsageError(f"{source}: expected a size of 0 or more, got {value!r}")
        return int(value)
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(
            f"{source}: expected a size such as 16MiB, 1GB or 4096 (bytes), got {value!r}"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_mib(num_bytes: int | float | None, *, signed: bool = False) -> str:
    """Format bytes as MiB with one decimal below 10 MiB; ``-`` for None."""
    if num_bytes is None:
        return "-"
    mib = num_bytes / MIB
    sign = "+" if signed and mib > 0 else ""
    if abs(mib) < 10 and mib != 0:
        return f"{sign}{mib:.1f}"
    return f"{sign}{mib:.0f}"


def parse_duration(value: str | int | float, *, source: str = "value") -> float:
    """Parse a duration in seconds (``2``, ``0.5``, ``2s``, ``500ms``) into seconds.

    Raises:
        UsageError: Negative, not a number, or an unknown unit.

    """
    if isinstance(value, bool):
        raise UsageError(f"{source}: expected seconds such as 2 or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        if not 0 <= value < _MAX_SECONDS:  # also rejects NaN and inf
            raise UsageError(
                f"{source}: expected a finite number of seconds from 0 such as 2, got {value!r}"
            )
        return float(value)
    text = value.strip().lower()
    scale = 1.0
    if text.endswith("ms"):
        text, scale = text[:-2], 0.001
    elif text.endswith("s"):
        text = text[:-1]
    try:
        seconds = float(text) * scale
    except ValueError:
        raise UsageError(f"{source}: expected seconds such as 2 or 500ms, got {value!r}") from None
    if not 0 <= seconds < _MAX_SECONDS:  # also rejects NaN and inf
        raise UsageError(
            f"{source}: expected a finite number of seconds from 0 such as 2 or 500ms, "
            f"got {value!r}"
        )
    return seconds


def shorten_cmdline(cmdline: str, width: int = 48, *, empty: str = "?") -> str:
    """Collapse whitespace and cut a command line to ``width`` characters for display.

    Args:
        cmdline: The command line.
        width: At most this many characters, ``...`` included.
        empty: What an empty command line shows as.

    """
    text = " ".join(cmdline.split())
    if not text:
        return empty
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."
