"""The epoch book of one tracker: epochs, who was in each, peaks, end states.

NOTE [worker reports]: sampling alone misses what lives shorter than the gap between two NVML
reads: a worker that creates a context, works and exits between reads leaves no trace in
them. So the truth comes from the source. Each worker, as it exits, reads its own NVML entry
and torch's peak reserved bytes and posts them to the mailbox (NOTE [teardown policy] in
teardown.py), stamped with the host's monotonic clock. The book gives that report to the
epoch that was open at that moment (or that ended at most ``grace_s`` before it, for workers
shut down after their epoch), and an epoch's peak for a process is the larger of what was
sampled and what was reported. Where NVML's accounting mode is on, the driver's maxima of
exited PIDs count the same way. A process that exited unseen and reported nothing has an
``unknown`` peak, never 0; one alive at the epoch end was read in full then, so its end is
exact and its peak at least that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from leakcheck.model import (
    DeviceState,
    EndReason,
    EpochRecord,
    PeakSource,
    ProcessEpoch,
    ProcessKey,
    Role,
)
from leakcheck.sampling.table import Proc, ProcessTable

__all__ = ["EpochBook"]


@dataclass(frozen=True)
class _EndState:
    role: Role
    ppid: int
    alive: bool
    gpu_bytes: Mapping[int, int]
    gpu_unknown: bool
    nvidia_fds: int | None


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
    listed: set[ProcessKey] = field(default_factory=set)
    """NVML listed it at some read of this epoch."""
    reported: set[ProcessKey] = field(default_factory=set)
    """Its peak includes its own report (NOTE [worker reports])."""
    device_peak: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    seen: set[ProcessKey] = field(default_factory=set)
    end_state: dict[ProcessKey, _EndState] = field(default_factory=dict)
    devices: tuple[DeviceState, ...] = ()


def _raise_peak(peak: dict[int, int], values: Mapping[int, int]) -> None:
    for device, used in values.items():
        if used > peak.get(device, 0):
            peak[device] = used


class EpochBook:
    """Epochs of one tracker, filled by the sampler and frozen into ``EpochRecord``.

    Args:
        grace_s: How long after an epoch's end a worker's report still belongs to it.

    """

    def __init__(self, *, grace_s: float) -> None:
        self.grace_s = grace_s
        self.epochs: list[_Epoch] = []
        self.open: _Epoch | None = None

    @property
    def open_index(self) -> int | None:
        """Index of the open epoch, if one is open."""
        return self.open.index if self.open is not None else None

    def begin(self, label: str | None, now: float) -> int:
        """Open the next epoch at ``now``; returns its index."""
        index = len(self.epochs)
        self.open = _Epoch(
            index=index, label=label if label is not None else f"epoch {index}", start_s=now
        )
        self.epochs.append(self.open)
        return index

    def see(self, key: ProcessKey) -> None:
        """Count ``key`` in the open epoch (a worker known from its report alone)."""
        if self.open is not None:
            self.open.seen.add(key)

    def note_sample(self, table: ProcessTable, device_used: Mapping[int, int] | None) -> None:
        """Fold one sample into the open epoch: who was seen, peaks, the device peak.

        What the epoch has seen and its peaks change only when processes or their bytes did
        (``table.changed``), and the device peak only with a memory read (``device_used``):
        a tick that did neither leaves the record as it was.
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
    ) -> None:
        """Close the open epoch with the state of every process it saw, read just now."""
        epoch = self.open
        if epoch is None:
            return
        epoch.end_s = now
        epoch.reason = reason
        epoch.error = error
        epoch.devices = devices
        epoch.batches = batches
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
            )
            epoch.seen.add(key)
        self.open = None

    def apply_report(self, key: ProcessKey, at_s: float, gpu_bytes: Mapping[int, int]) -> bool:
        """Give a worker's own report of its peak to its epoch (NOTE [worker reports]).

        Args:
            key: The worker.
            at_s: When it read what it held, on the tracker's clock.
            gpu_bytes: What it held per device (empty: nothing, it had no context).

        Returns:
            Whether an epoch took it.

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
            return True
        return False

    # -- freezing ------------------------------------------------------------------------

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
        processes = [
            self._process_epoch(epoch, table.procs[key], state, table, end_s)
            for key, state in sorted(epoch.end_state.items())
        ]
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
        )

    @staticmethod
    def _process_epoch(
        epoch: _Epoch, proc: Proc, state: _EndState, table: ProcessTable, end_s: float
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
            source = "unknown"  # gone unseen and unreported: not known, never 0
            peak = {}
        exited_after = (
            proc.exited_s - end_s if proc.exited_s is not None and proc.exited_s >= end_s else None
        )
        return ProcessEpoch(
            key=key,
            role=state.role,
            ppid=state.ppid,
            cmdline=proc.cmdline,
            born_in_epoch=proc.born_epoch == epoch.index and not proc.pre_existing,
            persistent=table.persistent(proc),
            alive_at_end=state.alive,
            exited_after_s=exited_after,
            last_seen_after_s=(proc.last_seen_s - end_s) if state.alive else None,
            gpu_bytes_end=dict(state.gpu_bytes),
            gpu_bytes_peak=peak,
            gpu_peak_source=source,
            gpu_bytes_unknown=state.gpu_unknown,
            nvidia_fds=state.nvidia_fds,
        )

    def pending_survivors(self, table: ProcessTable) -> tuple[list[Proc], float]:
        """Processes whose survival is not decided yet, and until when to wait for them.

        Every live, own, non-persistent process born in a closed epoch that has not been
        seen alive ``grace_s`` after its epoch ended; the deadline is the latest of their
        epochs' ends plus the grace (NOTE [tracker lifecycle] in sampler.py).
        """
        ends = {e.index: e.end_s for e in self.epochs if e.end_s is not None}
        pending: list[Proc] = []
        deadline = 0.0
        for proc in table.live.values():
            if proc.foreign or not proc.own or proc.born_epoch not in ends:
                continue
            if table.persistent(proc):
                continue
            end_s = ends[proc.born_epoch]
            assert end_s is not None
            if proc.last_seen_s - end_s >= self.grace_s:
                continue  # already seen alive past the grace: the evidence is in
            pending.append(proc)
            deadline = max(deadline, end_s + self.grace_s)
        return pending, deadline

    def keys_seen(self) -> Iterable[ProcessKey]:
        """Every identity any epoch saw."""
        for epoch in self.epochs:
            yield from epoch.seen
