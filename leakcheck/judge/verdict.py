"""Leak rules: pure functions ``rule(timeline, config) -> tuple[Finding, ...]``, no I/O, no clock.

``judge`` runs them all and orders the findings. Rules on GPU memory need NVML and find nothing
without it; the host rules always run.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from leakcheck.core.model import (
    MIB,
    DeviceState,
    EpochRecord,
    Finding,
    ProcessEpoch,
    ProcessKey,
    Role,
    Rule,
    RuleConfig,
    Severity,
    ShmFile,
    Timeline,
)
from leakcheck.core.names import culprit
from leakcheck.core.roles import is_daemon_helper
from leakcheck.core.units import format_mib
from leakcheck.judge.deaths import died, hang, shutdown_hang
from leakcheck.observe.procs import create_time_s

__all__ = [
    "LINEAGE_ROLES",
    "RULES",
    "EpochCounts",
    "blind",
    "context_kept",
    "copy_on_read",
    "descriptor_holder",
    "device_mismatch",
    "epoch_counts",
    "fd_pressure",
    "growth",
    "growth_slope",
    "high_clocks",
    "host_growth",
    "judge",
    "orphan",
    "pinned_growth",
    "residual",
    "shm",
    "survivor",
    "tracker_failure",
]

LINEAGE_ROLES: frozenset[Role] = frozenset(("parent", "worker", "descendant", "orphan"))
"""Roles of processes that belong to the watched job (everything but ``foreign``)."""

# NOTE [late rise]: a leak keeps growing; allocator warm-up grows, then plateaus: at least this
# share of the total rise must happen in the series' second half.
_LATE_RISE_SHARE = 0.25


def per_pid_bytes_known(timeline: Timeline) -> bool:
    """Tell whether NVML's per-process bytes match this namespace's PIDs."""
    return timeline.attribution == "ok"


def _has_nvml(timeline: Timeline) -> bool:
    """Tell whether device-level NVML data exists (rules on device totals may run)."""
    return timeline.attribution not in ("nvml-unavailable", "no-gpu")


# NOTE [one line per finding]: a finding's ``message`` is one line of at most about 160
# characters, ``<culprit> <what>`` for one process (``names.culprit``), then how much and
# since when, so ``report.finding_lines`` can group one cause by what follows the culprit;
# its ``remedy`` is one fix of at most about 120. ``leakcheck explain RULE`` tells the rest.


def _process_finding(
    proc: ProcessEpoch,
    *,
    rule: Rule,
    severity: Severity,
    what: str = "",
    remedy: str,
    message: str | None = None,
    gpu_bytes: int | None = None,
    epoch: int | None = None,
    device_index: int | None = None,
    bytes_per_epoch: float | None = None,
    nvidia_fds: int | None = None,
    scope: str | None = None,
    host_bytes: int | None = None,
) -> Finding:
    """A finding about one process, its identity taken whole from ``proc``."""
    who = culprit(proc.role, proc.key.pid, proc.cmdline, rank=proc.rank, rule=rule)
    return Finding(
        rule=rule,
        severity=severity,
        message=message if message is not None else f"{who} {what}",
        remedy=remedy,
        pid=proc.key.pid,
        start_ticks=proc.key.start_ticks,
        role=proc.role,
        cmdline=proc.cmdline,
        rank=proc.rank,
        gpu_bytes=gpu_bytes,
        epoch=epoch,
        device_index=device_index,
        bytes_per_epoch=bytes_per_epoch,
        nvidia_fds=nvidia_fds,
        scope=scope,
        host_bytes=host_bytes,
    )


def _devices_text(gpu_bytes: Mapping[int, int]) -> str:
    """``GPU0 612 MiB, GPU1 2.0 MiB`` for the devices holding memory."""
    parts = [f"GPU{d} {format_mib(b)} MiB" for d, b in sorted(gpu_bytes.items()) if b > 0]
    return ", ".join(parts)


def _holding_text(
    gpu_bytes: Mapping[int, int], nvidia_fds: int | None, *, bytes_known: bool
) -> str:
    """Describe what a process holds: GPU bytes per device and /dev/nvidia* fds."""
    parts: list[str] = []
    if bytes_known:
        devices = _devices_text(gpu_bytes)
        if devices:
            parts.append(devices)
    if nvidia_fds:
        parts.append(f"{nvidia_fds} /dev/nvidia* fds")
    return "; holds " + ", ".join(parts) if parts else ""


def _max_per_device(procs: Iterable[ProcessEpoch]) -> dict[int, int]:
    out: dict[int, int] = {}
    for proc in procs:
        for device, held in proc.gpu_bytes_end.items():
            out[device] = max(out.get(device, 0), held)
    return out


def _max_fds(procs: Iterable[ProcessEpoch]) -> int | None:
    known = [p.nvidia_fds for p in procs if p.nvidia_fds is not None]
    return max(known) if known else None


def _sorted_epochs(timeline: Timeline) -> list[EpochRecord]:
    return sorted(timeline.epochs, key=lambda rec: rec.index)


def _observations(
    timeline: Timeline,
) -> dict[ProcessKey, list[tuple[EpochRecord | None, ProcessEpoch]]]:
    """Every observation of every identity: epochs in index order, then the final state."""
    seen: dict[ProcessKey, list[tuple[EpochRecord | None, ProcessEpoch]]] = {}
    for rec in _sorted_epochs(timeline):
        for proc in rec.processes:
            seen.setdefault(proc.key, []).append((rec, proc))
    if timeline.final is not None:
        for proc in timeline.final.processes:
            seen.setdefault(proc.key, []).append((None, proc))
    return seen


@dataclass(frozen=True)
class EpochCounts:
    """What an epoch's end left running, in hindsight of every later observation.

    Attributes:
        alive_after: Non-persistent processes the epoch started, seen alive past the grace
            after its end or when the job ended (the survivor and orphan rules' evidence).
        orphans: The job's reparented processes alive at the epoch's end, outside the tree
            its end's walk listed.

    """

    alive_after: int = 0
    orphans: int = 0


def epoch_counts(timeline: Timeline, grace_s: float) -> dict[int, EpochCounts]:
    """``EpochCounts`` for every epoch of ``timeline``, by index."""
    ordered = _sorted_epochs(timeline)
    epochs = {rec.index: rec for rec in ordered}
    ends = [rec.end_s for rec in ordered]
    final_closed = timeline.final is not None and timeline.final.closed
    alive: dict[int, int] = dict.fromkeys(epochs, 0)
    orphans: dict[int, int] = dict.fromkeys(epochs, 0)
    for obs in _observations(timeline).values():
        procs = [proc for _, proc in obs]
        if not any(proc.role in ("worker", "descendant", "orphan") for proc in procs):
            continue
        birth = _birth(epochs, obs)
        if birth is not None:
            after_s = _alive_after_s(timeline, birth, obs)
            # Alive when the job ended counts too: the orphan rule names what outlived the
            # job whether or not the grace had passed by then.
            outlived = _past_grace(after_s, grace_s)
            outlived = outlived or (obs[-1][0] is None and final_closed)
            if outlived and not any(p.persistent for p in procs):
                alive[birth.index] += 1
        if any(p.role == "orphan" for p in procs) and not any(map(_daemonized, procs)):
            for rec in _ends_outside_the_tree(timeline, ordered, ends, obs, birth):
                orphans[rec.index] += 1
    return {index: EpochCounts(alive[index], orphans[index]) for index in epochs}


def _past_grace(after_s: float | None, grace_s: float) -> bool:
    """Seen alive later than the grace after an epoch's end (``_alive_after_s``)."""
    # Strictly: with a grace of 0, the end's own sample seeing it alive is not outliving.
    return after_s is not None and after_s > grace_s


def _daemonized(proc: ProcessEpoch) -> bool:
    """A helper that daemonizes by design (``roles.DAEMON_HELPERS``): no orphan rule's."""
    return proc.persistent and is_daemon_helper(proc.cmdline)


def _birth(
    epochs: Mapping[int, EpochRecord], obs: Sequence[tuple[EpochRecord | None, ProcessEpoch]]
) -> EpochRecord | None:
    """The epoch a process was born in: by its create time, else where first seen born."""
    born = next((proc.born_epoch for _, proc in obs if proc.born_epoch is not None), None)
    if born is None:
        born = next((rec.index for rec, p in obs if rec is not None and p.born_in_epoch), None)
    return epochs.get(born) if born is not None else None


def _ends_outside_the_tree(
    timeline: Timeline,
    ordered: Sequence[EpochRecord],
    ends: Sequence[float],
    obs: Sequence[tuple[EpochRecord | None, ProcessEpoch]],
    birth: EpochRecord | None,
) -> list[EpochRecord]:
    """The epochs at whose end a process of the job was alive and outside its tree."""
    start = birth or next((rec for rec, p in obs if rec is not None and p.alive_at_end), None)
    if start is None:
        return []
    after_s = _alive_after_s(timeline, start, obs)
    if after_s is None:
        return []
    in_tree = {rec.index for rec, proc in obs if rec is not None and proc.role != "orphan"}
    lo = bisect.bisect_left(ends, start.end_s)
    hi = bisect.bisect_right(ends, start.end_s + after_s)
    return [rec for rec in ordered[lo:hi] if rec.index not in in_tree]


# --------------------------------------------------------------------------- survivor


def _alive_after_s(
    timeline: Timeline,
    birth: EpochRecord,
    observations: Sequence[tuple[EpochRecord | None, ProcessEpoch]],
) -> float | None:
    """Longest time after ``birth`` ended at which the process was seen alive."""
    best: float | None = None

    def take(value: float | None) -> None:
        nonlocal best
        if value is not None and (best is None or value > best):
            best = value

    for rec, proc in observations:
        if rec is None:
            if timeline.final is not None and timeline.final.time_s >= birth.end_s:
                take(timeline.final.time_s - birth.end_s)
        elif rec.index == birth.index:
            seen_s = proc.last_seen_after_s
            if proc.alive_at_end:  # alive at end_s, which is stamped after the end sample
                seen_s = max(0.0, seen_s or 0.0)
            take(seen_s)
        elif rec.index > birth.index and proc.alive_at_end:
            take(rec.end_s - birth.end_s + max(0.0, proc.last_seen_after_s or 0.0))
    return best


REMEDY_SCOPE = (
    "stop it in the fixture's finalizer (after its yield), or give the fixture a narrower scope"
)
REMEDY_WORKER_CHILD = "join or terminate it within the epoch, in the worker code that starts it"
REMEDY_ORPHAN = "leakcheck.worker_init_fn(terminate_children=True)"
REMEDY_CYCLE = (
    "break the reference cycle that keeps the loader's iterator alive, or `del` it and gc.collect()"
)
REMEDY_WORKER = "end each epoch's iterator (exhaust or `del` it), or set persistent_workers=True"
REMEDY_STARTED = (
    "join or terminate the processes and pools the work starts (`with Pool(...)`, proc.join())"
)


def _survivor_remedy(proc: ProcessEpoch, workers: Collection[int]) -> str:
    if proc.freed_by_gc:
        return REMEDY_CYCLE
    if proc.scope is not None:
        return REMEDY_SCOPE
    if proc.role == "descendant" and proc.ppid in workers:
        # Under a live (persistent) worker; an orphan once that exits: one cause, one fix.
        return REMEDY_WORKER_CHILD
    if proc.role == "worker":
        return REMEDY_WORKER
    return REMEDY_STARTED


def _worker_pids(obs: Sequence[tuple[EpochRecord | None, ProcessEpoch]]) -> set[int]:
    """The workers of the epochs a process was seen in (its parent may be one of them)."""
    return {
        p.key.pid for rec, _ in obs if rec is not None for p in rec.processes if p.role == "worker"
    }


def _origin(proc: ProcessEpoch, epochs: Mapping[int, EpochRecord]) -> str | None:
    """What started it, or the epoch it was born in; None where neither is known."""
    if proc.scope is not None:
        return f"started by {proc.scope}"
    born = epochs.get(proc.born_epoch) if proc.born_epoch is not None else None
    return f"started in {born.label}" if born is not None else None


def survivor(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find processes born in an epoch, not persistent, alive past its end plus the grace."""
    observations = _observations(timeline)
    bytes_known = per_pid_bytes_known(timeline)
    epochs = {rec.index: rec for rec in timeline.epochs}
    found: list[Finding] = []
    judged: set[ProcessKey] = set()
    for rec in _sorted_epochs(timeline):
        for proc in rec.processes:
            if (
                proc.key in judged
                or not proc.born_in_epoch
                or proc.persistent
                or proc.role not in ("worker", "descendant")
                or not proc.alive_at_end
            ):
                continue
            obs = observations[proc.key]
            # The grace counts from the end of the epoch it was born in, which the table's
            # `alive after` and the finding's "started in" name too; a helper found epochs
            # late was placed where found (NOTE [born epoch] in track/sampler.py).
            born = _birth(epochs, obs) or rec
            # Evidence only: seen alive once the grace had passed. A process last seen within
            # the grace and found gone after it exited somewhere in between, unknown where.
            alive_after = _alive_after_s(timeline, born, obs)
            if alive_after is None or not _past_grace(alive_after, config.grace_s):
                continue
            judged.add(proc.key)
            later = [p for r, p in obs if r is None or r.index >= born.index]
            gpu_bytes = _max_per_device(later) if bytes_known else {}
            fds = _max_fds(later)
            cycle = "; kept by a reference cycle" if proc.freed_by_gc else ""
            origin = _origin(proc, epochs)
            ended = born.label if proc.scope is not None else "it"  # "started in <it>"
            found.append(
                _process_finding(
                    proc,
                    rule="survivor",
                    severity="leak",
                    what=(
                        f"{origin or f'first seen in {born.label}'}, alive "
                        f"{alive_after:.1f} s after {ended} ended"
                        f"{_holding_text(gpu_bytes, fds, bytes_known=bytes_known)}{cycle}"
                    ),
                    remedy=_survivor_remedy(proc, _worker_pids(obs)),
                    gpu_bytes=sum(gpu_bytes.values()) if bytes_known else None,
                    epoch=born.index,
                    nvidia_fds=fds,
                    scope=proc.scope,
                )
            )
    return tuple(found)


# --------------------------------------------------------------------------- orphan


def orphan(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find lineage processes reparented away from the job and alive past the grace.

    Not a helper that daemonizes by design and pins nothing on the GPU
    (``roles.DAEMON_HELPERS``); one finding per identity, with the most GPU memory and
    descriptors it was seen with.
    """
    bytes_known = per_pid_bytes_known(timeline)
    ordered = _sorted_epochs(timeline)
    epochs = {rec.index: rec for rec in ordered}
    ends = [rec.end_s for rec in ordered]
    found: list[Finding] = []
    for key, obs in _observations(timeline).items():
        # A helper that daemonizes by design and pins nothing on the GPU (persistent: torch's
        # shared-memory manager) is a baseline, as for the survivor rule.
        orphaned = [
            (rec, proc)
            for rec, proc in obs
            if proc.role == "orphan"
            and not _daemonized(proc)
            and (rec is None or proc.alive_at_end)
        ]
        if not orphaned:
            continue
        if all(proc.persistent for _, proc in orphaned) and not _past_grace(
            max(proc.last_seen_after_s or 0.0 for _, proc in orphaned), config.grace_s
        ):
            continue  # a runtime helper on its way out with its owner, not seen past the grace
        first_rec = orphaned[0][0]
        if first_rec is not None and all(rec is not None for rec, _ in orphaned):
            latest = max(
                rec.end_s + (proc.last_seen_after_s or 0.0)
                for rec, proc in orphaned
                if rec is not None
            )
            if not _past_grace(latest - first_rec.end_s, config.grace_s):
                continue  # not seen alive long enough to tell: judged later, or at close
        last = orphaned[-1][1]
        procs = [proc for _, proc in orphaned]
        gpu_bytes = _max_per_device(procs) if bytes_known else {}
        fds = _max_fds(procs)
        birth = _birth(epochs, obs)
        left = _ends_outside_the_tree(timeline, ordered, ends, obs, birth) if birth else []
        if left:
            # The epoch it left the tree in; leakcheck run's whole-program "epoch" says
            # nothing a reader could use.
            since = f" since {left[0].label}" if left[0].label != "program" else ""
        elif first_rec is not None:
            # Birth unknown: only that it had left by the epoch a scan found it outside in.
            since = f" by {first_rec.label}"
        else:
            final = timeline.final
            since = " after the job" if final is None or final.closed else ""
        still = ""
        if orphaned[-1][0] is None:
            final = timeline.final
            still = ", alive after the job" if final is None or final.closed else ", alive now"
            if since == " after the job":
                still = ", still alive"
        workers = _worker_pids(obs)
        under_worker = any(p.ppid in workers for _, p in obs if p.role != "orphan")
        parent = "worker" if under_worker else "parent"
        started = ""
        if last.scope is not None:
            started = f"started by {last.scope}, "
        elif birth is not None and (not left or left[0].index != birth.index):
            started = f"started in {birth.label}, "  # "since" names another epoch, or none
        found.append(
            _process_finding(
                last,
                rule="orphan",
                severity="leak",
                what=(
                    f"{started}outlived its {parent}{since}{still}"
                    f"{_holding_text(gpu_bytes, fds, bytes_known=bytes_known)}"
                ),
                remedy=f"{REMEDY_ORPHAN}, or kill {key.pid}",
                gpu_bytes=sum(gpu_bytes.values()) if bytes_known else None,
                epoch=left[0].index if left else (first_rec.index if first_rec else None),
                nvidia_fds=fds,
                scope=last.scope,
            )
        )
    return tuple(found)


# --------------------------------------------------------------------------- growth


def _least_squares_slope(series: Sequence[int], xs: Sequence[float] | None = None) -> float:
    n = len(series)
    x = list(xs) if xs is not None else [float(i) for i in range(n)]
    mean_x = sum(x) / n
    mean_y = sum(series) / n
    sxx = sum((xi - mean_x) ** 2 for xi in x)
    sxy = sum((xi - mean_x) * (y - mean_y) for xi, y in zip(x, series, strict=True))
    return sxy / sxx if sxx else 0.0


def growth_slope(
    series: Sequence[int],
    config: RuleConfig,
    *,
    epochs: Sequence[int] | None = None,
    tolerance_bytes: int | None = None,
) -> float | None:
    """The least-squares slope (bytes/epoch) of a leaking series of epoch-end bytes, else None.

    A leak needs 3 points, a total rise above the tolerance and a late rise (NOTE [late rise]).

    Args:
        series: Bytes at the end of each judged epoch (warm-up removed), in epoch order.
        config: The thresholds.
        epochs: Each point's epoch index where epochs are missing (paced-out USS reads).
        tolerance_bytes: Instead of ``config.tolerance_bytes``.

    """
    n = len(series)
    if n < 3:
        return None
    tolerance = config.tolerance_bytes if tolerance_bytes is None else tolerance_bytes
    rise = series[-1] - series[0]
    if rise <= tolerance:
        return None
    late_rise = series[-1] - series[(n - 1) // 2]
    if late_rise <= 0 or late_rise < _LATE_RISE_SHARE * rise:
        return None
    slope = _least_squares_slope(series, [float(e) for e in epochs] if epochs else None)
    return slope if slope > 0 else None


def _grows(slope: float, first: int, last: int, start_bytes: int, end_bytes: int) -> str:
    """``grows 8.0 MiB/epoch over epochs 1-4: 600 -> 624 MiB``."""
    return (
        f"grows {format_mib(slope)} MiB/epoch over epochs {first}-{last}: "
        f"{format_mib(start_bytes)} -> {format_mib(end_bytes)} MiB"
    )


def _growth_remedy(role: Role) -> str:
    if role == "parent":
        return (
            "drop tensors kept across epochs: accumulate loss.item(), not loss; clear lists of "
            "outputs"
        )
    return (
        "keep worker-side caches on the CPU (move batches to the GPU in the main process), or "
        "bound them"
    )


def _process_growth(timeline: Timeline, config: RuleConfig) -> list[Finding]:
    found: list[Finding] = []
    for obs in _observations(timeline).values():
        points = [
            (rec, proc)
            for rec, proc in obs
            if rec is not None and proc.persistent and not proc.gpu_bytes_unknown
        ]
        points = points[config.warmup_epochs :]
        series = [proc.total_gpu_bytes_end for _, proc in points]
        slope = growth_slope(series, config)
        if slope is None:
            continue
        (first_rec, first), (last_rec, last) = points[0], points[-1]
        assert first_rec is not None and last_rec is not None  # filtered above
        devices = sorted(set(first.gpu_bytes_end) | set(last.gpu_bytes_end))
        deltas = {d: last.gpu_bytes_end.get(d, 0) - first.gpu_bytes_end.get(d, 0) for d in devices}
        grown = [(d, delta) for d, delta in deltas.items() if delta]
        per_device = (
            f" on GPU{grown[0][0]}"
            if len(grown) == 1
            else " ("
            + ", ".join(f"GPU{d} {format_mib(x, signed=True)} MiB" for d, x in grown)
            + ")"
        )
        found.append(
            _process_finding(
                last,
                rule="growth",
                severity="leak",
                what=_grows(slope, first_rec.index, last_rec.index, series[0], series[-1])
                + per_device,
                remedy=_growth_remedy(last.role),
                gpu_bytes=series[-1] - series[0],
                epoch=last_rec.index,
                bytes_per_epoch=slope,
                nvidia_fds=last.nvidia_fds,
            )
        )
    return found


def _device_growth(timeline: Timeline, config: RuleConfig) -> list[Finding]:
    """Device totals per epoch: the fallback when PIDs cannot be attributed (blind)."""
    per_device: dict[int, list[tuple[int, int]]] = {}
    for rec in _sorted_epochs(timeline):
        for dev in rec.devices:
            per_device.setdefault(dev.index, []).append((rec.index, dev.used_bytes))
    found: list[Finding] = []
    for device, points in sorted(per_device.items()):
        points = points[config.warmup_epochs :]
        series = [used for _, used in points]
        slope = growth_slope(series, config)
        if slope is None:
            continue
        found.append(
            Finding(
                rule="growth",
                severity="leak",
                message=(
                    f"GPU{device} used memory "
                    f"{_grows(slope, points[0][0], points[-1][0], series[0], series[-1])}"
                    " (device total: no process can be named)"
                ),
                remedy=(
                    "run with --pid=host or in the job's PID namespace to see which process grows"
                ),
                gpu_bytes=series[-1] - series[0],
                epoch=points[-1][0],
                device_index=device,
                bytes_per_epoch=slope,
            )
        )
    return found


def growth(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find persistent processes whose epoch-end GPU memory grows (blind: devices' totals)."""
    if not _has_nvml(timeline):
        return ()
    found = _process_growth(timeline, config)
    if timeline.attribution == "blind-namespace":
        found.extend(_device_growth(timeline, config))
    return tuple(found)


# --------------------------------------------------------------------------- host growth

# NOTE [return of shared pages]: a worker's copy-on-read copy is new memory, the worker's: its
# USS grows, its RSS stays flat. In the parent the page becomes private again, nobody sharing
# it: its USS climbs back to where it was before the fork without a byte of new memory. So a
# parent's USS rise counts only where its resident memory rises beyond the tolerance too; a
# worker's counts alone. Resident memory is ``RssAnon`` where every point has it: libraries
# paged in on first use raise RSS for epochs, and they are file-backed.

HOST_ROLES: frozenset[Role] = frozenset(("parent", "worker"))
"""Roles whose host memory the host-growth rule judges (with ``persistent`` set)."""

_HostPoints = list[tuple[EpochRecord, int]]


def _judge_host(points: _HostPoints, config: RuleConfig) -> float | None:
    return growth_slope(
        [value for _, value in points],
        config,
        epochs=[rec.index for rec, _ in points],
        tolerance_bytes=config.host_tolerance_bytes,
    )


def _resident_points(
    points: Sequence[tuple[EpochRecord, ProcessEpoch]],
) -> tuple[_HostPoints, str]:
    """Resident memory per epoch: ``RssAnon`` where every point has it, else RSS."""
    anon = [(rec, proc.anon_bytes_end) for rec, proc in points if proc.anon_bytes_end is not None]
    if anon and len(anon) == len(points):
        return [(rec, value) for rec, value in anon if value is not None], "RssAnon"
    rss = [(rec, proc.rss_bytes_end) for rec, proc in points if proc.rss_bytes_end is not None]
    return [(rec, value) for rec, value in rss if value is not None], "RSS"


def _host_growth_remedy(role: Role | None) -> str:
    if role == "parent":
        return (
            "drop what the loop keeps across epochs (outputs, losses as tensors, growing lists "
            "and caches)"
        )
    return (
        "copy-on-read: keep the dataset in numpy arrays, Arrow tables or tensors, not Python "
        "objects"
    )


def _host_growth_finding(
    chosen: _HostPoints,
    basis: str,
    slope: float,
    last: ProcessEpoch,
    note: str,
) -> Finding:
    (first_rec, first_value), (last_rec, last_value) = chosen[0], chosen[-1]
    return _process_finding(
        last,
        rule="host-growth",
        severity="leak",
        what=(
            f"host memory ({basis}) "
            f"{_grows(slope, first_rec.index, last_rec.index, first_value, last_value)}{note}"
        ),
        remedy=_host_growth_remedy(last.role),
        epoch=last_rec.index,
        bytes_per_epoch=slope,
        host_bytes=last_value - first_value,
    )


def host_growth(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find the parent and persistent workers whose host memory grows (``growth_slope``).

    On USS where read at 3 or more judged epoch ends, else on resident memory, which the
    message says; a parent's USS rise needs a resident rise too (NOTE [return of shared
    pages]). A clean verdict says where USS was not read.
    """
    found: list[Finding] = []
    unread: tuple[int, int] | None = None  # (USS reads, epoch ends) of the first clean one
    for obs in _observations(timeline).values():
        points: list[tuple[EpochRecord, ProcessEpoch]] = [
            (rec, proc)
            for rec, proc in obs
            if rec is not None and proc.persistent and proc.alive_at_end and proc.role in HOST_ROLES
        ]
        points = points[config.warmup_epochs :]
        if len(points) < 3:
            continue
        leak = _judge_host_points(points, config)
        if leak is not None:
            found.append(leak)
            continue
        uss_reads = sum(proc.host_source == "uss" for _, proc in points)
        resident_only = sum(proc.host_source == "rss" for _, proc in points)
        if resident_only and unread is None:
            unread = (uss_reads, uss_reads + resident_only)
    if unread is not None and not found:  # a clean host verdict says what it could not see
        found.append(_host_coverage_finding(*unread))
    return tuple(found)


REMEDY_PINNED_GROWTH = (
    "keep no reference to pinned batches across steps; allocate pinned buffers once, not per step"
)


def pinned_growth(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find the loop's process whose pinned host memory (torch's reserved bytes) grows.

    ``growth_slope`` over the epoch ends that read it, past the warm-up; the parent is named.
    """
    points = [(rec, rec.pinned_reserved_bytes) for rec in _sorted_epochs(timeline)]
    chosen = [(rec, value) for rec, value in points[config.warmup_epochs :] if value is not None]
    slope = growth_slope([v for _, v in chosen], config, epochs=[r.index for r, _ in chosen])
    last = chosen[-1][0] if chosen else None
    parent = next((p for p in last.processes if p.role == "parent"), None) if last else None
    if slope is None or last is None or parent is None:
        return ()
    (first, start), end = chosen[0], chosen[-1][1]
    return (
        _process_finding(
            parent,
            rule="pinned-growth",
            severity="leak",
            what=f"pinned host memory {_grows(slope, first.index, last.index, start, end)}",
            remedy=REMEDY_PINNED_GROWTH,
            epoch=last.index,
            bytes_per_epoch=slope,
            host_bytes=end - start,
        ),
    )


def _host_coverage_finding(uss_reads: int, epoch_ends: int) -> Finding:
    """A clean host verdict says where it could not see copy-on-read (NOTE [host pacing])."""
    return Finding(
        rule="host-growth",
        severity="info",
        message=(
            f"host memory was read as USS at {uss_reads} of the {epoch_ends} epoch ends judged: "
            "copy-on-read at the others can go unseen"
        ),
        remedy=(
            "for a diagnostic run, read USS at every epoch end: rollup_share=1.0 (run: "
            "--rollup-share 1)"
        ),
    )


def _judge_host_points(
    points: list[tuple[EpochRecord, ProcessEpoch]], config: RuleConfig
) -> Finding | None:
    """Judge one process's epoch-end host memory: its leak, or None."""
    uss: _HostPoints = [
        (rec, proc.host_bytes_end)
        for rec, proc in points
        if proc.host_source == "uss" and proc.host_bytes_end is not None
    ]
    rss, resident = _resident_points(points)
    last = points[-1][1]
    if len(uss) >= 3:
        slope = _judge_host(uss, config)
        if slope is None:
            return None
        note = ""
        if last.role == "parent":
            # NOTE [return of shared pages]
            span = [(r, b) for r, b in rss if uss[0][0].index <= r.index <= uss[-1][0].index]
            rss_slope = _judge_host(span, config)
            if rss_slope is None:
                return None
            slope = min(slope, rss_slope)
            note = f" ({resident} {format_mib(span[0][1])} -> {format_mib(span[-1][1])} MiB)"
        return _host_growth_finding(uss, "USS", slope, last, note)
    slope = _judge_host(rss, config)
    if slope is None:
        return None
    note = f" (USS read at {len(uss)} of these ends)"
    return _host_growth_finding(rss, resident, slope, last, note)


# --------------------------------------------------------------------------- copy-on-read

REMEDY_COPY_ON_READ = (
    "keep the dataset in numpy arrays, Arrow or tensors, not Python objects; gc.freeze() "
    "before iterating; or fewer workers"
)
REMEDY_NOT_FORKED = (
    "each holds what it unpickled (the dataset included) and imported: mmap large data, "
    "or use fewer workers"
)


@dataclass(frozen=True)
class _WorkerCopy:
    """One worker's copies over the timeline (NOTE [copy on read] in hostmem.py)."""

    proc: ProcessEpoch
    copied_bytes: int
    epoch: int
    after_s: float | None


def _private_bytes(proc: ProcessEpoch) -> int:
    """A worker's USS at the end (or exit), else at its birth; -1 where neither is known."""
    if proc.host_source == "uss" and proc.host_bytes_end is not None:
        return proc.host_bytes_end
    return -1 if proc.private_bytes_birth is None else proc.private_bytes_birth


def _copy_observations(
    timeline: Timeline,
) -> Iterable[tuple[int, ProcessEpoch]]:
    """(epoch index, worker) of every forked worker's epoch with a copy reading."""
    for rec in _sorted_epochs(timeline):
        for proc in rec.processes:
            yield rec.index, proc
    final = timeline.final
    if final is not None and final.open_epoch is not None:
        for proc in final.processes:
            yield final.open_epoch, proc


def _worker_copies(
    timeline: Timeline, config: RuleConfig
) -> tuple[dict[int, list[_WorkerCopy]], list[ProcessEpoch]]:
    """Forked workers' largest copies by parent PID, and the workers not forked."""
    copies: dict[ProcessKey, _WorkerCopy] = {}
    unforked: dict[ProcessKey, ProcessEpoch] = {}
    for index, proc in _copy_observations(timeline):
        if proc.role != "worker":
            continue
        if proc.forked is False:
            known = unforked.get(proc.key)
            if known is None or _private_bytes(proc) > _private_bytes(known):
                unforked[proc.key] = proc
            continue
        copied = proc.copied_bytes_peak
        if proc.forked is not True or copied is None:
            continue
        seen = copies.get(proc.key)
        if seen is None or (
            seen.copied_bytes <= config.copy_tolerance_bytes and copied > seen.copied_bytes
        ):
            # The first epoch above the tolerance names when; the largest copy says how much.
            copies[proc.key] = _WorkerCopy(proc, copied, index, proc.copied_over_after_s)
        elif copied > seen.copied_bytes:
            copies[proc.key] = _WorkerCopy(proc, copied, seen.epoch, seen.after_s)
    by_parent: dict[int, list[_WorkerCopy]] = {}
    for copy in copies.values():
        by_parent.setdefault(copy.proc.ppid, []).append(copy)
    return by_parent, sorted(unforked.values(), key=lambda p: p.key)


def _copy_finding(ppid: int, leaking: Sequence[_WorkerCopy]) -> Finding:
    first = min(leaking, key=lambda c: (c.epoch, c.after_s if c.after_s is not None else 0.0))
    epochs = sorted({copy.epoch for copy in leaking})
    persistent = any(copy.proc.persistent for copy in leaking)
    per_epoch: dict[int, int] = {}
    for copy in leaking:
        per_epoch[copy.epoch] = per_epoch.get(copy.epoch, 0) + copy.copied_bytes
    if persistent:
        count, total = len(leaking), sum(per_epoch.values())
    else:  # a generation of workers per epoch: one epoch's
        count = max(sum(c.epoch == e for c in leaking) for e in epochs)
        total = max(per_epoch.values())
    mean = sum(c.copied_bytes for c in leaking) / len(leaking)
    when = f"in epoch {first.epoch}"
    if first.after_s is not None:
        when = f"{first.after_s:.1f} s into epoch {first.epoch}"
    if not persistent and len(epochs) > 2:
        when += f" and again in epochs {epochs[1]}-{epochs[-1]}"
    elif not persistent and len(epochs) == 2:
        when += f" and again in epoch {epochs[1]}"
    elif not persistent:
        when += " (per-epoch workers copy it again each epoch)"
    if count == 1:
        who = f"1 forked worker of PID {ppid} copied {format_mib(mean)} MiB of its parent's memory"
    else:
        who = (
            f"{count} forked workers of PID {ppid} each copied {format_mib(mean)} MiB of their "
            f"parent's memory ({format_mib(total)} MiB in all)"
        )
    worst = max(leaking, key=lambda c: c.copied_bytes)
    return _process_finding(
        worst.proc,
        rule="copy-on-read",
        severity="leak",
        message=f"{who}, {when}",
        remedy=REMEDY_COPY_ON_READ,
        epoch=first.epoch,
        host_bytes=total,
    )


def _not_forked_finding(workers: Sequence[ProcessEpoch]) -> Finding:
    held = [_private_bytes(p) for p in workers if _private_bytes(p) >= 0]
    mean = f"; each holds {format_mib(sum(held) / len(held))} MiB of its own" if held else ""
    who = "1 worker" if len(workers) == 1 else f"{len(workers)} workers"
    return _process_finding(
        workers[0],
        rule="copy-on-read",
        severity="info",
        message=(
            f"copy-on-read cannot be told for {who} started by spawn or forkserver: they "
            f"share no memory with the training process{mean}"
        ),
        remedy=REMEDY_NOT_FORKED,
        host_bytes=sum(held) if held else None,
    )


def copy_on_read(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find forked workers that copied more of their parent's memory than the copy tolerance.

    One finding per parent (loader), from any reading (NOTE [copy on read] in hostmem.py);
    one info finding for spawned workers, where it cannot be told.
    """
    by_parent, spawned = _worker_copies(timeline, config)
    found: list[Finding] = []
    for ppid, copies in sorted(by_parent.items()):
        leaking = [c for c in copies if c.copied_bytes > config.copy_tolerance_bytes]
        if leaking:
            found.append(_copy_finding(ppid, leaking))
    if spawned:
        found.append(_not_forked_finding(spawned))
    return tuple(found)


# --------------------------------------------------------------------------- residual


CONTEXT_OVERHEAD_BYTES = 8 * MIB
"""Device memory a live CUDA context uses beyond what NVML lists under its PID: the
residual rule allows this much per holder (the figure behind it is in
benchmarks/results/README.md)."""


def _device_residual(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find device memory above the baseline after the work that the job does not explain."""
    final = timeline.final
    if final is None or not _has_nvml(timeline):
        return ()
    baseline = {dev.index: dev for dev in timeline.baseline_devices}
    lineage = [p for p in final.processes if p.role in LINEAGE_ROLES]
    foreign = [p for p in final.processes if p.role == "foreign"]
    unknown_lineage = [p for p in lineage if p.gpu_bytes_unknown]
    found: list[Finding] = []
    for dev in sorted(final.devices, key=lambda d: d.index):
        base = baseline.get(dev.index)
        if base is None:
            continue
        rise = dev.used_bytes - base.used_bytes
        explained = sum(p.gpu_bytes_end.get(dev.index, 0) for p in lineage)
        explained += final.others_gpu_bytes.get(dev.index, 0)
        explained -= timeline.baseline_gpu_bytes.get(dev.index, 0)
        unexplained = rise - explained
        holders_here = sum(1 for p in (*lineage, *foreign) if p.gpu_bytes_end.get(dev.index, 0) > 0)
        if unexplained <= config.tolerance_bytes + holders_here * CONTEXT_OVERHEAD_BYTES:
            continue
        holders = [
            p for p in foreign if p.gpu_bytes_end.get(dev.index, 0) > 0 or p.gpu_bytes_unknown
        ]
        if holders:
            held = [
                f"{culprit('foreign', p.key.pid, p.cmdline, width=32)} "
                + (
                    f"{format_mib(p.gpu_bytes_end[dev.index])} MiB"
                    if dev.index in p.gpu_bytes_end
                    else "? MiB"
                )
                for p in holders[:2]
            ]
            more = f" and {len(holders) - 2} more" if len(holders) > 2 else ""
            who = f"; held by {', '.join(held)}{more}"
            remedy = (
                "stop it if it is yours (an escaped child, another run), or use an idle GPU "
                "(CUDA_VISIBLE_DEVICES)"
            )
        elif timeline.attribution == "blind-namespace":
            who = "; no process can be named (PIDs of another PID namespace)"
            remedy = "run with --pid=host or in the job's PID namespace to name the holder"
        else:
            who = "; no visible process holds it"
            remedy = (
                "check again with `leakcheck snapshot` in a few seconds (a context may still be "
                "closing)"
            )
        # NOTE: without per-process byte counts (MIG, vGPU) the job's share cannot be
        # subtracted, so the rise is reported as advice, not as a leak.
        if unknown_lineage:
            who += "; the job's own bytes are unknown (MIG/vGPU)"
        found.append(
            Finding(
                rule="residual",
                severity="info" if unknown_lineage else "leak",
                message=(
                    f"GPU{dev.index} uses {format_mib(rise)} MiB more than at the start, "
                    f"{format_mib(unexplained)} MiB of it not held by the job{who}"
                ),
                remedy=remedy,
                pid=holders[0].key.pid if len(holders) == 1 else None,
                start_ticks=holders[0].key.start_ticks if len(holders) == 1 else None,
                role="foreign" if len(holders) == 1 else None,
                cmdline=holders[0].cmdline if len(holders) == 1 else None,
                gpu_bytes=unexplained,
                device_index=dev.index,
            )
        )
    return tuple(found)


REMEDY_KEPT_TENSORS = (
    "drop references to CUDA tensors the work keeps (module-level lists, caches, stored exceptions)"
)
REMEDY_DRIVER_MEMORY = (
    "free GPU memory the work allocates outside torch (library pools), or raise the tolerance"
)


def _parent_residual(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Judge the parent's own GPU memory after the work (``Timeline.parent_memory``)."""
    memory = timeline.parent_memory
    if memory is None:
        return ()
    root = timeline.root
    cmdline = next(
        (p.cmdline for rec in timeline.epochs for p in rec.processes if p.key == root), None
    )
    scopes = f" after the teardown of {', '.join(memory.scopes)}" if memory.scopes else ""
    who = culprit("parent", root.pid, cmdline)

    def finding(
        held: dict[int, int], severity: Severity, what: str, remedy: str, scope: str | None = None
    ) -> Finding:
        return Finding(
            rule="residual",
            severity=severity,
            message=f"{who} {what}",
            remedy=remedy,
            pid=root.pid,
            start_ticks=root.start_ticks,
            role="parent",
            cmdline=cmdline,
            gpu_bytes=sum(held.values()),
            device_index=min(held) if len(held) == 1 else None,
            scope=scope,
        )

    found: list[Finding] = []
    kept = {d: b for d, b in memory.kept_tensor_bytes.items() if b > config.tolerance_bytes}
    if kept:
        found.append(
            finding(
                kept,
                "leak",
                f"still holds {_devices_text(kept)} of CUDA tensors more than at the start{scopes}",
                REMEDY_SCOPE if memory.scopes else REMEDY_KEPT_TENSORS,
                ", ".join(memory.scopes) or None,
            )
        )
    grown = {d: b for d, b in memory.driver_bytes.items() if b > config.tolerance_bytes}
    if grown:
        first_use = " (or kernels loaded on first use)" if memory.torch_in_use else ""
        found.append(
            finding(
                grown,
                "info" if memory.torch_in_use else "leak",
                f"holds {_devices_text(grown)} more than at the start outside torch's "
                f"allocator{first_use}",
                REMEDY_DRIVER_MEMORY,
            )
        )
    return tuple(found)


def residual(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find GPU memory left after the work: on devices, and the parent's (``parent_memory``)."""
    return _device_residual(timeline, config) + _parent_residual(timeline, config)


# --------------------------------------------------------------------------- shm

_SHM_CAUSES: tuple[tuple[str, str, str], ...] = (
    (
        "cuda.shm.",
        "CUDA IPC: workers returned CUDA tensors",
        "return CPU tensors from workers and move them to the GPU in the main process",
    ),
    (
        "torch_",
        "a torch shared tensor (file_system sharing)",
        "let the loader's iterators finish or `del` them, so their workers free their segments",
    ),
    (
        "psm_",
        "a SharedMemory never unlinked",
        "call unlink() on the SharedMemory that made it (close() alone leaves the file)",
    ),
    (
        "nccl-",
        "NCCL's: a process group not destroyed",
        "call torch.distributed.destroy_process_group() when the work ends",
    ),
)
_SHM_NOT_OURS = (
    "its name does not say who made it",
    "nothing to do if another job made it; if the work did, unlink it when done (os.unlink)",
)
_SHM_OWN_REMEDY = "unlink the shared memory the work creates (SharedMemory.unlink(), os.unlink)"


def _shm_cause(name: str) -> tuple[str, str]:
    """Why a /dev/shm file exists, from its name, and what to do about it."""
    for prefix, cause, remedy in _SHM_CAUSES:
        if name.startswith(prefix):
            return cause, remedy
    return "shared memory the work created itself", _SHM_OWN_REMEDY


def _size_text(num_bytes: int) -> str:
    if num_bytes >= MIB:
        return f"{format_mib(num_bytes)} MiB"
    if num_bytes >= 1024:
        return f"{num_bytes / 1024:.0f} KiB"
    return f"{num_bytes} B"


def _shm_finding(item: ShmFile) -> Finding:
    cause, remedy = _shm_cause(item.name)
    severity: Severity = "leak"
    who = ""
    if item.holder_pid is not None:
        who = "the parent" if item.holder_role == "parent" else f"PID {item.holder_pid}"
    if item.scope is not None:
        where = f"made while {item.scope} was set up, still there after its teardown"
        remedy = REMEDY_SCOPE
    elif item.in_use:
        # The tracker closed while the job goes on: its holder may still use it, and may
        # remove it later. Said, not blamed.
        severity = "info"
        where = f"still there as tracking ended, held by {who}"
    elif item.holder_pid is not None:
        where = f"left behind, still held by {who}"
    elif item.attributable:
        where = "left behind, held by nobody"
    elif item.made_by_older is not None:
        severity = "info"
        where = f"appeared during the work, made by PID {item.made_by_older}, older than the work"
        remedy = f"nothing to do for this work: PID {item.made_by_older} (or its job) removes it"
    else:
        severity = "info"
        where = "appeared during the work; nothing ties it to the work and other jobs ran"
        if remedy == _SHM_OWN_REMEDY:  # "the work created itself" is what is not known here
            cause, remedy = _SHM_NOT_OURS
    return Finding(
        rule="shm",
        severity=severity,
        message=f"/dev/shm/{item.name} ({_size_text(item.size_bytes)}) {where}: {cause}",
        remedy=remedy,
        pid=item.holder_pid,
        role=item.holder_role,
        scope=item.scope,
        shm_name=item.name,
        size_bytes=item.size_bytes,
    )


REMEDY_SHM_CAPACITY = "give the job more shared memory (docker run --shm-size=8g or --ipc=host)"


def _shm_capacity(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Capacity pressure: the epoch whose /dev/shm use came nearest the filesystem's size."""
    worst: tuple[float, EpochRecord] | None = None
    for rec in _sorted_epochs(timeline):
        total, used = rec.shm_total_bytes, rec.shm_used_peak_bytes
        if not total or used is None:
            continue
        fraction = used / total
        if fraction >= config.shm_pressure_fraction and (worst is None or fraction > worst[0]):
            worst = (fraction, rec)
    if worst is None:
        return ()
    fraction, rec = worst
    assert rec.shm_total_bytes is not None and rec.shm_used_peak_bytes is not None
    job = f", the job's files {_size_text(rec.shm_bytes)}" if rec.shm_bytes is not None else ""
    return (
        Finding(
            rule="shm",
            severity="info",
            message=(
                f"/dev/shm was {fraction:.0%} full during {rec.label} "
                f"({_size_text(rec.shm_used_peak_bytes)} of "
                f"{_size_text(rec.shm_total_bytes)}{job}): a batch fails or a worker dies of a "
                "bus error when it fills"
            ),
            remedy=REMEDY_SHM_CAPACITY,
            epoch=rec.index,
            size_bytes=rec.shm_used_peak_bytes,
        ),
    )


def shm(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Report the ``/dev/shm`` files left behind, and the epoch nearest to filling it."""
    left = tuple(_shm_finding(item) for item in timeline.shm_files)
    return left + _shm_capacity(timeline, config)


# --------------------------------------------------------------------------- infos


def blind(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Say plainly when NVML's PIDs belong to another PID namespace."""
    del config
    if timeline.attribution != "blind-namespace":
        return ()
    reason = f" ({timeline.attribution_reason})" if timeline.attribution_reason else ""
    return (
        Finding(
            rule="blind",
            severity="info",
            message=(
                f"NVML reports PIDs of another PID namespace{reason}: only device totals are judged"
            ),
            remedy="run with --pid=host (docker) or inside the job's PID namespace",
        ),
    )


def _outlives_the_work(timeline: Timeline, rec: EpochRecord | None, proc: ProcessEpoch) -> bool:
    """A process that stays past the work that started it: where held descriptors matter."""
    if proc.role == "orphan":
        return True
    if rec is None:
        return timeline.final is not None and timeline.final.closed
    return proc.role == "descendant" and proc.alive_at_end


def descriptor_holder(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Note processes outliving the work with ``/dev/nvidia*`` fds but no GPU memory."""
    del config
    if not per_pid_bytes_known(timeline):
        # Without per-PID bytes every process looks memory-free; the rule would guess.
        return ()
    found: list[Finding] = []
    for obs in _observations(timeline).values():
        for rec, proc in obs:
            if (
                proc.role not in ("worker", "descendant", "orphan")
                or (rec is not None and not proc.alive_at_end)
                or not proc.nvidia_fds
                or proc.gpu_bytes_unknown
                or any(b > 0 for b in proc.gpu_bytes_end.values())
                or not _outlives_the_work(timeline, rec, proc)
            ):
                continue
            where = f"at the end of {rec.label}" if rec is not None else "after the work"
            found.append(
                _process_finding(
                    proc,
                    rule="descriptor-holder",
                    severity="info",
                    what=(
                        # No count: the processes of one cause share one line (the JSON
                        # has each one's `nvidia_fds`).
                        f"holds /dev/nvidia* fds but no GPU memory {where}: forked from a "
                        "parent that used CUDA"
                    ),
                    remedy="start workers with multiprocessing_context='spawn' or 'forkserver'",
                    gpu_bytes=0,
                    epoch=rec.index if rec is not None else None,
                    nvidia_fds=proc.nvidia_fds,
                )
            )
            break
    return tuple(found)


def context_kept(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Note a parent that keeps its CUDA context, with no tensors, after the work ended."""
    del config
    final = timeline.final
    if (
        final is None
        or not final.closed
        or not per_pid_bytes_known(timeline)
        or final.parent_allocated_gpu_bytes != 0
    ):
        return ()
    found: list[Finding] = []
    for proc in final.processes:
        if proc.role != "parent" or proc.total_gpu_bytes_end <= 0:
            continue
        found.append(
            _process_finding(
                proc,
                rule="context-kept",
                severity="info",
                what=(
                    f"keeps its CUDA context ({_devices_text(proc.gpu_bytes_end)}) after the "
                    "work, with no tensors allocated"
                ),
                remedy="harmless (freed at exit); leakcheck.release_device() frees it sooner",
                gpu_bytes=proc.total_gpu_bytes_end,
                nvidia_fds=proc.nvidia_fds,
            )
        )
    return tuple(found)


# --------------------------------------------------------------------------- device mismatch

REMEDY_DEVICE_MISMATCH = (
    "call torch.cuda.set_device(LOCAL_RANK) before anything in the rank touches CUDA"
)


def _known_devices(timeline: Timeline) -> set[int]:
    """The NVML indices of every device the timeline read (empty: none read)."""
    states = [*timeline.baseline_devices, *(d for e in timeline.epochs for d in e.devices)]
    if timeline.final is not None:
        states.extend(timeline.final.devices)
    return {state.index for state in states}


def _own_device(timeline: Timeline, proc: ProcessEpoch, known: set[int]) -> int | None:
    """The GPU a process's rank trains on: the rank's own record, else its environment."""
    if proc.rank is None:
        return None
    recorded = timeline.rank_devices.get(proc.rank)
    if recorded is not None:
        return recorded
    device = proc.rank_device
    if device is None or (known and device not in known):
        return None
    return device


def device_mismatch(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Find processes of a rank holding more than the tolerance on a GPU not their rank's.

    Usually a bare ``cuda:0`` before ``set_device``. One finding per process and device,
    with the most held there; a process whose rank's device is unknown is not judged.
    """
    if not per_pid_bytes_known(timeline):
        return ()
    found: list[Finding] = []
    known = _known_devices(timeline)
    for obs in _observations(timeline).values():
        held: dict[int, int] = {}
        first: dict[int, tuple[EpochRecord | None, ProcessEpoch]] = {}
        own: int | None = None
        for rec, proc in obs:
            if proc.role not in LINEAGE_ROLES:
                continue
            device = _own_device(timeline, proc, known)
            if device is None:
                continue
            own = device
            for index, used in (*proc.gpu_bytes_end.items(), *proc.gpu_bytes_peak.items()):
                if index == device or used <= config.tolerance_bytes:
                    continue
                if used > held.get(index, 0):
                    held[index] = used
                first.setdefault(index, (rec, proc))
        for index, used in sorted(held.items()):
            rec, proc = first[index]
            where = f"in {rec.label}" if rec is not None else "after the job"
            found.append(
                _process_finding(
                    proc,
                    rule="device-mismatch",
                    severity="leak",
                    what=(
                        f"holds GPU{index} {format_mib(used)} MiB {where}, but rank {proc.rank} "
                        f"trains on GPU{own}"
                    ),
                    remedy=REMEDY_DEVICE_MISMATCH,
                    gpu_bytes=used,
                    epoch=rec.index if rec is not None else None,
                    device_index=index,
                    nvidia_fds=proc.nvidia_fds,
                    scope=proc.scope,
                )
            )
    return tuple(found)


def _telemetry_text(dev: DeviceState) -> str:
    parts: list[str] = []
    if dev.temperature_c is not None:
        parts.append(f"{dev.temperature_c} C")
    if dev.power_w is not None:
        parts.append(f"{dev.power_w:.0f} W")
    return ", " + ", ".join(parts) if parts else ""


def high_clocks(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Note a device left at high SM clocks after the work ended, with no job memory."""
    final = timeline.final
    if final is None or not final.closed or not _has_nvml(timeline):
        return ()
    lineage = [p for p in final.processes if p.role in LINEAGE_ROLES]
    found: list[Finding] = []
    for dev in sorted(final.devices, key=lambda d: d.index):
        clock, clock_max = dev.sm_clock_mhz, dev.sm_clock_max_mhz
        if clock is None or not clock_max or clock < config.high_clock_fraction * clock_max:
            continue
        if any(p.gpu_bytes_end.get(dev.index, 0) > 0 for p in lineage):
            continue
        found.append(
            Finding(
                rule="high-clocks",
                severity="info",
                message=(
                    f"GPU{dev.index} SM clock stays at {clock} of {clock_max} MHz after work "
                    f"ended{_telemetry_text(dev)}"
                ),
                remedy=(
                    "wait before timing the next run (leakcheck sweep --cooldown-temp C waits for "
                    "it)"
                ),
                device_index=dev.index,
            )
        )
    return tuple(found)


def tracker_failure(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Report each failure leakcheck recorded while sampling, one finding each."""
    del config
    return tuple(
        Finding(
            rule="tracker-failure",
            severity="info",
            message=f"leakcheck's own sampling failed: {' '.join(failure.split())}",
            remedy="rerun with strict=True to see the traceback, and report it as a leakcheck bug",
        )
        for failure in timeline.failures
    )


REMEDY_FD_PRESSURE = (
    "raise it (ulimit -n 65536), or torch.multiprocessing.set_sharing_strategy('file_system')"
)


def fd_pressure(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Note processes whose open descriptors reached the pressure share of their limit.

    A DataLoader's default sharing strategy passes each shared tensor as a descriptor: at the
    limit, "Too many open files" or "received 0 items of ancdata". Read at epoch ends only.
    """
    found: list[Finding] = []
    for obs in _observations(timeline).values():
        shares = [(p.open_fds / p.fd_limit, rec, p) for rec, p in obs if p.open_fds and p.fd_limit]
        if not shares:
            continue
        share, rec, proc = max(shares, key=lambda item: item[0])
        if share < config.fd_pressure_fraction:
            continue
        when = f"at the end of epoch {rec.index}" if rec is not None else "after the work"
        found.append(
            _process_finding(
                proc,
                rule="fd-pressure",
                severity="info",
                what=(
                    f"held {proc.open_fds} open descriptors of its limit {proc.fd_limit} "
                    f"({share:.0%}) {when}"
                ),
                remedy=REMEDY_FD_PRESSURE,
                epoch=rec.index if rec is not None else None,
            )
        )
    return tuple(found)


# --------------------------------------------------------------------------- judge

RuleFunction = Callable[[Timeline, RuleConfig], tuple[Finding, ...]]

RULES: Mapping[Rule, RuleFunction] = {
    "survivor": survivor,
    "orphan": orphan,
    "growth": growth,
    "host-growth": host_growth,
    "copy-on-read": copy_on_read,
    "residual": residual,
    "blind": blind,
    "descriptor-holder": descriptor_holder,
    "context-kept": context_kept,
    "high-clocks": high_clocks,
    "tracker-failure": tracker_failure,
    "shm": shm,
    "device-mismatch": device_mismatch,
    "died": died,
    "fd-pressure": fd_pressure,
    "hang": hang,
    "pinned-growth": pinned_growth,
    "shutdown-hang": shutdown_hang,
}
"""Every rule by name, in report order for ties."""

_RULE_ORDER: dict[Rule, int] = {name: i for i, name in enumerate(RULES)}


def _sort_key(finding: Finding) -> tuple[int, bool, int, bool, int, int]:
    return (
        0 if finding.severity == "leak" else 1,
        finding.epoch is None,
        finding.epoch if finding.epoch is not None else 0,
        finding.pid is None,
        finding.pid if finding.pid is not None else 0,
        _RULE_ORDER[finding.rule],
    )


def judge(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Run every rule; the findings leaks first, then by epoch, then PID.

    An orphan is not also a survivor (nobody will reap it); a process's start is shown as a
    Unix time where the boot time is known.
    """
    findings: list[Finding] = []
    for rule in RULES.values():
        findings.extend(rule(timeline, config))
    orphans = {(f.pid, f.start_ticks) for f in findings if f.rule == "orphan"}
    findings = [
        _shown(f, timeline.boot_unix_s)
        for f in findings
        if not (f.rule == "survivor" and (f.pid, f.start_ticks) in orphans)
    ]
    return tuple(sorted(findings, key=_sort_key))


def _shown(finding: Finding, boot_unix_s: float | None) -> Finding:
    """``finding`` with its culprit's ``create_time``, for people, where it can be derived."""
    if finding.start_ticks is None or boot_unix_s is None:
        return finding
    return replace(finding, create_time=create_time_s(finding.start_ticks, boot_unix_s))
