"""Exceptions and warnings raised by leakcheck."""

from __future__ import annotations

from typing import Any


class LeakCheckError(Exception):
    """Base of every error leakcheck raises on purpose (bad options, refused actions)."""


class UsageError(LeakCheckError, ValueError):
    """A bad option or argument; the message names the value and what was expected."""


class NVMLUnavailable(LeakCheckError):
    """NVML (the NVIDIA driver's management library) cannot be used here.

    The message is one line with a hint: no driver, no GPU, or no ``nvidia-ml-py``.
    """


class LeakError(LeakCheckError, AssertionError):
    """Leaks were found and the caller asked to fail on them.

    Attributes:
        report: The ``leakcheck.Report`` that holds the findings (typed loosely: errors sit
            below the report in the layers).

    """

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class LeakWarning(UserWarning):
    """Leaks were found and the caller asked to be warned."""


# The names of the first releases, for GPU and process leaks alike: the same classes, so that
# `except GPULeakError`, `pytest.warns(GPULeakWarning)` and `-W error::leakcheck.GPULeakWarning`
# keep catching every leak, while what is raised says "leak", GPU or not.
GPULeakError = LeakError
GPULeakWarning = LeakWarning
