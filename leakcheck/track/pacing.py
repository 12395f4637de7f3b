"""When the sampler reads what: NVML's memory and process lists, /proc, the mailbox.

A pure policy: it is told the times (``time.perf_counter()`` seconds) and CPU costs of the
reads that were made and answers what the next tick should read and how many ticks may be
slept through. No thread, no clock of its own: tests drive it with made-up times.

NOTE [nvml pacing]: the sampler's NVML reads are paced by what they cost. While the GPU is
idle a read takes microseconds of CPU; while workers create contexts and compute, a process
list read takes far more, inside the driver and under a lock that the workers' own driver
calls wait for. So each kind of read (device memory, process lists) is timed, and after a
read that used ``c`` seconds of the sampler's CPU that kind is left out of its ticks for the
next ``c / share`` seconds, never more than ``max_gap_s``: each kind works in the driver at
most about ``share`` of the time. CPU time, not wall time: a read that waits for the lock
while a worker holds it costs the workers nothing, and pacing by wall time would let such a
wait keep the next read away for whole epochs. Memory reads come on most ticks, so they
take a quarter of the share. Epoch ends, ``sample()``, the grace wait and ``close()`` are
never paced: what the rules judge is read when it is asked for, and every worker reports
its own peak at exit (NOTE [worker reports] in book.py), so pacing costs resolution between
reads, never a worker's peak.

NOTE [list gating]: every process's memory is part of its device's used bytes, so a tick that
finds every device's used bytes where they were at the last list read skips the lists and
keeps the last attribution. Walking ticks read the lists unless paced out; a failed list
read is retried at the next tick. What this can miss until the next walking tick: one
process freeing exactly what another allocates between two ticks. While the last full read
found no graphics context (a CUDA job has none), ticks that do not walk leave the graphics
list out.

NOTE [host pacing]: USS and PSS come from /proc/PID/smaps_rollup, whose read walks the page
tables of the process: it costs in proportion to the process's resident memory (NOTE
[rollup cost] in hostmem.py), a millisecond or more per torch worker. So they are read only
for the processes the host-growth rule judges (the parent and persistent workers), once per
epoch end at most, on the sampler's next wake rather than on the caller's thread (NOTE
[tracker lifecycle] in sampler.py), and paced like NVML's reads: after reads that used ``c``
seconds of the sampler's CPU, the epoch ends of the next ``c / rollup_share`` seconds read
none; a share of 1 (all of the time, a diagnostic run's) reads at every epoch end, however
short. There is no gap cap: a job of large processes, or of short epochs, is read less often
rather than over its budget, except the first epoch ends the host-growth rule judges (the
three after the warm-up epochs): those always read, so that the rule has USS, which shows
copy-on-read where resident memory does not, to judge from, however short the epochs.
The warm-up epochs' ends, which no rule judges, read none unless reads are unpaced. Epochs
without a read say RSS (the cheap status read of every process at every epoch end), never an
older USS as if read; ``close()`` reads once more whatever the pacing says. The reads an end
planned are made before the next epoch begins: by the sampler's thread, or, where it has
not come to them yet (epochs of milliseconds), by the caller's as it opens the next epoch,
so that they describe the end and none is dropped, those of the always-read ends included.
A wrapper that announces leaks after each epoch (``watch()``, the Lightning callback) makes
them before it judges, on its own thread: its warning then gives the figures the final
report gives.

The copy-on-read rule reads forked workers that reported their birth (NOTE [copy on read] in
hostmem.py) on the same budget, in two more ways: at the first epoch end each is alive at,
whatever the pacing says (one read per worker's life, so that the first epoch is judged
however short), and inside an epoch once it has lasted ``host.INSIDE_AFTER_S``, when the
pacing allows and at most every ``host.INSIDE_GAP_S`` (a share of 1 too), on the sampler's
thread with no lock held: a worker that copies early in an epoch of minutes is seen minutes
before its end. Epochs shorter than that (10 s) leave the share to their ends.

NOTE [idle ticks]: a tick that does not walk and whose NVML reads are all paced out reads
nothing and changes nothing, yet waking a thread costs CPU. So after each tick the sampler
sleeps through the ticks that would be empty: up to the next walking tick, and no further
than the first tick at which a memory or list read will be due. Every read still happens at
the first tick at which it is due.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LIST_SHARE",
    "MAX_GAP_S",
    "MEMORY_SHARE",
    "ROLLUP_SHARE",
    "WALK_EVERY",
    "Pacing",
    "TickPlan",
]

WALK_EVERY = 4
"""The sampler walks /proc (and reads the mailbox) on every fourth tick."""
LIST_SHARE = 0.001
"""Share of the time NVML's process lists may work in the driver (NOTE [nvml pacing]).

Small, since the truth about a worker's peak comes from the worker itself (NOTE [worker
reports] in book.py) and every epoch end reads in full: reads between epoch ends only add
resolution, and ``MAX_GAP_S`` keeps at least one a second."""
MEMORY_SHARE = LIST_SHARE / 4
"""Share of the time NVML's memory reads may work in the driver."""
MAX_GAP_S = 1.0
"""No kind of NVML read is left out for longer than this."""
ROLLUP_SHARE = 0.001
"""Share of the time the smaps_rollup reads (USS, PSS) may take (NOTE [host pacing])."""


@dataclass(frozen=True)
class TickPlan:
    """What one tick of the sampler reads.

    Attributes:
        walk: Walk the job's processes in /proc and read the mailbox.
        read_memory: Read each device's used memory.
        lists_paced_out: NVML's process lists may not be read on this tick.

    """

    walk: bool
    read_memory: bool
    lists_paced_out: bool


class Pacing:
    """The sampler's schedule of reads (NOTE [nvml pacing], [list gating], [idle ticks]).

    Args:
        interval_s: Seconds between ticks.
        has_nvml: NVML is read at all.
        walk_every: Walk on every this-many ticks (default ``WALK_EVERY``).
        list_share: Share of time for process-list reads (default ``LIST_SHARE``).
        memory_share: Share of time for memory reads (default ``MEMORY_SHARE``).
        max_gap_s: Longest a kind of NVML read is left out (default ``MAX_GAP_S``).
        rollup_share: Share of time for smaps_rollup reads (default ``ROLLUP_SHARE``).

    """

    def __init__(
        self,
        interval_s: float,
        *,
        has_nvml: bool,
        walk_every: int | None = None,
        list_share: float | None = None,
        memory_share: float | None = None,
        max_gap_s: float | None = None,
        rollup_share: float | None = None,
    ) -> None:
        # The module's constants are read here, not bound as defaults, so that a test can
        # set them for the trackers it starts.
        self.interval_s = interval_s
        self.has_nvml = has_nvml
        self.walk_every = WALK_EVERY if walk_every is None else walk_every
        self.list_share = LIST_SHARE if list_share is None else list_share
        self.memory_share = MEMORY_SHARE if memory_share is None else memory_share
        self.max_gap_s = MAX_GAP_S if max_gap_s is None else max_gap_s
        self.rollup_share = ROLLUP_SHARE if rollup_share is None else rollup_share
        self.memory_due_s = 0.0
        self.rollup_due_s = 0.0
        self.lists_due_s = 0.0
        self.ticks_since_walk = 0
        self.device_used: dict[int, int] = {}
        """Each device's used bytes at the last memory read."""
        self.used_at_lists: dict[int, int] = {}
        """Each device's used bytes when the lists were last read (empty after a failure)."""
        self.graphics_seen = True
        """The last full list read found a graphics context."""

    # -- the plan of a tick ------------------------------------------------------------

    def plan(self, now_s: float, ticks: int, *, walk_now: bool = False) -> TickPlan:
        """What the sampler's tick at ``now_s`` reads, ``ticks`` ticks after the last one.

        Args:
            now_s: The tick's time.
            ticks: Ticks since the last one (the sleep spanned this many).
            walk_now: Walk whatever the count says (a tag scan is due).

        """
        self.ticks_since_walk += ticks
        walk = walk_now or self.ticks_since_walk >= self.walk_every
        return TickPlan(
            walk=walk,
            read_memory=self.has_nvml and now_s >= self.memory_due_s,
            lists_paced_out=now_s < self.lists_due_s,
        )

    def lists_due(self, *, quick: bool) -> bool:
        """Whether a tick without a walk reads the process lists (NOTE [list gating])."""
        if not self.has_nvml:
            return False
        return not quick or not self.device_used or self.device_used != self.used_at_lists

    def list_graphics(self, *, quick: bool) -> bool:
        """Whether a list read includes the graphics list (NOTE [list gating])."""
        return not quick or self.graphics_seen

    # -- what was read -----------------------------------------------------------------

    def walked(self) -> None:
        """A walk happened (any sample's): the next walking tick is ``walk_every`` away."""
        self.ticks_since_walk = 0

    def memory_read(self, end_s: float, cpu_s: float, used: Mapping[int, int] | None) -> None:
        """A memory read ended at ``end_s`` after ``cpu_s`` of CPU; ``used``: None if it failed."""
        self.memory_due_s = end_s + self._gap_s(cpu_s, self.memory_share)
        self.device_used = dict(used) if used is not None else {}

    def lists_read(
        self,
        end_s: float,
        cpu_s: float,
        *,
        used_before: Mapping[int, int],
        ok: bool,
        graphics_seen: bool | None,
    ) -> None:
        """A process-list read ended.

        Args:
            end_s: When it ended.
            cpu_s: CPU seconds it used.
            used_before: Device memory as known just before it (a change in between shows).
            ok: It succeeded (after a failure nothing matches, so the next tick reads again).
            graphics_seen: Whether it found a graphics context; None when it left the
                graphics list out.

        """
        self.lists_due_s = end_s + self._gap_s(cpu_s, self.list_share)
        self.used_at_lists = dict(used_before) if ok else {}
        if ok and graphics_seen is not None:
            self.graphics_seen = graphics_seen

    @property
    def unpaced_rollups(self) -> bool:
        """A share of 1, all of the time: every epoch end reads USS (NOTE [host pacing])."""
        return self.rollup_share >= 1.0

    def rollup_due(self, now_s: float) -> bool:
        """Whether the epoch end at ``now_s`` reads USS and PSS (NOTE [host pacing])."""
        return now_s >= self.rollup_due_s

    def rollup_read(self, end_s: float, cpu_s: float) -> None:
        """smaps_rollup reads ended at ``end_s`` after ``cpu_s`` of CPU (no gap cap)."""
        if not self.unpaced_rollups:
            self.rollup_due_s = end_s + cpu_s / self.rollup_share

    def _gap_s(self, cpu_s: float, share: float) -> float:
        return min(cpu_s / share, self.max_gap_s)

    # -- sleeping ------------------------------------------------------------------------

    def ticks_until_work(self, now_s: float) -> int:
        """Ticks from now to the next one with work (NOTE [idle ticks]); at least 1."""
        to_walk = max(1, self.walk_every - self.ticks_since_walk)
        if not self.has_nvml or to_walk == 1:
            return to_walk
        # The lists are due at the end of their gap if memory has moved since they were read
        # (NOTE [list gating]), else after a memory read that finds so.
        due_s = self.memory_due_s
        if self.lists_due(quick=True):
            due_s = min(due_s, self.lists_due_s)
        ahead_s = due_s - now_s
        if ahead_s <= self.interval_s:
            return 1
        return min(to_walk, math.ceil(ahead_s / self.interval_s))
