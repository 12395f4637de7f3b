"""The epoch book of one tracker: epochs, and one row per process seen in each.

NOTE [worker reports]: sampling misses what lives shorter than the gap between two NVML reads.
So each worker, as it exits, posts its own NVML bytes, torch's peak reserved bytes and its host
memory to the mailbox (NOTE [teardown policy] in teardown.py), on the monotonic clock. That
report goes to the epoch open then (or ended at most ``grace_s`` before); a peak is the larger
of what was sampled and reported (NVML's accounting maxima of exited PIDs count the same way).
One that exited unseen and reported nothing has an ``unknown`` peak, never 0. One alive at the
end was read then (status, and smaps_rollup where paced in); one gone shows what it reported.
A forked worker's copies (NOTE [copy on read] in hostmem.py) are measured against its birth
report by every smaps_rollup reading; each epoch keeps the most and when one first passed the
copy tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from leakcheck.core.model import (
    MIB,
    AccountedProcess,
    DeviceState,
    EndReason,
    EpochRecord,
    PeakSource,
    ProcessEpoch,
    ProcessKey,
    Role,
    TeardownRecord,
)
from leakcheck.observe.hostmem import HostMemory, copied_bytes
from leakcheck.track.table import Proc, ProcessTable

__all__ = ["EpochBook"]


def _host_fields(
    end: HostMemory | None, rollup: HostMemory | None, report: HostMemory | None, *, alive: bool
) -> dict[str, Any]:
    """Host fields: USS, else RSS; alive at the end, the end's reads before the exit report."""
    reads = [m for m in ((end, rollup, report) if alive else (report,)) if m is not None]
    uss = next((m.uss_bytes for m in reads if m.uss_bytes is not None), None)
    rss = next((m.rss_bytes for m in reads if m.rss_bytes is not None), None)
    peaks = [m.rss_peak_bytes for m in (end, rollup, report) if m and m.rss_peak_bytes]
    return {
        "host_bytes_end": uss if uss is not None else rss,
        "host_source": "uss" if uss is not None else ("rss" if rss is not None else None),
        "pss_bytes_end": next((m.pss_bytes for m in reads if m.pss_bytes is not None), None),
        "rss_bytes_end": rss,
        "anon_bytes_end": next((m.anon_bytes for m in reads if m.anon_bytes is not None), None),
        "rss_bytes_peak": max([*peaks, rss] if rss is not None else peaks, default=None),
    }


def _held(proc: Proc, role: Role) -> dict[str, Any]:
    """The ``ProcessEpoch`` fields of where ``proc`` stands now and, if alive, what it holds."""
    alive = proc.exited_s is None
    return {
        "role": role,
        "ppid": proc.ppid,
        "alive_at_end": alive,
        "gpu_bytes_end": dict(proc.gpu_bytes) if alive else {},
        "gpu_bytes_unknown": alive and proc.gpu_unknown,
        "nvidia_fds": proc.nvidia_fds if alive else None,
        "open_fds": proc.open_fds if alive else None,
        "fd_limit": proc.fd_limit if alive else None,
    }


@dataclass
class _Copy:
    """What the readings of one forked worker showed it copied (NOTE [copy on read])."""

    peak_bytes: int = 0
    over_s: float | None = None  # when a reading first passed the copy tolerance
    last: tuple[int, int | None] | None = None  # (copied, Shared_Dirty) of the latest

    def fold(self, proc: Proc, memory: HostMemory | None, at_s: float, tolerance: int) -> None:
        if memory is None or proc.birth_host is None or proc.forked is not True:
            return
        copied = copied_bytes(proc.birth_host, memory)
        if copied is None:
            return
        self.last = (copied, memory.shared_dirty_bytes)
        self.peak_bytes = max(self.peak_bytes, copied)
        if copied > tolerance and (self.over_s is None or at_s < self.over_s):
            self.over_s = at_s

    def fields(self, proc: Proc, start_s: float) -> dict[str, Any]:
        """The copy fields of a ``ProcessEpoch`` that started at ``start_s``."""
        birth, last, over_s = proc.birth_host, self.last, self.over_s
        return {
            "forked": proc.forked,
            "private_bytes_birth": birth.uss_bytes if birth is not None else None,
            "shared_bytes_birth": birth.shared_dirty_bytes if birth is not None else None,
            "copied_bytes_end": last[0] if last is not None else None,
            "shared_bytes_end": last[1] if last is not None else None,
            "copied_bytes_peak": self.peak_bytes if last is not None else None,
            "copied_over_after_s": max(0.0, over_s - start_s) if over_s is not None else None,
        }


@dataclass
class _Row:
    """One process in one epoch: in the epoch's rows once seen in it."""

    peak: dict[int, int] = field(default_factory=dict)
    listed: bool = False  # NVML listed it at some read
    reported: bool = False  # the peak includes its own report
    held: dict[str, Any] | None = None  # its _held() at the end
    status: HostMemory | None = None  # the end's /proc/PID/status read
    rollup: HostMemory | None = None  # the end's smaps_rollup read, made after it
    report: HostMemory | None = None
    report_at_s: float = 0.0
    copy: _Copy = field(default_factory=_Copy)  # the in-epoch reads'


@dataclass
class _Epoch:
    """Mutable accumulator of the open (or a closed) epoch."""

    index: int
    label: str
    start_s: float
    end_s: float | None = None
    rows: dict[ProcessKey, _Row] = field(default_factory=dict)
    device_peak: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    pinned: tuple[int, int] | None = None  # torch_state.pinned_host_bytes() at the end
    record: EpochRecord | None = None  # once ended, without its processes

    def row(self, key: ProcessKey) -> _Row:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _Row()
        return row


def _raise_peak(peak: dict[int, int], values: Mapping[int, int]) -> None:
    for device, used in values.items():
        if used > peak.get(device, 0):
            peak[device] = used


class EpochBook:
    """Epochs of one tracker, filled by the sampler and frozen into ``EpochRecord``."""

    def __init__(self, *, grace_s: float, copy_tolerance_bytes: int = 64 * MIB) -> None:
        self.grace_s = grace_s
        self.copy_tolerance_bytes = copy_tolerance_bytes
        self.epochs: list[_Epoch] = []
        self.open: _Epoch | None = None
        self.teardowns: list[TeardownRecord] = []  # from the mailbox, in arrival order

    @property
    def open_index(self) -> int | None:
        """Index of the open epoch, if one is open."""
        return self.open.index if self.open is not None else None

    def begin(self, label: str | None, now: float) -> int:
        """Open the next epoch at ``now``; returns its index."""
        index = len(self.epochs)
        self.open = _Epoch(index, label if label is not None else f"epoch {index}", now)
        self.epochs.append(self.open)
        return index

    def born_in(self, born_s: float, window_s: float) -> int | None:
        """The epoch a birth in ``[born_s, born_s + window_s)`` fell in (NOTE [born epoch]).

        The latest opened before the window ends (workers start as their epoch opens), if it
        had not ended before the window began.
        """
        epoch = next((e for e in reversed(self.epochs) if e.start_s < born_s + window_s), None)
        if epoch is None or (epoch.end_s is not None and epoch.end_s < born_s):
            return None
        return epoch.index

    def note_sample(self, table: ProcessTable, device_used: Mapping[int, int] | None) -> None:
        """Fold one sample into the open epoch, where processes or their bytes changed."""
        epoch = self.open
        if epoch is None:
            return
        epoch.samples += 1
        if table.changed:
            table.changed = False
            for key, proc in table.job_live().items():
                row = epoch.row(key)
                if proc.gpu_bytes or proc.gpu_unknown:
                    row.listed = True
                if proc.gpu_bytes:
                    _raise_peak(row.peak, proc.gpu_bytes)
        if device_used is not None:
            _raise_peak(epoch.device_peak, device_used)

    def end(
        self,
        table: ProcessTable,
        *,
        now: float,
        reason: EndReason,
        error: str | None,
        devices: tuple[DeviceState, ...],
        batches: int | None = None,
        host: Mapping[ProcessKey, HostMemory] | None = None,
        shm: dict[str, Any] | None = None,
    ) -> None:
        """Close the open epoch with the state of every process it saw, read just now."""
        epoch = self.open
        if epoch is None:
            return
        epoch.end_s = now
        pinned = epoch.pinned or (None, None)
        epoch.record = EpochRecord(
            index=epoch.index,
            label=epoch.label,
            start_s=epoch.start_s,
            end_s=now,
            end_reason=reason,
            processes=(),
            devices=devices,
            device_peak_used_bytes=dict(epoch.device_peak),
            samples=epoch.samples,
            error=error,
            batches=batches,
            **(shm or {}),
            pinned_allocated_bytes=pinned[0],
            pinned_reserved_bytes=pinned[1],
        )
        # Ownership now: a worker's report may have corrected a claim (NOTE [claims]).
        table.refresh_ownership()
        epoch.rows = {key: row for key, row in epoch.rows.items() if table.procs[key].own}
        for key in table.job_live():
            epoch.row(key)
        for key, row in epoch.rows.items():
            proc = table.procs[key]
            row.held = _held(proc, table.role(proc))
            row.status = (host or {}).get(key) if proc.exited_s is None else None
        self.open = None

    def apply_rollup(self, index: int, found: Mapping[ProcessKey, HostMemory]) -> bool:
        """Give epoch ``index`` its end's smaps_rollup reads; False once a later epoch ended."""
        later = self.epochs[index + 1 :]
        if not 0 <= index < len(self.epochs) or any(e.end_s is not None for e in later):
            return False
        rows = self.epochs[index].rows
        for key, memory in found.items():
            if key in rows:
                rows[key].rollup = memory
        return True

    def apply_inside(
        self, table: ProcessTable, found: Mapping[ProcessKey, HostMemory], at_s: float
    ) -> None:
        """Fold an in-epoch smaps_rollup read of workers into the open epoch (their copies)."""
        epoch = self.open
        if epoch is None:
            return
        for key, memory in found.items():
            proc = table.procs.get(key)
            if proc is not None and proc.forked is True and proc.birth_host is not None:
                epoch.row(key).copy.fold(proc, memory, at_s, self.copy_tolerance_bytes)

    def apply_report(
        self,
        key: ProcessKey,
        at_s: float,
        gpu_bytes: Mapping[int, int],
        host: HostMemory | None = None,
    ) -> bool:
        """A worker's report at ``at_s`` to its epoch; True if taken (NOTE [worker reports])."""
        epoch = next((e for e in reversed(self.epochs) if e.start_s <= at_s), None)
        if epoch is None:
            return False
        late_s = self.grace_s if key in epoch.rows else 0.0  # one seen in it: within the grace
        if epoch.end_s is not None and at_s > epoch.end_s + late_s:
            return False
        row = epoch.row(key)
        row.reported = True
        _raise_peak(row.peak, gpu_bytes)
        if host is not None:
            row.report, row.report_at_s = host, at_s
        return True

    def apply_teardown(self, teardown: TeardownRecord, t0_s: float) -> None:
        """Keep a teardown record; what it held at exit goes to its epoch (``t0_s``: the start)."""
        self.teardowns.append(teardown)
        held = teardown.gpu_bytes_by_device if teardown.cuda_initialized else {}
        host = None
        if teardown.host_rss_bytes is not None or teardown.host_uss_bytes is not None:
            host = HostMemory(
                uss_bytes=teardown.host_uss_bytes,
                pss_bytes=teardown.host_pss_bytes,
                rss_bytes=teardown.host_rss_bytes,
                swap_bytes=None,
                source="smaps_rollup" if teardown.host_uss_bytes is not None else "status",
                rss_peak_bytes=teardown.host_rss_peak_bytes,
                shared_dirty_bytes=teardown.host_shared_dirty_bytes,
                private_dirty_bytes=teardown.host_private_dirty_bytes,
            )
        if teardown.monotonic_s is None or (held is None and host is None):
            return
        self.apply_report(teardown.key, teardown.monotonic_s - t0_s, held or {}, host)

    def apply_accounting(self, table: ProcessTable, records: Iterable[AccountedProcess]) -> None:
        """The driver's maxima of exited PIDs (NVML accounting, where it is on) as reports."""
        for record in records:
            proc = table.procs.get(table.by_pid.get(record.pid, ProcessKey(0, 0)))
            if proc is None or record.is_running or proc.exited_s is None:
                continue
            if record.max_memory_bytes is not None:
                # The driver saw it last just before it was seen gone.
                self.apply_report(
                    proc.key, proc.exited_s - 1e-3, {record.device_index: record.max_memory_bytes}
                )

    def records(self, table: ProcessTable, *, last: int | None = None) -> tuple[EpochRecord, ...]:
        """The closed epochs (the latest ``last`` of them), frozen."""
        frozen = []
        for epoch in [epoch for epoch in self.epochs if epoch.record is not None][-(last or 0) :]:
            record = epoch.record
            assert record is not None
            start_s, end_s = record.start_s, record.end_s
            processes = tuple(
                self._process(table, table.procs[key], row, epoch.index, start_s, end_s, end_s)
                for key, row in sorted(epoch.rows.items())
                if row.held is not None and table.procs[key].own  # NOTE [claims]: still ours
            )
            frozen.append(dataclasses.replace(record, processes=processes))
        return tuple(frozen)

    def _process(
        self,
        table: ProcessTable,
        proc: Proc,
        row: _Row,
        index: int | None,
        start_s: float,
        end_s: float,
        seen_s: float | None,
    ) -> ProcessEpoch:
        """``proc``'s record of epoch ``index`` (None: a final state at ``end_s``)."""
        held = row.held
        assert held is not None
        alive = held["alive_at_end"]
        peak = dict(row.peak)
        _raise_peak(peak, held["gpu_bytes_end"])  # peak >= end, always
        source: PeakSource = "reported" if row.reported else "sampled"
        if not (row.reported or alive or row.listed):
            source, peak = "unknown", {}  # gone unseen and unreported: not known, never 0
        # Identity as of now: a worker whose record came after its epoch ended was a plain
        # descendant then, and is a worker from birth.
        if held["role"] == "descendant" and proc.key in table.workers:
            held = {**held, "role": "worker"}
        copy = _Copy(row.copy.peak_bytes, row.copy.over_s, row.copy.last)  # row's stays
        for at_s, memory in ((end_s, row.rollup if alive else None), (row.report_at_s, row.report)):
            copy.fold(proc, memory, at_s, self.copy_tolerance_bytes)
        exited_s, rank = proc.exited_s, proc.rank
        return ProcessEpoch(
            **held,
            key=proc.key,
            cmdline=proc.cmdline,
            persistent=table.persistent(proc),
            rank=rank.rank if rank is not None else None,
            rank_device=rank.device if rank is not None else None,
            born_epoch=None if proc.pre_existing else proc.birth_epoch,  # NOTE [born epoch]
            born_in_epoch=index is not None and proc.born_epoch == index and not proc.pre_existing,
            exited_after_s=exited_s - end_s if exited_s is not None and exited_s >= end_s else None,
            last_seen_after_s=proc.last_seen_s - seen_s if alive and seen_s is not None else None,
            gpu_bytes_peak=peak,
            gpu_peak_source=source,
            **_host_fields(row.status, row.rollup, row.report, alive=alive),
            **copy.fields(proc, start_s),
        )

    def pending_survivors(self, table: ProcessTable) -> tuple[list[Proc], float]:
        """Processes whose survival is not decided yet, and until when to wait for them.

        Every live own non-persistent process (or runtime helper reparented away) born in a
        closed epoch and not seen alive ``grace_s`` after it ended; the deadline is the
        latest of those ends plus the grace (NOTE [tracker lifecycle] in sampler.py).
        """
        ends = {e.index: e.end_s for e in self.epochs if e.end_s is not None}
        pending: list[Proc] = []
        deadline = 0.0
        for proc in table.job_live().values():
            # From the epoch it was born in, else the one it was placed in (NOTE [born epoch]).
            born = proc.born_epoch if proc.birth_epoch is None else proc.birth_epoch
            if born not in ends:
                continue
            if table.persistent(proc) and not (
                # A runtime helper reparented away exits within moments of its owner, or
                # stays for ever (an orphan): it gets the grace too.
                table.baseline_helper(proc) and not proc.in_lineage and not proc.pre_existing
            ):
                continue
            end_s = ends[born]
            if proc.last_seen_s - end_s > self.grace_s:
                continue  # already seen alive past the grace: the evidence is in
            pending.append(proc)
            deadline = max(deadline, end_s + self.grace_s)
        return pending, deadline

    def final(
        self,
        table: ProcessTable,
        status: Mapping[ProcessKey, HostMemory],
        rollup: Mapping[ProcessKey, HostMemory],
        now: float,
    ) -> tuple[ProcessEpoch, ...]:
        """Every live process of the job and foreign GPU holders, read now, for a final state."""
        opened, processes = self.open, []
        last_end_s = next((e.end_s for e in reversed(self.epochs) if e.end_s), None)
        for key, proc in sorted(table.live.items()):
            if (proc.foreign and not proc.gpu_bytes) or not (proc.own or proc.foreign):
                continue
            inside = opened.rows.get(key) if opened is not None else None
            row = _Row(
                peak=dict(proc.gpu_bytes),  # a device's 0 too, as NVML listed it
                held=_held(proc, table.role(proc)),
                status=status.get(key),
                rollup=rollup.get(key),
                copy=inside.copy if inside is not None else _Copy(),
            )
            start_s = opened.start_s if opened is not None else now
            processes.append(self._process(table, proc, row, None, start_s, now, last_end_s))
        return tuple(processes)
