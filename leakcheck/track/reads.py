"""The sampler's reads of NVML and host memory, timed for ``Pacing``; its cost and failures."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

from leakcheck.core.errors import LeakCheckError
from leakcheck.core.model import (
    AccountedProcess,
    Attribution,
    DeviceState,
    GpuProcess,
    ProcessKey,
    TrackerCost,
)
from leakcheck.observe import hostmem, nvml
from leakcheck.observe.hostmem import HostMemory
from leakcheck.track.pacing import Pacing
from leakcheck.track.table import ProcessTable

__all__ = ["CostMeter", "Failures", "HostReads", "NvmlReads", "RollupPlan"]

_MAX_FAILURES = 50
_T = TypeVar("_T")


class CostMeter:
    """Counters of a tracker's own cost (``TrackerCost``'s fields); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = threading.local()
        self.sampler_thread: threading.Thread | None = None
        self._totals = dict.fromkeys((f.name for f in dataclasses.fields(TrackerCost)), 0.0)

    def add(self, **counts: float) -> None:
        """Add to the counters (``TrackerCost`` field names)."""
        with self._lock:
            for name, value in counts.items():
                self._totals[name] += value

    @contextlib.contextmanager
    def caller(self) -> Iterator[None]:
        """Time a public call, the outermost of a caller's thread, as the callers' cost."""
        if getattr(self._calls, "depth", 0) or threading.current_thread() is self.sampler_thread:
            yield  # nested, or the sampler's own (a worker registered from the mailbox)
            return
        self._calls.depth, started = 1, time.perf_counter()
        try:
            yield
        finally:
            self._calls.depth = 0
            self.add(caller_wall_s=time.perf_counter() - started)

    def snapshot(self) -> TrackerCost:
        """The counters now."""
        with self._lock:
            totals = dict(self._totals)
        return TrackerCost(samples=int(totals.pop("samples")), **totals)


class Failures:
    """leakcheck's own failures: counted per line, kept for the report, raised only if strict."""

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
        """Run one step of leakcheck's own; a failure is recorded (holding ``lock``), not raised."""
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
    """One tracker's NVML: whether it can attribute, and its timed reads."""

    def __init__(
        self, devices: list[int] | None, meter: CostMeter, failures: Failures, *, use_nvml: bool
    ) -> None:
        self.devices, self.use_nvml = devices, use_nvml
        self.meter, self.failures = meter, failures
        self.handle: nvml.Nvml | None = None
        self.attribution: Attribution = "nvml-unavailable"
        self.attribution_reason = "tracking has not started"
        self.accounting_devices: tuple[int, ...] = ()

    def open(self) -> None:
        """Start NVML, or record why GPU memory is not attributed."""
        if not self.use_nvml:
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
        enabled: list[int] = []
        for index in self.devices if self.devices is not None else range(handle.device_count()):
            with contextlib.suppress(LeakCheckError):
                if handle.accounting_enabled(index):
                    enabled.append(index)
        self.accounting_devices = tuple(enabled)

    def blind(self, reason: str) -> None:
        """NVML's PIDs turned out to be another namespace's: only device totals count."""
        if self.attribution == "ok":
            self.attribution, self.attribution_reason = "blind-namespace", reason

    def _timed(self, call: Callable[[], _T], what: str) -> tuple[_T | None, float, float]:
        started, cpu_started = time.perf_counter(), time.thread_time()
        result = self.failures.guard(call, what)
        end_s, cpu_s = time.perf_counter(), time.thread_time() - cpu_started
        self.meter.add(nvml_wall_s=end_s - started, nvml_cpu_s=cpu_s)
        return result, end_s, cpu_s

    def memory(self, pacing: Pacing) -> dict[int, int] | None:
        """Each device's used bytes (None: the read failed); tells ``pacing`` its cost."""
        handle = self.handle
        if handle is None:
            return None
        memory, end_s, cpu_s = self._timed(lambda: handle.memory(self.devices), "nvml memory")
        used = {state.index: state.used_bytes for state in memory} if memory is not None else None
        pacing.memory_read(end_s, cpu_s, used)
        return used

    def lists(self, pacing: Pacing, *, graphics: bool) -> tuple[GpuProcess, ...] | None:
        """NVML's per-PID lists (None: the read failed); tells ``pacing`` its cost."""
        handle = self.handle
        if handle is None:
            return None
        used_before = dict(pacing.device_used)
        result, end_s, cpu_s = self._timed(
            lambda: handle.processes(self.devices, graphics=graphics), "nvml processes"
        )
        ok = result is not None
        seen = any(e.kind != "compute" for e in result or ()) if ok and graphics else None
        pacing.lists_read(end_s, cpu_s, used_before=used_before, ok=ok, graphics_seen=seen)
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
        records: list[AccountedProcess] = []
        handle = self.handle
        if handle is None:
            return records
        for device in self.accounting_devices:
            try:
                records.extend(handle.accounting(device))
            except LeakCheckError as error:
                self.failures.record(f"nvml accounting: {error}", error)
        return records


_READING_WAIT_S = 2.0  # the longest a caller waits for reads under way on another thread
_HOST_RULE_FIRST_POINTS = 3  # the fewest USS points the host-growth rule judges from
# An epoch is read inside only once it lasted this long (a shorter one's workers are read at
# its end anyway), at most every INSIDE_GAP_S (NOTE [host pacing]).
INSIDE_AFTER_S = 10.0
INSIDE_GAP_S = 1.0
ROLLUP_SHARE = 0.001  # of the time, for smaps_rollup reads


@dataclass(frozen=True)
class RollupPlan:
    """A smaps_rollup read of workers: in an epoch (their copies so far), or at its end."""

    epoch_index: int
    keys: tuple[ProcessKey, ...]
    at_s: float = 0.0


class HostReads:
    """When one tracker reads host memory (NOTE [host pacing]), and what the reads cost.

    After reads of ``c`` seconds of CPU, the next are due ``c / rollup_share`` seconds on.
    """

    def __init__(
        self, failures: Failures, *, rollup_share: float | None = None, warmup_epochs: int = 1
    ) -> None:
        self.failures = failures
        self.share = ROLLUP_SHARE if rollup_share is None else rollup_share
        self.due_s = 0.0  # perf_counter time
        # Epoch ends read whatever the pacing says (the host rule's first points).
        self.always_read = range(warmup_epochs, warmup_epochs + _HOST_RULE_FIRST_POINTS)
        self.pending: RollupPlan | None = None
        # Held while planned reads are made (by the sampler thread, or a caller finishing
        # them). Re-entrant, and waited for at most _READING_WAIT_S: a close() run by the
        # garbage collector inside a read, or under the sampler's lock, must not hang.
        self._reading = threading.RLock()
        self.rollup_cpu_s = 0.0  # these three: for benchmarks/bench_hostmem.py
        self.rollup_reads = 0  # epoch ends (and final states) whose USS reads were made
        self.inside_reads = 0
        self._inside_last_s: float | None = None

    def due(self) -> bool:
        """Whether smaps_rollup reads may be made now (NOTE [host pacing])."""
        return time.perf_counter() >= self.due_s

    @staticmethod
    def long_lived(table: ProcessTable) -> list[ProcessKey]:
        """The live processes the host-growth rule judges: the parent, persistent workers."""
        return [
            key
            for key, proc in table.job_live().items()
            if table.role(proc) in ("parent", "worker") and table.persistent(proc)
        ]

    def plan(self, epoch_index: int, table: ProcessTable) -> bool:
        """Plan the epoch end's rollup reads as paced; True when planned (drops one unread)."""
        # A warm-up end's USS serves no rule unless unpaced; the parent alone: NOTE [host pacing].
        paced = self.due() and (epoch_index >= self.always_read.start or self.share >= 1.0)
        keys = self.long_lived(table) if paced or epoch_index in self.always_read else []
        if not paced and all(k == table.root or p.foreign for k, p in table.live.items()):
            keys = [key for key in keys if key != table.root]
        keys += [k for k in table.copy_watched() if not table.procs[k].end_read and k not in keys]
        for key in keys:
            table.procs[key].end_read = True
        self.pending = RollupPlan(epoch_index, tuple(keys)) if keys else None
        return bool(keys)

    def plan_inside(
        self, table: ProcessTable, epoch_index: int | None, started_s: float | None, now_s: float
    ) -> RollupPlan | None:
        """An in-epoch read of the forked workers, where one is due (NOTE [host pacing])."""
        if epoch_index is None or started_s is None or now_s - started_s < INSIDE_AFTER_S:
            return None
        if self._inside_last_s is not None and now_s - self._inside_last_s < INSIDE_GAP_S:
            return None
        keys = table.copy_watched()
        if not keys or not self.due():
            return None
        self._inside_last_s = now_s
        return RollupPlan(epoch_index, tuple(keys), now_s)

    def read_planned(
        self,
        lock: AbstractContextManager[object],
        give: Callable[[int, Mapping[ProcessKey, HostMemory]], object],
    ) -> None:
        """Make the planned reads, ``give`` under ``lock`` (a second caller waits for them)."""
        if not self._reading.acquire(timeout=_READING_WAIT_S):
            return
        try:
            with lock:
                plan, self.pending = self.pending, None
            if plan is not None:
                self.read(plan, lock, give)
        finally:
            self._reading.release()

    def take(self, key: ProcessKey) -> RollupPlan | None:
        """``key``'s planned read, taken out of the plan (the caller holds the lock)."""
        plan = self.pending
        if plan is None or key not in plan.keys:
            return None
        rest = tuple(k for k in plan.keys if k != key)
        self.pending = dataclasses.replace(plan, keys=rest) if rest else None
        return dataclasses.replace(plan, keys=(key,))

    def read(
        self,
        plan: RollupPlan,
        lock: AbstractContextManager[object],
        give: Callable[[int, Mapping[ProcessKey, HostMemory]], object],
    ) -> None:
        """Make ``plan``'s reads, ``give`` under ``lock`` (held by no caller)."""
        found = self.failures.guard(lambda: self.rollup(plan.keys), "host memory", lock=lock)
        if found:
            with lock:
                give(plan.epoch_index, found)

    def end_status(self, table: ProcessTable) -> dict[ProcessKey, HostMemory] | None:
        """RSS and its peak of the job's live processes (``/proc/PID/status``: cheap)."""
        keys = list(table.job_live())
        return self.failures.guard(
            lambda: hostmem.read_host_memories(keys, rollup=False), "host memory"
        )

    def final_reads(
        self, table: ProcessTable, *, closed: bool
    ) -> tuple[dict[ProcessKey, HostMemory], dict[ProcessKey, HostMemory]]:
        """Status and, when closing or the pacing allows, rollup reads for a final state."""
        status = self.end_status(table) or {}
        rollup: dict[ProcessKey, HostMemory] = {}
        if closed or self.due():
            keys = self.long_lived(table)
            keys += [key for key in table.copy_watched() if key not in keys]
            rollup = self.failures.guard(lambda: self.rollup(keys), "host memory") or {}
        return status, rollup

    def rollup(
        self, keys: Iterable[ProcessKey], *, count: bool = True
    ) -> dict[ProcessKey, HostMemory]:
        """USS and PSS of ``keys``, timed for the pacing; the caller holds no lock."""
        started_cpu_s = time.thread_time()
        found = hostmem.read_host_memories(keys)
        cpu_s = time.thread_time() - started_cpu_s
        if self.share < 1.0:  # a share of 1: every epoch end reads
            self.due_s = time.perf_counter() + cpu_s / self.share
        self.rollup_cpu_s += cpu_s
        self.rollup_reads += count
        return found
