"""The sampler's NVML reads, each timed for its pacing and its cost, and its own failures.

``NvmlReads`` opens NVML once per tracker (or says why attribution is off), reads device
memory, the per-PID lists, telemetry and, where an administrator switched it on, the
driver's accounting; every read is timed in CPU and wall time for ``Pacing`` (NOTE [nvml
pacing] in pacing.py) and ``CostMeter``. ``Failures`` keeps leakcheck's own failures:
recorded, never raised into the user's loop, unless ``strict``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from leakcheck.core.errors import LeakCheckError
from leakcheck.core.model import AccountedProcess, Attribution, DeviceState, GpuProcess
from leakcheck.observe import nvml
from leakcheck.track.cost import CostMeter
from leakcheck.track.pacing import Pacing

__all__ = ["Failures", "NvmlReads"]

_MAX_FAILURES = 50
_T = TypeVar("_T")


class Failures:
    """leakcheck's own failures: counted per line, kept for the report, raised if strict."""

    def __init__(self, *, strict: bool) -> None:
        self.strict = strict
        self.counts: dict[str, int] = {}
        self.pending: BaseException | None = None

    def guard(
        self,
        call: Callable[[], _T],
        what: str,
        *,
        lock: AbstractContextManager[object] | None = None,
    ) -> _T | None:
        """Run one step of leakcheck's own; record (or, strict, keep to raise) a failure.

        ``lock``: held while recording only, for a step run outside the lock that reports
        read the failures under.
        """
        try:
            return call()
        except Exception as error:
            with lock or contextlib.nullcontext():
                self.record(f"{what}: {type(error).__name__}: {error}", error)
            return None

    def record(self, message: str, error: BaseException | None = None) -> None:
        """Count one failure under its first line (at most ``_MAX_FAILURES`` lines)."""
        line = message.splitlines()[0] if message else "unknown failure"
        if line in self.counts:
            self.counts[line] += 1
        elif len(self.counts) < _MAX_FAILURES:
            self.counts[line] = 1
        if self.strict and self.pending is None:
            self.pending = error or LeakCheckError(line)

    def lines(self) -> tuple[str, ...]:
        """Each failure once, with how often it happened."""
        return tuple(m if n == 1 else f"{m} (x{n})" for m, n in self.counts.items())

    def raise_pending(self) -> None:
        """In strict mode, raise the first failure not raised yet."""
        if self.pending is not None:
            error, self.pending = self.pending, None
            if isinstance(error, LeakCheckError):
                raise error
            raise LeakCheckError(f"leakcheck failed (strict mode): {error}") from error


class NvmlReads:
    """One tracker's NVML: whether it can attribute, and its timed reads.

    Args:
        devices: NVML device indices to read (None: all).
        meter: Where the reads' cost goes.
        failures: Where failed reads go.

    """

    def __init__(self, *, devices: list[int] | None, meter: CostMeter, failures: Failures) -> None:
        self.devices = devices
        self.meter = meter
        self.failures = failures
        self.handle: nvml.Nvml | None = None
        self.attribution: Attribution = "nvml-unavailable"
        self.attribution_reason = "tracking has not started"
        self.accounting_devices: tuple[int, ...] = ()

    def open(self, *, use_nvml: bool) -> None:
        """Start NVML, or record why GPU memory is not attributed."""
        if not use_nvml:
            self.attribution_reason = "NVML reading is off (use_nvml=False): host-side checks only"
            return
        available, reason = nvml.availability()
        if not available:
            self.attribution_reason = reason
            return
        handle = self.failures.guard(nvml.get, "nvml")
        if handle is None:
            self.attribution_reason = next(reversed(self.failures.counts), "NVML failed to start")
            return
        if not (self.failures.guard(handle.device_count, "nvml") or 0):
            self.attribution = "no-gpu"
            self.attribution_reason = "NVML sees no NVIDIA GPU: host-side checks only"
            return
        self.handle = handle
        self.attribution, self.attribution_reason = "ok", ""
        # Accounting is read where an administrator switched it on; never switched on here.
        indices = self.devices if self.devices is not None else handle.device_indices()
        enabled: list[int] = []
        for index in indices:
            with contextlib.suppress(LeakCheckError):
                if handle.accounting_enabled(index):
                    enabled.append(index)
        self.accounting_devices = tuple(enabled)

    def blind(self, reason: str) -> None:
        """NVML's PIDs turned out to be another namespace's: only device totals count."""
        if self.attribution == "ok":
            self.attribution, self.attribution_reason = "blind-namespace", reason

    def memory(self, pacing: Pacing) -> dict[int, int] | None:
        """Each device's used bytes (None: the read failed); tells ``pacing`` its cost."""
        handle = self.handle
        if handle is None:
            return None
        started, cpu_started = time.perf_counter(), time.thread_time()
        memory = self.failures.guard(lambda: handle.memory(self.devices), "nvml memory")
        end_s, cpu_s = time.perf_counter(), time.thread_time() - cpu_started
        self.meter.nvml_read(end_s - started, cpu_s)
        used = {state.index: state.used_bytes for state in memory} if memory is not None else None
        pacing.memory_read(end_s, cpu_s, used)
        return used

    def lists(self, pacing: Pacing, *, graphics: bool) -> tuple[GpuProcess, ...] | None:
        """NVML's per-PID lists (None: the read failed); tells ``pacing`` its cost."""
        handle = self.handle
        if handle is None:
            return None
        used_before = dict(pacing.device_used)
        started, cpu_started = time.perf_counter(), time.thread_time()
        result = self.failures.guard(
            lambda: handle.processes(self.devices, graphics=graphics), "nvml processes"
        )
        end_s, cpu_s = time.perf_counter(), time.thread_time() - cpu_started
        self.meter.nvml_read(end_s - started, cpu_s)
        graphics_seen = None
        if result is not None and graphics:
            graphics_seen = any(entry.kind != "compute" for entry in result)
        pacing.lists_read(
            end_s,
            cpu_s,
            used_before=used_before,
            ok=result is not None,
            graphics_seen=graphics_seen,
        )
        return result

    def device_states(self) -> tuple[DeviceState, ...]:
        """Memory and telemetry of the watched devices (epoch ends, baseline, final state)."""
        handle = self.handle
        if handle is None:
            return ()
        states = self.failures.guard(lambda: handle.devices(self.devices), "nvml devices")
        return tuple(states) if states else ()

    def accounting(self) -> list[AccountedProcess]:
        """The driver's records of the devices whose accounting mode is on."""
        handle = self.handle
        records: list[AccountedProcess] = []
        if handle is None:
            return records
        for device in self.accounting_devices:
            try:
                records.extend(handle.accounting(device))
            except LeakCheckError as error:
                self.failures.record(f"nvml accounting: {error}", error)
        return records
