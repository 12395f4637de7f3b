"""When the sampler reads what: a pure policy, told the times and CPU costs of reads made.

NOTE [nvml pacing]: while workers create contexts and compute, an NVML list read costs far
more CPU, in the driver, under a lock the workers' own calls wait for. So after a read that
used ``c`` seconds of the sampler's CPU (waiting costs the workers nothing), that kind of read
is left out for ``c / share`` seconds, at most ``max_gap_s``; memory reads get a quarter of
the share. Epoch ends, ``sample()``, the grace wait and ``close()`` are never paced, and
workers report their own peaks: pacing costs resolution, never a worker's peak.

NOTE [list gating]: every process's memory is part of its device's used bytes, so a tick that
finds them where they were at the last list read keeps the last attribution. Walking ticks
read the lists unless paced out (a failed read: again next tick); while the last full read
found no graphics context, ticks that do not walk leave the graphics list out.

NOTE [host pacing]: USS and PSS come from smaps_rollup, a page-table walk that costs with the
process's size (NOTE [rollup cost] in hostmem.py): read only for what the host-growth rule
judges (the parent, persistent workers), once per epoch end at most, on the sampler's next
wake, paced by ``rollup_share`` with no gap cap; the loop's own process on the loop's thread
before the end returns (what the loop does next is not the epoch's). The first three ends
after the warm-up always read (the parent where another live process of the job may share its
pages: alone, its USS only adds file pages to its RssAnon, read at every end), warm-up ends
none unless unpaced; an end without a read says RSS, never an older USS. Planned reads are
made before the next epoch begins. Forked workers with a birth report (NOTE [copy on read])
are read at their first epoch end whatever the pacing, and inside an epoch lasting
``reads.INSIDE_AFTER_S``, every ``reads.INSIDE_GAP_S``.

NOTE [idle ticks]: a tick that neither walks nor reads changes nothing, yet waking costs CPU:
the sampler sleeps through such ticks, up to the next walk or the first read due (what it
saves: benchmarks/results/mechanisms-cpu.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LIST_SHARE", "MAX_GAP_S", "MEMORY_SHARE", "WALK_EVERY", "Pacing"]

WALK_EVERY = 4  # ticks per walk of /proc (and read of the mailbox)
LIST_SHARE = 0.001  # of the time, for NVML's process lists in the driver (NOTE [nvml pacing])
MEMORY_SHARE = LIST_SHARE / 4
MAX_GAP_S = 1.0  # the longest any kind of NVML read is left out


@dataclass(frozen=True)
class TickPlan:
    """What one tick reads: walk /proc and the mailbox, device memory, whether lists may."""

    walk: bool
    read_memory: bool
    lists_paced_out: bool


class Pacing:
    """The sampler's schedule of reads; shares and gaps: the module's constants when made."""

    def __init__(self, interval_s: float, *, has_nvml: bool) -> None:
        self.interval_s = interval_s
        self.has_nvml = has_nvml
        self.walk_every = WALK_EVERY
        self.list_share, self.memory_share = LIST_SHARE, MEMORY_SHARE
        self.max_gap_s = MAX_GAP_S
        self.memory_due_s = self.lists_due_s = 0.0
        self.ticks_since_walk = 0
        self.device_used: dict[int, int] = {}  # per device at the last memory read
        self.used_at_lists: dict[int, int] = {}  # at the last list read (empty: it failed)
        self.graphics_seen = True

    def plan(self, now_s: float, ticks: int, *, walk_now: bool = False) -> TickPlan:
        """What the tick at ``now_s`` reads, ``ticks`` ticks after the last one."""
        self.ticks_since_walk += ticks
        return TickPlan(
            walk=walk_now or self.ticks_since_walk >= self.walk_every,
            read_memory=self.has_nvml and now_s >= self.memory_due_s,
            lists_paced_out=now_s < self.lists_due_s,
        )

    def lists_due(self, *, quick: bool) -> bool:
        """Whether a tick without a walk reads the process lists (NOTE [list gating])."""
        moved = not self.device_used or self.device_used != self.used_at_lists
        return self.has_nvml and (not quick or moved)

    def list_graphics(self, *, quick: bool) -> bool:
        """Whether a list read includes the graphics list (NOTE [list gating])."""
        return not quick or self.graphics_seen

    def walked(self) -> None:
        """A walk happened (any sample's): the next walking tick is ``walk_every`` away."""
        self.ticks_since_walk = 0

    def memory_read(self, end_s: float, cpu_s: float, used: Mapping[int, int] | None) -> None:
        """A memory read ended; ``used`` is None where it failed."""
        self.memory_due_s = end_s + min(cpu_s / self.memory_share, self.max_gap_s)
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
        """A list read ended (``graphics_seen`` None: the graphics list was left out)."""
        self.lists_due_s = end_s + min(cpu_s / self.list_share, self.max_gap_s)
        self.used_at_lists = dict(used_before) if ok else {}
        if ok and graphics_seen is not None:
            self.graphics_seen = graphics_seen

    def ticks_until_work(self, now_s: float) -> int:
        """Ticks from now to the next one with work (NOTE [idle ticks]); at least 1."""
        to_walk = max(1, self.walk_every - self.ticks_since_walk)
        if not self.has_nvml or to_walk == 1:
            return to_walk
        # Lists are due at the end of their gap where memory moved since they were read.
        due_s = self.memory_due_s
        if self.lists_due(quick=True):
            due_s = min(due_s, self.lists_due_s)
        return max(1, min(to_walk, math.ceil((due_s - now_s) / self.interval_s)))
