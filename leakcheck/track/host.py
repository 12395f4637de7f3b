"""Host memory of the job's processes: what is read when, and what it cost.

At each epoch end the sampler reads ``/proc/PID/status`` of every process of the job (RSS,
its peak ``VmHWM``: counters the kernel keeps, cheap whatever the process's size) and plans a
``/proc/PID/smaps_rollup`` read (USS, PSS: a page-table walk, costly) of the processes the
host-growth rule judges, the parent and persistent workers, for the sampler's next wake, if
the pacing allows (NOTE [host pacing] in pacing.py). The rollup read is stamped with the epoch
it belongs to. Workers that live one epoch report their own figures as they exit (NOTE
[worker reports] in book.py).

A forked worker that reported its birth (NOTE [copy on read] in hostmem.py) is read at the
first epoch end it is alive at, whatever the pacing says, so that the copy-on-read rule can
judge the first epoch; and while an epoch lasts, paced reads of such workers
(``plan_inside``) show what they copy before it ends (NOTE [host pacing]).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

from leakcheck.core.model import ProcessKey, TeardownRecord
from leakcheck.observe import hostmem
from leakcheck.observe.hostmem import HostMemory
from leakcheck.track.pacing import Pacing
from leakcheck.track.reads import Failures
from leakcheck.track.table import ProcessTable

__all__ = ["HostReads", "InsidePlan", "RollupPlan", "reported_memory"]

_LONG_LIVED = ("parent", "worker")
_READING_WAIT_S = 2.0
"""The longest a caller waits for reads under way on another thread (see ``HostReads``)."""

_HOST_RULE_FIRST_POINTS = 3
"""The fewest USS points the host-growth rule judges from (``verdict.host_growth``)."""

INSIDE_AFTER_S = 10.0
"""An epoch is read inside only once it has lasted this long: a shorter one has its end read
soon (a forked worker's first end whatever the pacing), and leaves the share of time to the
ends' reads, which the host-growth rule judges; a fresh run of short epochs would otherwise
read its workers twice in its first epoch (NOTE [host pacing])."""
INSIDE_GAP_S = 1.0
"""In-epoch reads come at most this often, however large the share (a share of 1 reads
every epoch end, not every tick)."""


@dataclass(frozen=True)
class InsidePlan:
    """An in-epoch smaps_rollup read of forked workers (their copies so far)."""

    epoch_index: int
    keys: tuple[ProcessKey, ...]
    at_s: float


@dataclass(frozen=True)
class RollupPlan:
    """smaps_rollup reads planned at an epoch end, for the sampler's next wake."""

    epoch_index: int
    keys: tuple[ProcessKey, ...]


class HostReads:
    """When one tracker reads host memory, and what its rollup reads cost.

    Args:
        pacing: The sampler's pacing (its rollup share).
        failures: Where failed reads go.

    """

    def __init__(self, pacing: Pacing, failures: Failures, *, warmup_epochs: int = 1) -> None:
        self.pacing = pacing
        self.failures = failures
        self.always_read = range(warmup_epochs, warmup_epochs + _HOST_RULE_FIRST_POINTS)
        """Epoch ends read whatever the pacing says (NOTE [host pacing] in pacing.py)."""
        self.pending: RollupPlan | None = None
        # Held while planned reads are made (by the sampler thread, or a caller finishing
        # them). Re-entrant, and waited for at most _READING_WAIT_S: a close() run by the
        # garbage collector inside a read, or while the sampler's lock is held, must not
        # hang (the reads are then unknown, never wrong).
        self._reading = threading.RLock()
        self.rollup_cpu_s = 0.0
        """CPU seconds of every smaps_rollup read so far (part of the sampler's CPU)."""
        self.rollup_reads = 0
        """Epoch ends (and final states) whose long-lived processes' USS was read."""
        self.inside_reads = 0
        """In-epoch reads of forked workers (``plan_inside``)."""
        self._inside_last_s: float | None = None

    @staticmethod
    def own_keys(table: ProcessTable) -> list[ProcessKey]:
        """Live processes of the job (its own, not foreign), for the status read."""
        return [key for key, proc in table.live.items() if proc.own and not proc.foreign]

    @staticmethod
    def long_lived(table: ProcessTable) -> list[ProcessKey]:
        """The live processes the host-growth rule judges: the parent, persistent workers."""
        return [
            key
            for key, proc in table.live.items()
            if proc.own
            and not proc.foreign
            and table.role(proc) in _LONG_LIVED
            and table.persistent(proc)
        ]

    @staticmethod
    def status(keys: Iterable[ProcessKey]) -> dict[ProcessKey, HostMemory]:
        """RSS and its peak of each process now (``/proc/PID/status``: cheap)."""
        return hostmem.read_host_memories(keys, rollup=False)

    def plan(self, epoch_index: int, table: ProcessTable) -> bool:
        """Plan the epoch end's rollup reads if the pacing allows; True when planned.

        A plan still unread is replaced: read now, it would describe a later moment as
        that epoch's end.
        """
        self.pending = None
        # A warm-up end's USS serves no rule, only its table row: read where reads are not
        # paced (a diagnostic run's), else left to RSS, so that a short run or a tracker per
        # loop does not spend its first reads where nothing judges them.
        warm_up = epoch_index < self.always_read.start and not self.pacing.unpaced_rollups
        due = epoch_index in self.always_read or (
            not warm_up and self.pacing.rollup_due(time.perf_counter())
        )
        keys = self.long_lived(table) if due else []
        # A forked worker's first end serves the copy-on-read rule: read whatever the pacing.
        keys += [
            key
            for key in table.copy_watched()
            if not table.procs[key].end_read and key not in keys
        ]
        for key in keys:
            table.procs[key].end_read = True
        if keys:
            self.pending = RollupPlan(epoch_index, tuple(keys))
        return self.pending is not None

    def plan_inside(
        self, table: ProcessTable, epoch_index: int | None, started_s: float | None, now_s: float
    ) -> InsidePlan | None:
        """An in-epoch read of the forked workers, where one is due (NOTE [host pacing]).

        Args:
            table: The job's processes.
            epoch_index: The open epoch (None: none is open).
            started_s: When it opened, on the tracker's clock.
            now_s: Now, on the same clock.

        """
        if epoch_index is None or started_s is None or now_s - started_s < INSIDE_AFTER_S:
            return None
        if self._inside_last_s is not None and now_s - self._inside_last_s < INSIDE_GAP_S:
            return None
        if not self.pacing.rollup_due(time.perf_counter()):
            return None
        keys = table.copy_watched()
        if not keys:
            return None
        self._inside_last_s = now_s
        return InsidePlan(epoch_index, tuple(keys), now_s)

    def read_inside(self, plan: InsidePlan) -> dict[ProcessKey, HostMemory]:
        """Make an in-epoch read (no lock held: a page-table walk per worker)."""
        found = self.failures.guard(lambda: self.rollup(plan.keys, count=False), "host memory")
        self.inside_reads += 1
        return found or {}

    def read_planned(
        self,
        lock: AbstractContextManager[object],
        give: Callable[[int, Mapping[ProcessKey, HostMemory]], object],
    ) -> None:
        """Make the planned reads, if any, then ``give(epoch_index, found)``.

        ``lock`` (the sampler's) is held only to take the plan: the reads take a millisecond
        or more per process. One caller at a time: a second waits for the first's reads to
        end, so that once it returns, nothing planned is left unread.
        """
        if not self._reading.acquire(timeout=_READING_WAIT_S):
            return
        try:
            with lock:
                plan, self.pending = self.pending, None
            if plan is None:
                return
            found = self.failures.guard(lambda: self.rollup(plan.keys), "host memory", lock=lock)
            if found:
                give(plan.epoch_index, found)
        finally:
            self._reading.release()

    def end_status(self, table: ProcessTable) -> dict[ProcessKey, HostMemory] | None:
        """The status read of the job's live processes at an epoch end."""
        return self.failures.guard(lambda: self.status(self.own_keys(table)), "host memory")

    def final_reads(
        self, table: ProcessTable, *, closed: bool
    ) -> tuple[dict[ProcessKey, HostMemory], dict[ProcessKey, HostMemory]]:
        """Status and, when closing or the pacing allows, rollup reads for a final state."""
        status = self.end_status(table) or {}
        rollup: dict[ProcessKey, HostMemory] = {}
        if closed or self.pacing.rollup_due(time.perf_counter()):
            keys = self.long_lived(table)
            keys += [key for key in table.copy_watched() if key not in keys]
            rollup = self.failures.guard(lambda: self.rollup(keys), "host memory") or {}
        return status, rollup

    def rollup(
        self, keys: Iterable[ProcessKey], *, count: bool = True
    ) -> dict[ProcessKey, HostMemory]:
        """Read USS and PSS (smaps_rollup) of ``keys``, timed for the pacing.

        The caller holds no lock: the reads take a millisecond or more per process, during
        which the kernel walks page tables with the interpreter lock released. ``count``:
        an epoch end's (or final state's) reads, counted in ``rollup_reads``.
        """
        started_cpu_s = time.thread_time()
        found = hostmem.read_host_memories(keys)
        cpu_s = time.thread_time() - started_cpu_s
        self.pacing.rollup_read(time.perf_counter(), cpu_s)
        self.rollup_cpu_s += cpu_s
        if count:
            self.rollup_reads += 1
        return found


def reported_memory(record: TeardownRecord) -> HostMemory | None:
    """A worker's own report of its host memory at exit, as ``HostMemory``; None: none."""
    if record.host_rss_bytes is None and record.host_uss_bytes is None:
        return None
    return HostMemory(
        uss_bytes=record.host_uss_bytes,
        pss_bytes=record.host_pss_bytes,
        rss_bytes=record.host_rss_bytes,
        swap_bytes=None,
        source="smaps_rollup" if record.host_uss_bytes is not None else "status",
        rss_peak_bytes=record.host_rss_peak_bytes,
        shared_dirty_bytes=record.host_shared_dirty_bytes,
        private_dirty_bytes=record.host_private_dirty_bytes,
    )
