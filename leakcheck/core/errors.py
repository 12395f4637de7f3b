"""Exceptions and warnings raised by leakcheck."""

from __future__ import annotations

from typing import Any


class LeakCheckError(Exception):
    """Base of every error leakcheck raises on purpose (bad options, refused actions)."""


class UsageError(LeakCheckError, ValueError):
    """A bad option or argument; the message names the value and what was expected."""


class NVMLUnavailable(LeakCheckError):
    """NVML cannot be used here; the message is one line with a hint (no driver, no GPU)."""


class LeakError(LeakCheckError, AssertionError):
    """Leaks were found and the caller asked to fail on them; ``report`` holds the findings."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class LeakWarning(UserWarning):
    """Leaks were found and the caller asked to be warned."""


# The first releases' names: the same classes, so that `except GPULeakError` and
# `-W error::leakcheck.GPULeakWarning` keep catching every leak, GPU or not.
GPULeakError = LeakError
GPULeakWarning = LeakWarning


def one_line(error: BaseException) -> str:
    """An exception as one line: ``TypeName: message`` with its whitespace folded."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
