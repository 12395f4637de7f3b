"""The sampler's pacing policy, driven with made-up times: no thread, no clock, no NVML."""

from __future__ import annotations

import time

import pytest

from leakcheck.core.model import MIB
from leakcheck.observe import hostmem
from leakcheck.track import reads
from leakcheck.track.pacing import Pacing

_TICK_S = 0.01


def _pacing(**knobs: float) -> Pacing:
    pacing = Pacing(_TICK_S, has_nvml=True)
    for name, value in knobs.items():
        setattr(pacing, name, value)
    return pacing


@pytest.mark.parametrize(
    ("since_walk", "memory_s", "lists_s", "memory_moved", "ticks"),
    [
        # Lists paced out for 0.5 s: the next memory read, in 25 ms.
        (0, 0.025, 0.5, False, 3),
        # The next walk comes first.
        (2, 0.025, 0.5, False, 2),
        (3, 0.025, 0.5, False, 1),
        # Lists due again, but memory has not moved since they were read: the memory read.
        (0, 0.025, -0.1, False, 3),
        # Memory moved since the lists were read: they are due at once...
        (0, 0.025, -0.1, True, 1),
        # ... or when their gap ends (25 ms), before the next memory read.
        (0, 0.2, 0.025, True, 3),
        # A memory read already due.
        (0, -0.002, 0.5, False, 1),
        # Nothing due before the next walk.
        (0, 0.2, 0.5, False, 4),
    ],
)
def test_the_sampler_sleeps_through_ticks_up_to_the_next_due_read_or_walk(
    since_walk: int, memory_s: float, lists_s: float, memory_moved: bool, ticks: int
) -> None:
    """NOTE [idle ticks], at 10 ms ticks; times are from ``now``."""
    now = 100.0
    pacing = _pacing()
    pacing.ticks_since_walk = since_walk
    pacing.memory_due_s = now + memory_s
    pacing.lists_due_s = now + lists_s
    pacing.device_used = {0: 2 * MIB if memory_moved else MIB}
    pacing.used_at_lists = {0: MIB}
    assert pacing.ticks_until_work(now) == ticks


def test_without_nvml_only_walking_ticks_are_taken() -> None:
    pacing = Pacing(_TICK_S, has_nvml=False)
    taken = []
    now, ticks = 0.0, 1
    for _ in range(5):
        now += ticks * _TICK_S
        plan = pacing.plan(now, ticks)
        assert not plan.read_memory
        if plan.walk:
            pacing.walked()
        taken.append(plan.walk)
        ticks = pacing.ticks_until_work(now)
    assert taken == [False, True, True, True, True]  # after the first, each wake walks
    assert not pacing.lists_due(quick=True)


def test_a_read_keeps_its_kind_away_for_its_cpu_time_over_the_share() -> None:
    """NOTE [nvml pacing]: memory reads take a quarter of the lists' share."""
    pacing = _pacing(list_share=0.1, memory_share=0.025, max_gap_s=10.0)
    pacing.memory_read(end_s=1.0, cpu_s=0.004, used={0: MIB})
    assert pacing.memory_due_s == pytest.approx(1.0 + 0.004 / 0.025)  # 160 ms
    assert not pacing.plan(1.1, 1).read_memory
    assert pacing.plan(1.17, 1).read_memory
    pacing.lists_read(1.0, 0.004, used_before={0: MIB}, ok=True, graphics_seen=False)
    assert pacing.lists_due_s == pytest.approx(1.04)
    assert pacing.plan(1.03, 1).lists_paced_out
    assert not pacing.plan(1.05, 1).lists_paced_out


def test_a_costly_read_is_left_out_no_longer_than_the_longest_gap() -> None:
    pacing = _pacing(max_gap_s=1.0)
    pacing.lists_read(5.0, 3.0, used_before={}, ok=True, graphics_seen=None)
    assert pacing.lists_due_s == pytest.approx(6.0)


def test_free_reads_come_on_every_tick() -> None:
    pacing = _pacing()
    now = 0.0
    for _ in range(20):
        now += _TICK_S
        assert pacing.plan(now, 1).read_memory
        pacing.memory_read(now, 0.0, {0: MIB})


def test_lists_are_gated_by_device_memory_and_retried_after_a_failure() -> None:
    """NOTE [list gating]."""
    pacing = _pacing()
    assert pacing.lists_due(quick=True)  # nothing read yet
    pacing.memory_read(0.0, 0.0, {0: MIB})
    pacing.lists_read(0.0, 0.0, used_before={0: MIB}, ok=True, graphics_seen=False)
    assert not pacing.lists_due(quick=True)  # memory where it was at the list read
    assert pacing.lists_due(quick=False)  # unpaced samples always read them
    pacing.memory_read(0.1, 0.0, {0: 2 * MIB})
    assert pacing.lists_due(quick=True)
    pacing.lists_read(0.1, 0.0, used_before={0: 2 * MIB}, ok=False, graphics_seen=None)
    assert pacing.lists_due(quick=True)  # a failed read matches nothing: read again


def test_quick_list_reads_leave_the_graphics_list_out_until_one_is_seen() -> None:
    pacing = _pacing()
    assert pacing.list_graphics(quick=True)  # not known yet: read it
    pacing.lists_read(0.0, 0.0, used_before={}, ok=True, graphics_seen=False)
    assert not pacing.list_graphics(quick=True)
    assert pacing.list_graphics(quick=False)
    pacing.lists_read(0.0, 0.0, used_before={}, ok=True, graphics_seen=None)  # left out
    assert not pacing.list_graphics(quick=True)
    pacing.lists_read(0.0, 0.0, used_before={}, ok=True, graphics_seen=True)
    assert pacing.list_graphics(quick=True)


def test_a_due_tag_scan_walks_at_once() -> None:
    pacing = _pacing()
    assert not pacing.plan(0.0, 1).walk
    assert pacing.plan(0.0, 1, walk_now=True).walk


class _HostClock:
    """``HostReads`` on made-up times: each rollup read ends at ``end_s`` after ``cpu_s``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now_s = self.cpu_s = self.read_cpu_s = 0.0
        monkeypatch.setattr(time, "perf_counter", lambda: self.now_s)
        monkeypatch.setattr(time, "thread_time", lambda: self.cpu_s)
        monkeypatch.setattr(hostmem, "read_host_memories", self._read)

    def _read(self, keys: object) -> dict[object, object]:
        self.cpu_s += self.read_cpu_s
        return {}

    def read(self, host: reads.HostReads, *, end_s: float, cpu_s: float) -> None:
        self.now_s, self.read_cpu_s = end_s, cpu_s
        host.rollup([])

    def due(self, host: reads.HostReads, at_s: float) -> bool:
        self.now_s = at_s
        return host.due()


def test_rollup_reads_are_paced_by_their_cpu_time_with_no_gap_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _HostClock(monkeypatch)
    host = reads.HostReads(reads.Failures(strict=False), rollup_share=0.0025)
    assert clock.due(host, 0.0)  # the first epoch end reads
    clock.read(host, end_s=1.0, cpu_s=0.01)  # 10 ms of CPU: the next 4 s read nothing
    assert not clock.due(host, 1.0 + 3.9)
    assert clock.due(host, 1.0 + 4.0)
    clock.read(host, end_s=10.0, cpu_s=0.1)  # 40 s: more than any NVML gap, on purpose
    assert not clock.due(host, 10.0 + 39.0)
    assert clock.due(host, 10.0 + 40.0)
    assert reads.HostReads(reads.Failures(strict=False)).share == 0.001  # the default share


def test_a_rollup_share_of_one_reads_at_every_epoch_end_however_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The remedy for paced-out reads (``rollup_share=1.0``) must read at every end."""
    clock = _HostClock(monkeypatch)
    host = reads.HostReads(reads.Failures(strict=False), rollup_share=1.0)
    clock.read(host, end_s=1.0, cpu_s=0.03)  # 30 ms of reads, epochs of 20 ms
    assert clock.due(host, 1.02)
