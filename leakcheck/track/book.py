"""The epoch book of one tracker: epochs, who was in each, peaks, end states.

NOTE [worker reports]: sampling misses what lives shorter than the gap between two NVML reads.
So each worker, as it exits, reads its own NVML entry, torch's peak reserved bytes and its
host memory (USS, PSS, RSS, RSS peak) and posts them to the mailbox (NOTE [teardown policy]
in teardown.py), stamped with the host's monotonic clock. The book gives that report to the
epoch open at that moment (or ended at most ``grace_s`` before it, for workers shut down
after their epoch); an epoch's peak for a process is the larger of what was sampled and what
was reported, and NVML's accounting maxima of exited PIDs, where the mode is on, count the
same way. A process that exited unseen and reported nothing has an ``unknown`` peak, never 0;
one alive at the epoch end was read in full then. A worker gone by its epoch's end is shown
with what it reported (``alive_at_end`` False); one alive was read at the end (status, and
smaps_rollup where paced in: ``apply_rollup``). A forked worker's copies of its parent's
memory (NOTE [copy on read] in hostmem.py) are measured against its birth report by every
smaps_rollup reading of it (in-epoch, the end's, its exit report): each epoch keeps the most
any showed and when one first passed the copy tolerance.
"""

from __future__ import annotations

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
from leakcheck.track.reads import reported_memory
from leakcheck.track.shm import ShmEpoch
from leakcheck.track.table import Proc, ProcessTable

__all__ = ["EpochBook", "final_processes", "host_fields"]


def host_fields(
    end: HostMemory | None, rollup: HostMemory | None, report: HostMemory | None, *, alive: bool
) -> dict[str, Any]:
    """The host-memory fields of a ``ProcessEpoch`` (USS where read, else RSS).

    ``end`` (status) and ``rollup`` (smaps_rollup) were read at the epoch end, ``report`` by
    the process at its exit: for one ``alive`` at the end the end's reads count first, its
    report only for what they lack; else its report alone.
    """
    reads = [m for m in ((end, rollup, report) if alive else (report,)) if m is not None]
    uss = next((m.uss_bytes for m in reads if m.uss_bytes is not None), None)
    rss = next((m.rss_bytes for m in reads if m.rss_bytes is not None), None)
    pss = next((m.pss_bytes for m in reads if m.pss_bytes is not None), None)
    anon = next((m.anon_bytes for m in reads if m.anon_bytes is not None), None)
    peaks = [m.rss_peak_bytes for m in (end, rollup, report) if m and m.rss_peak_bytes]
    if rss is not None:
        peaks.append(rss)
    return {
        "host_bytes_end": uss if uss is not None else rss,
        "host_source": "uss" if uss is not None else ("rss" if rss is not None else None),
        "pss_bytes_end": pss,
        "rss_bytes_end": rss,
        "anon_bytes_end": anon,
        "rss_bytes_peak": max(peaks) if peaks else None,
    }


@dataclass
class _Copy:
    """What the in-epoch reads of one worker showed it copied (NOTE [copy on read])."""

    peak_bytes: int = 0
    over_s: float | None = None  # when a reading first passed the copy tolerance
    last: tuple[int, int | None] | None = None  # (copied, Shared_Dirty) of the latest


def _copy_reading(proc: Proc, memory: HostMemory | None) -> tuple[int, int | None] | None:
    """(copied bytes, Shared_Dirty) of a forked worker's reading, or None."""
    if memory is None or proc.birth_host is None or proc.forked is not True:
        return None
    copied = copied_bytes(proc.birth_host, memory)
    return None if copied is None else (copied, memory.shared_dirty_bytes)


def copy_fields(
    proc: Proc,
    inside: _Copy | None,
    readings: Iterable[tuple[float, HostMemory | None]],
    *,
    start_s: float,
    tolerance_bytes: int,
) -> dict[str, Any]:
    """The copy fields of a ``ProcessEpoch`` (NOTE [copy on read] in hostmem.py).

    ``inside``: the in-epoch reads'; ``readings``: later ``(time, reading)``s in order;
    ``copied_over_after_s`` counts from ``start_s``.
    """
    birth = proc.birth_host
    peak = inside.peak_bytes if inside is not None else None
    over_s = inside.over_s if inside is not None else None
    last = inside.last if inside is not None else None
    for at_s, memory in readings:
        found = _copy_reading(proc, memory)
        if found is None:
            continue
        last = found
        peak = found[0] if peak is None else max(peak, found[0])
        if found[0] > tolerance_bytes and (over_s is None or at_s < over_s):
            over_s = at_s
    return {
        "forked": proc.forked,
        "private_bytes_birth": birth.uss_bytes if birth is not None else None,
        "shared_bytes_birth": birth.shared_dirty_bytes if birth is not None else None,
        "copied_bytes_end": last[0] if last is not None else None,
        "shared_bytes_end": last[1] if last is not None else None,
        "copied_bytes_peak": peak,
        "copied_over_after_s": max(0.0, over_s - start_s) if over_s is not None else None,
    }


@dataclass(frozen=True)
class _EndState:
    role: Role
    ppid: int
    alive: bool
    gpu_bytes: Mapping[int, int]
    gpu_unknown: bool
    nvidia_fds: int | None
    host: HostMemory | None = None
    open_fds: int | None = None
    fd_limit: int | None = None


@dataclass
class _Epoch:
    """Mutable accumulator of the open (or a closed) epoch."""

    index: int
    label: str
    start_s: float
    end_s: float | None = None
    reason: EndReason = "completed"
    error: str | None = None
    batches: int | None = None
    peak: dict[ProcessKey, dict[int, int]] = field(default_factory=dict)
    listed: set[ProcessKey] = field(default_factory=set)  # NVML listed it at some read
    reported: set[ProcessKey] = field(default_factory=set)  # its peak includes its report
    device_peak: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    seen: set[ProcessKey] = field(default_factory=set)
    end_state: dict[ProcessKey, _EndState] = field(default_factory=dict)
    devices: tuple[DeviceState, ...] = ()
    rollup: dict[ProcessKey, HostMemory] = field(default_factory=dict)  # the end's USS, PSS
    host_reports: dict[ProcessKey, HostMemory] = field(default_factory=dict)
    report_at_s: dict[ProcessKey, float] = field(default_factory=dict)
    inside: dict[ProcessKey, _Copy] = field(default_factory=dict)
    pinned: tuple[int, int] | None = None  # torch_state.pinned_host_bytes() at the end
    shm: ShmEpoch | None = None


def _raise_peak(peak: dict[int, int], values: Mapping[int, int]) -> None:
    for device, used in values.items():
        if used > peak.get(device, 0):
            peak[device] = used


class EpochBook:
    """Epochs of one tracker, filled by the sampler and frozen into ``EpochRecord``.

    ``grace_s``: how long after an epoch's end a worker's report still belongs to it; a copy
    above ``copy_tolerance_bytes`` is marked with when it was first read.
    """

    def __init__(self, *, grace_s: float, copy_tolerance_bytes: int = 64 * MIB) -> None:
        self.grace_s = grace_s
        self.copy_tolerance_bytes = copy_tolerance_bytes
        self.epochs: list[_Epoch] = []
        self.open: _Epoch | None = None
        self.teardowns: list[TeardownRecord] = []
        """Worker teardowns reported through the mailbox, in arrival order."""

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

        The latest epoch opened before the window ends wins (a loader's workers start as its
        epoch opens, within the tick); None if it ended before the window began, or none had
        opened.
        """
        for epoch in reversed(self.epochs):
            if epoch.start_s >= born_s + window_s:
                continue
            if epoch.end_s is not None and epoch.end_s < born_s:
                return None
            return epoch.index
        return None

    def see(self, key: ProcessKey) -> None:
        """Count ``key`` in the open epoch (a worker known from its report alone)."""
        if self.open is not None:
            self.open.seen.add(key)

    def note_sample(self, table: ProcessTable, device_used: Mapping[int, int] | None) -> None:
        """Fold one sample into the open epoch: who was seen, peaks, the device peak.

        Only where processes or their bytes changed (``table.changed``), and the device peak
        only with a memory read: a tick that did neither leaves the record as it was.
        """
        epoch = self.open
        if epoch is None:
            return
        epoch.samples += 1
        if table.changed:
            table.changed = False
            for key, proc in table.live.items():
                if proc.foreign or not proc.own:
                    continue
                epoch.seen.add(key)
                if proc.gpu_bytes or proc.gpu_unknown:
                    epoch.listed.add(key)
                if proc.gpu_bytes:
                    _raise_peak(epoch.peak.setdefault(key, {}), proc.gpu_bytes)
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
        shm: ShmEpoch | None = None,
    ) -> None:
        """Close the open epoch with the state of every process it saw, read just now."""
        epoch = self.open
        if epoch is None:
            return
        epoch.end_s, epoch.reason, epoch.error = now, reason, error
        epoch.devices, epoch.batches, epoch.shm = devices, batches, shm
        host = host or {}
        # Ownership as it stands now: a worker's report may have corrected a claim made
        # when it was first seen (NOTE [claims]).
        table.refresh_ownership()
        epoch.seen = {key for key in epoch.seen if table.procs[key].own}
        for key in epoch.seen | {k for k, p in table.live.items() if p.own and not p.foreign}:
            proc = table.procs[key]
            alive = proc.exited_s is None
            epoch.end_state[key] = _EndState(
                role=table.role(proc),
                ppid=proc.ppid,
                alive=alive,
                gpu_bytes=dict(proc.gpu_bytes) if alive else {},
                gpu_unknown=proc.gpu_unknown and alive,
                nvidia_fds=proc.nvidia_fds if alive else None,
                host=host.get(key) if alive else None,
                open_fds=proc.open_fds if alive else None,
                fd_limit=proc.fd_limit if alive else None,
            )
            epoch.seen.add(key)
        self.open = None

    def apply_rollup(self, index: int, found: Mapping[ProcessKey, HostMemory]) -> bool:
        """Give the smaps_rollup reads planned at epoch ``index``'s end to that epoch.

        Refused (False) when a later epoch has ended since: they would show a later moment.
        """
        later = self.epochs[index + 1 :]
        if not 0 <= index < len(self.epochs) or any(e.end_s is not None for e in later):
            return False
        self.epochs[index].rollup.update(found)
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
            reading = _copy_reading(proc, memory) if proc is not None else None
            if reading is None:
                continue
            copy = epoch.inside.setdefault(key, _Copy())
            copy.peak_bytes = max(copy.peak_bytes, reading[0])
            copy.last = reading
            if reading[0] > self.copy_tolerance_bytes and copy.over_s is None:
                copy.over_s = at_s

    def apply_report(
        self,
        key: ProcessKey,
        at_s: float,
        gpu_bytes: Mapping[int, int],
        host: HostMemory | None = None,
    ) -> bool:
        """Give a worker's own report, read at ``at_s``, to its epoch (NOTE [worker reports]).

        ``gpu_bytes`` empty: it held nothing. Returns whether an epoch took it.
        """
        for epoch in reversed(self.epochs):
            if epoch.start_s > at_s:
                continue
            ended = epoch.end_s
            within = (
                ended is None
                or at_s <= ended
                or (key in epoch.seen and at_s <= ended + self.grace_s)
            )
            if not within:
                return False
            epoch.seen.add(key)
            epoch.reported.add(key)
            _raise_peak(epoch.peak.setdefault(key, {}), gpu_bytes)
            if host is not None:
                epoch.host_reports[key] = host
                epoch.report_at_s[key] = at_s
            return True
        return False

    def apply_teardown(self, teardown: TeardownRecord, t0_s: float) -> None:
        """Keep a worker's teardown record and give what it held as it exited to its epoch.

        ``t0_s``: the tracker's start on the monotonic clock the record is stamped with. A
        worker that never used CUDA held nothing on a GPU.
        """
        self.teardowns.append(teardown)
        held = teardown.gpu_bytes_by_device if teardown.cuda_initialized else {}
        host = reported_memory(teardown)
        if teardown.monotonic_s is None or (held is None and host is None):
            return
        self.apply_report(teardown.key, teardown.monotonic_s - t0_s, held or {}, host)

    def apply_accounting(self, table: ProcessTable, records: Iterable[AccountedProcess]) -> None:
        """The driver's maxima of exited PIDs (NVML accounting, where it is on) as reports."""
        for record in records:
            key = table.by_pid.get(record.pid)
            proc = table.procs.get(key) if key is not None else None
            if proc is None or record.is_running or proc.exited_s is None:
                continue
            if record.max_memory_bytes is not None:
                # The driver saw it last just before it was seen gone.
                self.apply_report(
                    proc.key, proc.exited_s - 1e-3, {record.device_index: record.max_memory_bytes}
                )

    def records(
        self, table: ProcessTable, *, now: float, last: int | None = None
    ) -> tuple[EpochRecord, ...]:
        """The closed epochs (the latest ``last`` of them), frozen."""
        closed = [epoch for epoch in self.epochs if epoch.end_s is not None]
        if last is not None:
            closed = closed[-last:]
        return tuple(self._freeze(epoch, table, now) for epoch in closed)

    def _freeze(self, epoch: _Epoch, table: ProcessTable, now: float) -> EpochRecord:
        end_s = epoch.end_s if epoch.end_s is not None else now
        # A process another tracker's worker report took after this epoch ended is not
        # listed either (NOTE [claims]).
        processes = [
            self._process_epoch(epoch, table.procs[key], state, table, end_s)
            for key, state in sorted(epoch.end_state.items())
            if table.procs[key].own
        ]
        shm = epoch.shm
        return EpochRecord(
            index=epoch.index,
            label=epoch.label,
            start_s=epoch.start_s,
            end_s=end_s,
            end_reason=epoch.reason,
            processes=tuple(processes),
            devices=epoch.devices,
            device_peak_used_bytes=dict(epoch.device_peak),
            samples=epoch.samples,
            error=epoch.error,
            batches=epoch.batches,
            shm_files=shm.files if shm else (),
            shm_bytes=shm.bytes if shm else None,
            shm_total_bytes=shm.total_bytes if shm else None,
            shm_used_peak_bytes=shm.used_peak_bytes if shm else None,
            pinned_allocated_bytes=epoch.pinned[0] if epoch.pinned else None,
            pinned_reserved_bytes=epoch.pinned[1] if epoch.pinned else None,
        )

    def _process_epoch(
        self, epoch: _Epoch, proc: Proc, state: _EndState, table: ProcessTable, end_s: float
    ) -> ProcessEpoch:
        key = proc.key
        peak = dict(epoch.peak.get(key, {}))
        _raise_peak(peak, state.gpu_bytes)  # peak >= end, always
        source: PeakSource
        if key in epoch.reported:
            source = "reported"
        elif state.alive or key in epoch.listed:
            source = "sampled"
        else:
            source, peak = "unknown", {}  # gone unseen and unreported: not known, never 0
        exited_after = (
            proc.exited_s - end_s if proc.exited_s is not None and proc.exited_s >= end_s else None
        )
        # A worker whose record came after the epoch that started it ended was a plain
        # descendant then; it is a worker from birth, and records are judged as of now.
        role = state.role
        if role == "descendant" and key in table.workers:
            role = "worker"
        return ProcessEpoch(
            role=role,
            ppid=state.ppid,
            born_in_epoch=proc.born_epoch == epoch.index and not proc.pre_existing,
            alive_at_end=state.alive,
            exited_after_s=exited_after,
            last_seen_after_s=(proc.last_seen_s - end_s) if state.alive else None,
            gpu_bytes_end=dict(state.gpu_bytes),
            gpu_bytes_peak=peak,
            gpu_peak_source=source,
            gpu_bytes_unknown=state.gpu_unknown,
            nvidia_fds=state.nvidia_fds,
            open_fds=state.open_fds,
            fd_limit=state.fd_limit,
            **_identity_fields(proc, table),
            **host_fields(
                state.host, epoch.rollup.get(key), epoch.host_reports.get(key), alive=state.alive
            ),
            **copy_fields(
                proc,
                epoch.inside.get(key),
                [
                    (end_s, epoch.rollup.get(key) if state.alive else None),
                    (epoch.report_at_s.get(key, end_s), epoch.host_reports.get(key)),
                ],
                start_s=epoch.start_s,
                tolerance_bytes=self.copy_tolerance_bytes,
            ),
        )

    def pending_survivors(self, table: ProcessTable) -> tuple[list[Proc], float]:
        """Processes whose survival is not decided yet, and until when to wait for them.

        Every live own non-persistent process (or runtime helper reparented away) born in a
        closed epoch and not seen alive ``grace_s`` after that epoch ended; the deadline is
        the latest of those ends plus the grace (NOTE [tracker lifecycle] in sampler.py).
        """
        ends = {e.index: e.end_s for e in self.epochs if e.end_s is not None}
        pending: list[Proc] = []
        deadline = 0.0
        for proc in table.live.values():
            # From the epoch it was born in, else the one it was placed in (NOTE [born epoch]).
            born = proc.born_epoch if proc.birth_epoch is None else proc.birth_epoch
            if proc.foreign or not proc.own or born not in ends:
                continue
            if table.persistent(proc) and not (
                # A runtime helper reparented away gets the grace too: it exits within
                # moments of its owner, or stays for ever (an orphan).
                table.baseline_helper(proc) and not proc.in_lineage and not proc.pre_existing
            ):
                continue
            end_s = ends[born]
            assert end_s is not None
            if proc.last_seen_s - end_s > self.grace_s:
                continue  # already seen alive past the grace: the evidence is in
            pending.append(proc)
            deadline = max(deadline, end_s + self.grace_s)
        return pending, deadline


def _identity_fields(proc: Proc, table: ProcessTable) -> dict[str, Any]:
    """The ``ProcessEpoch`` fields of who ``proc`` is, alike in every record of it."""
    return {
        "key": proc.key,
        "cmdline": proc.cmdline,
        "persistent": table.persistent(proc),
        "rank": proc.rank.rank if proc.rank is not None else None,
        "rank_device": proc.rank.device if proc.rank is not None else None,
        "born_epoch": None if proc.pre_existing else proc.birth_epoch,  # NOTE [born epoch]
    }


def final_processes(
    table: ProcessTable,
    last_end_s: float | None,
    status: Mapping[ProcessKey, HostMemory],
    rollup: Mapping[ProcessKey, HostMemory],
    book: EpochBook,
    now: float,
) -> tuple[ProcessEpoch, ...]:
    """Every live process of the job, and foreign GPU holders, for a fresh final state.

    ``status`` and ``rollup``: their host memory read now; the open epoch's copy readings
    count with the rollup one, else it alone, counted from ``now``.
    """
    processes: list[ProcessEpoch] = []
    opened = book.open
    for key, proc in sorted(table.live.items()):
        if (proc.foreign and not proc.gpu_bytes) or not (proc.own or proc.foreign):
            continue
        processes.append(
            ProcessEpoch(
                role=table.role(proc),
                ppid=proc.ppid,
                born_in_epoch=False,
                alive_at_end=True,
                last_seen_after_s=(proc.last_seen_s - last_end_s) if last_end_s else None,
                gpu_bytes_end=dict(proc.gpu_bytes),
                gpu_bytes_peak=dict(proc.gpu_bytes),
                gpu_bytes_unknown=proc.gpu_unknown,
                nvidia_fds=proc.nvidia_fds,
                open_fds=proc.open_fds,
                fd_limit=proc.fd_limit,
                **_identity_fields(proc, table),
                **host_fields(status.get(key), rollup.get(key), None, alive=True),
                **copy_fields(
                    proc,
                    opened.inside.get(key) if opened is not None else None,
                    [(now, rollup.get(key))],
                    start_s=opened.start_s if opened is not None else now,
                    tolerance_bytes=book.copy_tolerance_bytes,
                ),
            )
        )
    return tuple(processes)
