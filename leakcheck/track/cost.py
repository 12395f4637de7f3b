"""What tracking costs: the sampler's CPU, the caller's time inside the tracker, NVML's share.

The accounted cost of a tracker is the CPU time of its sampler thread plus the wall time the
calling threads spend inside its methods: the most it can take from a training loop through
the interpreter lock and the CPU. NVML's reads are counted apart (their wall and CPU time),
since while the GPU is busy they hold a driver lock that the job's own driver calls may wait
for: a cost the other figures cannot see (NOTE [nvml pacing] in pacing.py). So are the host
memory reads after epoch ends, the sampler's other costly read.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from leakcheck.core.model import TrackerCost

__all__ = ["CostMeter", "caller_timed"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class CostMeter:
    """Counters of a tracker's own cost; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = threading.local()
        self.sampler_thread: threading.Thread | None = None
        self._samples = 0
        self._sample_wall_s = 0.0
        self._sampler_cpu_s = 0.0
        self._caller_wall_s = 0.0
        self._nvml_wall_s = 0.0
        self._nvml_cpu_s = 0.0
        self._host_read_cpu_s = 0.0

    def sample_taken(self, wall_s: float) -> None:
        """One sample (any thread's) took ``wall_s``."""
        with self._lock:
            self._samples += 1
            self._sample_wall_s += wall_s

    def sampler_ran(self, cpu_s: float) -> None:
        """The sampler thread used ``cpu_s`` of CPU in one wake-up."""
        with self._lock:
            self._sampler_cpu_s += cpu_s

    def nvml_read(self, wall_s: float, cpu_s: float) -> None:
        """One NVML memory or list read took ``wall_s`` (``cpu_s`` of it on the CPU)."""
        with self._lock:
            self._nvml_wall_s += wall_s
            self._nvml_cpu_s += cpu_s

    def host_read(self, cpu_s: float) -> None:
        """The sampler thread used ``cpu_s`` of CPU reading host memory (also sampler time)."""
        with self._lock:
            self._host_read_cpu_s += cpu_s

    def enter_call(self) -> bool:
        """A public call begins; True when it is the outermost call of a caller's thread."""
        if getattr(self._calls, "depth", 0) or threading.current_thread() is self.sampler_thread:
            # Nested, or the sampler's own (a worker registered from the mailbox).
            return False
        self._calls.depth = 1
        return True

    def leave_call(self, wall_s: float) -> None:
        """The outermost call of this thread ended after ``wall_s``."""
        self._calls.depth = 0
        with self._lock:
            self._caller_wall_s += wall_s

    def snapshot(self) -> TrackerCost:
        """The counters now."""
        with self._lock:
            return TrackerCost(
                samples=self._samples,
                sample_wall_s=self._sample_wall_s,
                sampler_cpu_s=self._sampler_cpu_s,
                caller_wall_s=self._caller_wall_s,
                nvml_wall_s=self._nvml_wall_s,
                nvml_cpu_s=self._nvml_cpu_s,
                host_read_cpu_s=self._host_read_cpu_s,
            )


class _Metered(Protocol):
    @property
    def meter(self) -> CostMeter: ...


_M = TypeVar("_M", bound=_Metered)


def caller_timed(
    method: Callable[Concatenate[_M, _P], _R],
) -> Callable[Concatenate[_M, _P], _R]:
    """Add the wall time of a public call to its object's caller cost (outermost call only)."""

    @functools.wraps(method)
    def timed(owner: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        meter = owner.meter
        if not meter.enter_call():
            return method(owner, *args, **kwargs)
        started = time.perf_counter()
        try:
            return method(owner, *args, **kwargs)
        finally:
            meter.leave_call(time.perf_counter() - started)

    return timed
