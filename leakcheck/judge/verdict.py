"""Leak rules: pure functions ``rule(timeline, config) -> tuple[Finding, ...]``, no I/O, no clock.

``judge`` runs them all and orders the findings; the rules on processes read one walk (``_Walk``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from leakcheck.core.model import (
    MIB,
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
from leakcheck.core.units import format_mib, plural
from leakcheck.judge.deaths import died, hang, shutdown_hang
from leakcheck.observe.procs import create_time_s

LINEAGE_ROLES: frozenset[Role] = frozenset(("parent", "worker", "descendant", "orphan"))
"""Roles of processes that belong to the watched job (everything but ``foreign``)."""

_CHILD_ROLES = ("worker", "descendant", "orphan")

# NOTE [late rise]: a leak keeps growing; allocator warm-up grows, then plateaus: at least this
# share of the total rise must happen in the series' second half.
_LATE_RISE_SHARE = 0.25
GROWTH_POINTS = 3  # the fewest judged epoch ends a growth rule reads a slope from

RuleFunction = Callable[[Timeline, RuleConfig], tuple[Finding, ...]]


def _rule(find: Callable[[Timeline, RuleConfig], Iterator[Finding]]) -> RuleFunction:
    """A rule from a generator of its findings."""

    @functools.wraps(find)
    def rule(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
        return tuple(find(timeline, config))

    return rule


def per_pid_bytes_known(timeline: Timeline) -> bool:
    """Tell whether NVML's per-process bytes match this namespace's PIDs."""
    return timeline.attribution == "ok"


def _has_nvml(timeline: Timeline) -> bool:
    return timeline.attribution not in ("nvml-unavailable", "no-gpu")


# NOTE [one line per finding]: a finding's ``message`` is one line of at most about 160
# characters, ``<culprit> <what>`` for one process (``names.culprit``), then how much and
# since when, so ``report.finding_lines`` can group one cause by what follows the culprit;
# its ``remedy`` is one fix of at most about 120. ``leakcheck explain RULE`` tells the rest.


def _finding(
    rule: Rule, severity: Severity, message: str, remedy: str, proc: ProcessEpoch | None = None,
    *, named: bool = True, **fields: Any,
) -> Finding:
    """A finding; about ``proc`` where given: its identity whole, its culprit before ``message``."""
    if proc is not None:
        if named:
            who = culprit(proc.role, proc.key.pid, proc.cmdline, rank=proc.rank, rule=rule)
            message = f"{who} {message}"
        identity = {"pid": proc.key.pid, "start_ticks": proc.key.start_ticks, "role": proc.role}
        fields = {**identity, "cmdline": proc.cmdline, "rank": proc.rank, **fields}
    return Finding(rule=rule, severity=severity, message=message, remedy=remedy, **fields)


def _devices_text(gpu_bytes: Mapping[int, int]) -> str:
    """``GPU0 612 MiB, GPU1 2.0 MiB`` for the devices holding memory."""
    parts = [f"GPU{d} {format_mib(b)} MiB" for d, b in sorted(gpu_bytes.items()) if b > 0]
    return ", ".join(parts)


def _holding(procs: Iterable[ProcessEpoch], bytes_known: bool) -> tuple[str, dict[str, Any]]:
    """``; holds GPU0 612 MiB, 3 /dev/nvidia* fds``: the most seen, and those fields."""
    held: dict[int, int] = {}
    fds: int | None = None
    for proc in procs:
        for device, used in proc.gpu_bytes_end.items():
            held[device] = max(held.get(device, 0), used)
        if proc.nvidia_fds is not None:
            fds = max(fds or 0, proc.nvidia_fds)
    parts = [_devices_text(held)] if bytes_known and _devices_text(held) else []
    if fds:
        parts.append(f"{fds} /dev/nvidia* fds")
    fields = {"gpu_bytes": sum(held.values()) if bytes_known else None, "nvidia_fds": fds}
    return ("; holds " + ", ".join(parts) if parts else ""), fields


_Seen = tuple[EpochRecord | None, ProcessEpoch]
"""One observation: a process at an epoch's end (its record), or in the final state (None)."""


@dataclass(frozen=True)
class _Walk:
    """Every observation of every identity: epochs in index order, then the final state."""

    timeline: Timeline
    ordered: list[EpochRecord]
    by_index: dict[int, EpochRecord]
    seen: dict[ProcessKey, list[_Seen]]

    @classmethod
    def of(cls, timeline: Timeline) -> _Walk:
        ordered = sorted(timeline.epochs, key=lambda rec: rec.index)
        seen: dict[ProcessKey, list[_Seen]] = {}
        for rec in ordered:
            for proc in rec.processes:
                seen.setdefault(proc.key, []).append((rec, proc))
        if timeline.final is not None:
            for proc in timeline.final.processes:
                seen.setdefault(proc.key, []).append((None, proc))
        return cls(timeline, ordered, {rec.index: rec for rec in ordered}, seen)

    def birth(self, obs: Sequence[_Seen]) -> EpochRecord | None:
        """The epoch a process was born in: by its create time, else where first seen born."""
        born = next((p.born_epoch for _, p in obs if p.born_epoch is not None), None)
        if born is None:
            born = next((r.index for r, p in obs if r is not None and p.born_in_epoch), None)
        return self.by_index.get(born) if born is not None else None

    def alive_after_s(self, birth: EpochRecord, obs: Sequence[_Seen]) -> float | None:
        """Longest time after ``birth`` ended at which the process was seen alive."""
        final = self.timeline.final
        times: list[float] = []
        for rec, proc in obs:
            seen_s = proc.last_seen_after_s
            if rec is None:
                if final is not None and final.time_s >= birth.end_s:
                    times.append(final.time_s - birth.end_s)
            elif rec.index == birth.index:
                if proc.alive_at_end:  # alive at end_s, which is stamped after the end sample
                    seen_s = max(0.0, seen_s or 0.0)
                if seen_s is not None:
                    times.append(seen_s)
            elif rec.index > birth.index and proc.alive_at_end:
                times.append(rec.end_s - birth.end_s + max(0.0, seen_s or 0.0))
        return max(times) if times else None

    def outside_tree(self, obs: Sequence[_Seen], birth: EpochRecord | None) -> list[EpochRecord]:
        """The epochs at whose end a process of the job was alive and outside its tree."""
        start = birth or next((r for r, p in obs if r is not None and p.alive_at_end), None)
        after_s = self.alive_after_s(start, obs) if start is not None else None
        if start is None or after_s is None:
            return []
        in_tree = {rec.index for rec, proc in obs if rec is not None and proc.role != "orphan"}
        during = [rec for rec in self.ordered if start.end_s <= rec.end_s <= start.end_s + after_s]
        return [rec for rec in during if rec.index not in in_tree]


def _past_grace(after_s: float | None, grace_s: float) -> bool:
    """Seen alive later than the grace after an epoch's end (``_Walk.alive_after_s``)."""
    # Strictly: with a grace of 0, the end's own sample seeing it alive is not outliving.
    return after_s is not None and after_s > grace_s


def _daemonized(proc: ProcessEpoch) -> bool:
    """A helper that daemonizes by design (``roles.DAEMON_HELPERS``): no orphan rule's."""
    return proc.persistent and is_daemon_helper(proc.cmdline)


def _worker_pids(obs: Sequence[_Seen]) -> set[int]:
    """The workers of the epochs a process was seen in (its parent may be one of them)."""
    return {
        p.key.pid for rec, _ in obs if rec is not None for p in rec.processes if p.role == "worker"
    }


@dataclass(frozen=True)
class EpochCounts:
    """What an epoch's end left running, in hindsight of every later observation."""

    alive_after: int = 0  # non-persistent processes it started, alive past the grace or the job
    orphans: int = 0  # the job's reparented processes alive at its end, outside its tree


def epoch_counts(timeline: Timeline, grace_s: float) -> dict[int, EpochCounts]:
    """``EpochCounts`` for every epoch of ``timeline``, by index."""
    walk = _Walk.of(timeline)
    final_closed = timeline.final is not None and timeline.final.closed
    alive: dict[int, int] = dict.fromkeys(walk.by_index, 0)
    orphans: dict[int, int] = dict.fromkeys(walk.by_index, 0)
    for obs in walk.seen.values():
        procs = [proc for _, proc in obs]
        if not any(proc.role in _CHILD_ROLES for proc in procs):
            continue
        birth = walk.birth(obs)
        if birth is not None:
            # Alive when the job ended counts too: the orphan rule names what outlived the
            # job whether or not the grace had passed by then.
            outlived = _past_grace(walk.alive_after_s(birth, obs), grace_s)
            outlived = outlived or (obs[-1][0] is None and final_closed)
            if outlived and not any(p.persistent for p in procs):
                alive[birth.index] += 1
        if any(p.role == "orphan" for p in procs) and not any(map(_daemonized, procs)):
            for rec in walk.outside_tree(obs, birth):
                orphans[rec.index] += 1
    return {index: EpochCounts(alive[index], orphans[index]) for index in walk.by_index}


REMEDY_SCOPE = (
    "stop it in the fixture's finalizer (after its yield; tearDownClass for setUpClass), or give "
    "the fixture a narrower scope"
)
REMEDY_WORKER_CHILD = "join or terminate it within the epoch, in the worker code that starts it"
REMEDY_GROWTH_PARENT = (
    "drop tensors kept across epochs: accumulate loss.item(), not loss; clear lists of outputs"
)
REMEDY_GROWTH_WORKER = (
    "keep worker-side caches on the CPU (move batches to the GPU in the main process), or bound "
    "them"
)
REMEDY_HOST_PARENT = (
    "drop what the loop keeps across epochs (outputs, losses as tensors, growing lists and caches)"
)
REMEDY_HOST_WORKER = (
    "copy-on-read: keep the dataset in numpy arrays, Arrow tables or tensors, not Python objects"
)
# Resident memory does not grow by copy-on-read: what grows there, the worker allocated.
REMEDY_HOST_WORKER_RESIDENT = "bound what the worker keeps across epochs (caches, growing lists)"


def _survivor_remedy(proc: ProcessEpoch, workers: Iterable[int]) -> str:
    if proc.freed_by_gc:
        return (
            "break the reference cycle that keeps the loader's iterator alive, or `del` it and "
            "gc.collect()"
        )
    if proc.scope is not None:
        return REMEDY_SCOPE
    if proc.role == "descendant" and proc.ppid in workers:
        # Under a live (persistent) worker; an orphan once that exits: one cause, one fix.
        return REMEDY_WORKER_CHILD
    if proc.role == "worker":
        return "end each epoch's iterator (exhaust or `del` it), or set persistent_workers=True"
    return (
        "join or terminate the processes and pools the work starts (`with Pool(...)`, proc.join())"
    )


@_rule
def survivor(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find processes born in an epoch, not persistent, alive past its end plus the grace."""
    walk = _Walk.of(timeline)
    for obs in walk.seen.values():
        for rec, proc in obs:
            if rec is None or proc.persistent or not (proc.born_in_epoch and proc.alive_at_end):
                continue
            if proc.role not in ("worker", "descendant"):
                continue
            # The grace counts from the end of the epoch it was born in, which the table's
            # `alive after` and the finding's "started in" name too; a helper found epochs
            # late was placed where found (NOTE [born epoch] in track/sampler.py).
            born = walk.birth(obs) or rec
            # Evidence only: seen alive once the grace had passed. A process last seen within
            # the grace and found gone after it exited somewhere in between, unknown where.
            alive_after = walk.alive_after_s(born, obs)
            if not _past_grace(alive_after, config.grace_s):
                continue
            later = (p for r, p in obs if r is None or r.index >= born.index)
            holds, held = _holding(later, per_pid_bytes_known(timeline))
            origin = f"first seen in {born.label}"
            if proc.scope is not None:
                origin = f"started by {proc.scope}"
            elif proc.born_epoch in walk.by_index:
                origin = f"started in {walk.by_index[proc.born_epoch].label}"
            ended = born.label if proc.scope is not None else "it"  # "started in <it>"
            cycle = "; kept by a reference cycle" if proc.freed_by_gc else ""
            what = f"{origin}, alive {alive_after:.1f} s after {ended} ended{holds}{cycle}"
            remedy = _survivor_remedy(proc, _worker_pids(obs))
            yield _finding(
                "survivor", "leak", what, remedy, proc, epoch=born.index, scope=proc.scope, **held
            )
            break


@_rule
def orphan(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find lineage processes reparented away from the job and alive past the grace, once each."""
    walk = _Walk.of(timeline)
    after_job = timeline.final is None or timeline.final.closed
    for obs in walk.seen.values():
        # A helper that daemonizes by design and pins nothing on the GPU (persistent: torch's
        # shared-memory manager) is a baseline, as for the survivor rule.
        orphaned = [
            (rec, p)
            for rec, p in obs
            if p.role == "orphan" and not _daemonized(p) and (rec is None or p.alive_at_end)
        ]
        if not orphaned:
            continue
        if all(proc.persistent for _, proc in orphaned) and not _past_grace(
            max(proc.last_seen_after_s or 0.0 for _, proc in orphaned), config.grace_s
        ):
            continue  # a runtime helper on its way out with its owner, not seen past the grace
        first_rec, last = orphaned[0][0], orphaned[-1][1]
        ends = [rec.end_s + (p.last_seen_after_s or 0.0) for rec, p in orphaned if rec is not None]
        seen_s = max(ends) - first_rec.end_s if first_rec and len(ends) == len(orphaned) else None
        if seen_s is not None and not _past_grace(seen_s, config.grace_s):
            continue  # not seen alive long enough to tell: judged later, or at close
        birth = walk.birth(obs)
        left = walk.outside_tree(obs, birth) if birth else []
        since, still = "", ""
        if orphaned[-1][0] is None:
            still = ", alive after the job" if after_job else ", alive now"
        if left:
            # The epoch it left the tree in; leakcheck run's whole-program "epoch" says
            # nothing a reader could use.
            since = f" since {left[0].label}" if left[0].label != "program" else ""
        elif first_rec is not None:
            # Birth unknown: only that it had left by the epoch a scan found it outside in.
            since = f" by {first_rec.label}"
        elif after_job:  # seen only after the job
            since, still = " after the job", ", still alive"
        workers = _worker_pids(obs)
        under_worker = any(p.ppid in workers for _, p in obs if p.role != "orphan")
        started = ""
        if last.scope is not None:
            started = f"started by {last.scope}, "
        elif birth is not None and (not left or left[0].index != birth.index):
            started = f"started in {birth.label}, "  # "since" names another epoch, or none
        holds, held = _holding((p for _, p in orphaned), per_pid_bytes_known(timeline))
        parent = "worker" if under_worker else "parent"
        what = f"{started}outlived its {parent}{since}{still}{holds}"
        remedy = f"leakcheck.worker_init_fn(terminate_children=True), or kill {last.key.pid}"
        epoch = left[0].index if left else (first_rec.index if first_rec else None)
        yield _finding("orphan", "leak", what, remedy, last, epoch=epoch, scope=last.scope, **held)


_Points = list[tuple[int, int]]
"""(epoch index, bytes) at epoch ends, in epoch order."""


def growth_slope(points: _Points, tolerance_bytes: int, *, by_epoch: bool = False) -> float | None:
    """The least-squares slope (bytes/epoch) of leaking epoch-end bytes, else None.

    A leak needs 3 points, a rise above the tolerance and a late rise (NOTE [late rise]);
    ``by_epoch`` places the points at their epochs, where some are missing (paced USS reads).
    """
    series = [value for _, value in points]
    n = len(series)
    if n < GROWTH_POINTS or series[-1] - series[0] <= tolerance_bytes:
        return None
    rise, late_rise = series[-1] - series[0], series[-1] - series[(n - 1) // 2]
    if late_rise <= 0 or late_rise < _LATE_RISE_SHARE * rise:
        return None
    xs = [float(epoch) for epoch, _ in points] if by_epoch else [float(i) for i in range(n)]
    mean_x, mean_y = sum(xs) / n, sum(series) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, series, strict=True))
    slope = sxy / sxx if sxx else 0.0
    return slope if slope > 0 else None


def _points(seen: Sequence[_Seen], read: Callable[[ProcessEpoch], int | None]) -> _Points:
    """What ``read`` gives at the epoch ends of ``seen`` where it gives something."""
    return [
        (rec.index, v) for rec, proc in seen if rec is not None and (v := read(proc)) is not None
    ]


def _grown(
    rule: Rule, points: _Points, slope: float, what: str, remedy: str,
    proc: ProcessEpoch | None = None, **fields: Any,
) -> Finding:
    """A leak whose ``{grows}`` in ``what`` says ``grows 8.0 MiB/epoch over epochs 1-4: ...``."""
    (first, start), (last, end) = points[0], points[-1]
    grows = f"grows {format_mib(slope)} MiB/epoch over epochs {first}-{last}: "
    message = what.format(grows=f"{grows}{format_mib(start)} -> {format_mib(end)} MiB")
    fields["gpu_bytes" if rule == "growth" else "host_bytes"] = end - start
    return _finding(
        rule, "leak", message, remedy, proc, epoch=last, bytes_per_epoch=slope, **fields
    )


@_rule
def growth(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find persistent processes whose epoch-end GPU memory grows (blind: devices' totals)."""
    if not _has_nvml(timeline):
        return
    walk = _Walk.of(timeline)
    for obs in walk.seen.values():
        seen = [(rec, p) for rec, p in obs if rec is not None and p.persistent]
        seen = [(rec, p) for rec, p in seen if not p.gpu_bytes_unknown][config.warmup_epochs :]
        points = _points(seen, lambda proc: proc.total_gpu_bytes_end)
        slope = growth_slope(points, config.tolerance_bytes)
        if slope is None:
            continue
        first, last = seen[0][1].gpu_bytes_end, seen[-1][1]
        grown = [
            (d, last.gpu_bytes_end.get(d, 0) - first.get(d, 0))
            for d in sorted(set(first) | set(last.gpu_bytes_end))
        ]
        grown = [(d, delta) for d, delta in grown if delta]
        per_device = ", ".join(f"GPU{d} {format_mib(x, signed=True)} MiB" for d, x in grown)
        per_device = f" on GPU{grown[0][0]}" if len(grown) == 1 else f" ({per_device})"
        remedy = REMEDY_GROWTH_PARENT if last.role == "parent" else REMEDY_GROWTH_WORKER
        what = "{grows}" + per_device
        yield _grown("growth", points, slope, what, remedy, last, nvidia_fds=last.nvidia_fds)
    if timeline.attribution != "blind-namespace":
        return
    # Device totals per epoch: the fallback when PIDs cannot be attributed.
    per_device_points: dict[int, _Points] = {}
    for rec in walk.ordered:
        for dev in rec.devices:
            per_device_points.setdefault(dev.index, []).append((rec.index, dev.used_bytes))
    for device, points in sorted(per_device_points.items()):
        points = points[config.warmup_epochs :]
        if (slope := growth_slope(points, config.tolerance_bytes)) is not None:
            what = f"GPU{device} used memory {{grows}} (device total: no process can be named)"
            remedy = "run with --pid=host or in the job's PID namespace to see which process grows"
            yield _grown("growth", points, slope, what, remedy, device_index=device)


# NOTE [return of shared pages]: a worker's copy-on-read copy is new memory, the worker's: its
# USS grows, its RSS stays flat. In the parent the page becomes private again, nobody sharing
# it: its USS climbs back to where it was before the fork without a byte of new memory. So a
# parent's USS rise counts only where its resident memory rises beyond the tolerance too; a
# worker's counts alone, named copy-on-read unless its resident memory rose too (a cache: new
# memory). Resident memory is ``RssAnon`` where every point has it: libraries paged in on first
# use raise RSS for epochs, and they are file-backed.


@_rule
def host_growth(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find the parent and persistent workers whose host memory (USS, else resident) grows.

    USS where read at 3 or more judged epoch ends (RssAnon at every end where it saw no growth
    and stopped early); a clean verdict says where a forked worker's was not read.
    """
    tolerance = config.host_tolerance_bytes
    grew = False
    unread: tuple[int, int] | None = None  # (USS reads, epoch ends) of the first clean one
    for obs in _Walk.of(timeline).seen.values():
        seen = [(r, p) for r, p in obs if r is not None and p.role in ("parent", "worker")]
        seen = [(r, p) for r, p in seen if p.persistent and p.alive_at_end][config.warmup_epochs :]
        if len(seen) < GROWTH_POINTS:
            continue
        last = seen[-1][1]
        uss = _points(seen, lambda p: p.host_bytes_end if p.host_source == "uss" else None)
        anon = _points(seen, lambda p: p.anon_bytes_end)
        resident, basis = anon, "RssAnon"
        if len(anon) < len(seen):
            resident, basis = _points(seen, lambda p: p.rss_bytes_end), "RSS"
        points, measure, note = resident, basis, f" (USS read at {len(uss)} of these ends)"
        slope = resident_slope = growth_slope(resident, tolerance, by_epoch=True)
        if len(uss) >= 3:
            uss_slope, uss_note = growth_slope(uss, tolerance, by_epoch=True), ""
            span = [(e, b) for e, b in resident if uss[0][0] <= e <= uss[-1][0]]
            resident_slope = growth_slope(span, tolerance, by_epoch=True)
            if uss_slope is not None and last.role == "parent":  # NOTE [return of shared pages]
                uss_slope = None if resident_slope is None else min(uss_slope, resident_slope)
                if uss_slope is not None:
                    first, last_mib = format_mib(span[0][1]), format_mib(span[-1][1])
                    uss_note = f" ({basis} {first} -> {last_mib} MiB)"
            # Paced, USS may cover the first judged ends only: where it saw no growth, RssAnon
            # at every end still shows what the process allocates after them (NOTE [host pacing]).
            if uss_slope is not None or basis == "RSS" or uss[-1][0] >= seen[-1][0].index:
                points, measure, note, slope = uss, "USS", uss_note, uss_slope
        if slope is not None:
            grew = True
            copied = measure == "USS" and resident_slope is None
            remedy = REMEDY_HOST_WORKER if copied else REMEDY_HOST_WORKER_RESIDENT
            remedy = REMEDY_HOST_PARENT if last.role == "parent" else remedy
            what = f"host memory ({measure}) {{grows}}{note}"
            yield _grown("host-growth", points, slope, what, remedy, last)
        elif unread is None and last.role == "worker" and last.forked is not False:
            # Only a forked worker copies; the parent's USS counts only with resident memory.
            rss_reads = sum(proc.host_source == "rss" for _, proc in seen)
            uss_reads = sum(proc.host_source == "uss" for _, proc in seen)
            unread = (uss_reads, uss_reads + rss_reads) if rss_reads else None
    if unread is not None and not grew:  # a clean host verdict says what it could not see
        message = (
            f"host memory was read as USS at {unread[0]} of the {unread[1]} epoch ends judged: "
            "copy-on-read at the others can go unseen"
        )
        remedy = (
            "for a diagnostic run, read USS at every epoch end: rollup_share=1.0 (run: "
            "--rollup-share 1)"
        )
        yield _finding("host-growth", "info", message, remedy)


@_rule
def pinned_growth(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find the loop's process whose pinned host memory (torch's reserved bytes) grows."""
    epochs = sorted(timeline.epochs, key=lambda rec: rec.index)[config.warmup_epochs :]
    points = [(r.index, v) for r in epochs if (v := r.pinned_reserved_bytes) is not None]
    slope = growth_slope(points, config.host_tolerance_bytes, by_epoch=True)
    parent = next((p for p in epochs[-1].processes if p.role == "parent"), None) if epochs else None
    if slope is not None and parent is not None:
        remedy = (
            "keep no reference to pinned batches across steps; allocate pinned buffers once, not "
            "per step"
        )
        yield _grown("pinned-growth", points, slope, "pinned host memory {grows}", remedy, parent)


@dataclass(frozen=True)
class _WorkerCopy:
    """One worker's largest copy, and when it first passed the tolerance (NOTE [copy on read])."""

    proc: ProcessEpoch
    copied_bytes: int
    epoch: int
    after_s: float | None


def _copied(proc: ProcessEpoch) -> int:
    return proc.copied_bytes_peak or 0


def _private_bytes(proc: ProcessEpoch) -> int:
    """A worker's USS at the end (or exit), else at its birth; -1 where neither is known."""
    if proc.host_source == "uss" and proc.host_bytes_end is not None:
        return proc.host_bytes_end
    return -1 if proc.private_bytes_birth is None else proc.private_bytes_birth


@_rule
def copy_on_read(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find forked workers that copied more of their parent's memory than the copy tolerance.

    One finding per parent (NOTE [copy on read] in hostmem.py); one info for spawned workers.
    """
    tolerance = config.copy_tolerance_bytes
    epochs = sorted(timeline.epochs, key=lambda rec: rec.index)
    observed = [(rec.index, proc) for rec in epochs for proc in rec.processes]
    final = timeline.final
    if final is not None and final.open_epoch is not None:
        observed += [(final.open_epoch, proc) for proc in final.processes]
    copies: dict[ProcessKey, list[tuple[int, ProcessEpoch]]] = {}
    unforked: dict[ProcessKey, list[ProcessEpoch]] = {}
    for index, proc in observed:
        if proc.role == "worker" and proc.forked is False:
            unforked.setdefault(proc.key, []).append(proc)
        elif proc.role == "worker" and proc.forked and proc.copied_bytes_peak is not None:
            copies.setdefault(proc.key, []).append((index, proc))
    by_parent: dict[int, list[_WorkerCopy]] = {}
    for seen in copies.values():
        # The first epoch above the tolerance names when; the largest copy how much.
        over = [(index, p.copied_over_after_s) for index, p in seen if _copied(p) > tolerance]
        if over:
            largest = max((p for _, p in seen), key=_copied)
            copy = _WorkerCopy(largest, _copied(largest), *over[0])
            by_parent.setdefault(largest.ppid, []).append(copy)
    for ppid, leaking in sorted(by_parent.items()):
        first = min(leaking, key=lambda c: (c.epoch, c.after_s if c.after_s is not None else 0.0))
        copied_epochs = sorted({copy.epoch for copy in leaking})
        count, total = len(leaking), sum(copy.copied_bytes for copy in leaking)
        mean = format_mib(total / count)
        when = f"in epoch {first.epoch}"
        if first.after_s is not None:
            when = f"{first.after_s:.1f} s into epoch {first.epoch}"
        if not any(copy.proc.persistent for copy in leaking):  # per-epoch workers: one epoch's
            count = max(sum(c.epoch == e for c in leaking) for e in copied_epochs)
            total = max(sum(c.copied_bytes for c in leaking if c.epoch == e) for e in copied_epochs)
            if len(copied_epochs) > 2:
                when += f" and again in epochs {copied_epochs[1]}-{copied_epochs[-1]}"
            elif len(copied_epochs) == 2:
                when += f" and again in epoch {copied_epochs[1]}"
            else:
                when += " (per-epoch workers copy it again each epoch)"
        who = f"1 forked worker of PID {ppid} copied {mean} MiB of its parent's memory"
        if count > 1:
            who = (
                f"{count} forked workers of PID {ppid} each copied {mean} MiB of their parent's "
                f"memory ({format_mib(total)} MiB in all)"
            )
        fix = (
            "keep the dataset in numpy arrays, Arrow or tensors, not Python objects; gc.freeze() "
            "before iterating; or fewer workers"
        )
        largest = max(leaking, key=lambda c: c.copied_bytes).proc  # the largest copy's worker
        yield _finding(
            "copy-on-read", "leak", f"{who}, {when}", fix, largest, named=False, epoch=first.epoch,
            host_bytes=total,
        )
    if unforked:
        workers = [max(seen, key=_private_bytes) for seen in unforked.values()]
        workers.sort(key=lambda p: p.key)
        held = [_private_bytes(p) for p in workers if _private_bytes(p) >= 0]
        mean = f"; each holds {format_mib(sum(held) / len(held))} MiB of its own" if held else ""
        message = (
            f"copy-on-read cannot be told for {plural(len(workers), 'worker')} started by spawn "
            f"or forkserver: they share no memory with the training process{mean}"
        )
        remedy = (
            "each holds what it unpickled (the dataset included) and imported: mmap large data, "
            "or use fewer workers"
        )
        held_bytes = sum(held) if held else None
        yield _finding(
            "copy-on-read", "info", message, remedy, workers[0], named=False, host_bytes=held_bytes
        )


CONTEXT_OVERHEAD_BYTES = 8 * MIB
"""Device memory a live CUDA context uses beyond what NVML lists under its PID: the
residual rule allows this much per holder (the figure behind it is in
benchmarks/results/README.md)."""


@_rule
def residual(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find GPU memory left after the work: on devices, and the parent's (``parent_memory``)."""
    yield from _device_residual(timeline, config)
    yield from _parent_residual(timeline, config)


def _device_residual(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Device memory above the baseline after the work that the job does not explain."""
    final = timeline.final
    if final is None or not _has_nvml(timeline):
        return
    baseline = {dev.index: dev for dev in timeline.baseline_devices}
    lineage = [p for p in final.processes if p.role in LINEAGE_ROLES]
    foreign = [p for p in final.processes if p.role == "foreign"]
    # Without per-process byte counts (MIG, vGPU) the job's share cannot be subtracted, so the
    # rise is reported as advice, not as a leak.
    unknown_lineage = any(p.gpu_bytes_unknown for p in lineage)
    for dev in sorted(final.devices, key=lambda d: d.index):
        if dev.index not in baseline:
            continue
        rise = dev.used_bytes - baseline[dev.index].used_bytes
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
        who = "; no visible process holds it"
        remedy = (
            "check again with `leakcheck snapshot` in a few seconds (a context may still be "
            "closing)"
        )
        if holders:
            held = [(p, p.gpu_bytes_end.get(dev.index)) for p in holders[:2]]
            who = "; held by " + ", ".join(
                f"{culprit('foreign', p.key.pid, p.cmdline, width=32)} "
                f"{'?' if used is None else format_mib(used)} MiB"
                for p, used in held
            )
            who += f" and {len(holders) - 2} more" if len(holders) > 2 else ""
            remedy = (
                "stop it if it is yours (an escaped child, another run), or use an idle GPU "
                "(CUDA_VISIBLE_DEVICES)"
            )
        elif timeline.attribution == "blind-namespace":
            who = "; no process can be named (PIDs of another PID namespace)"
            remedy = "run with --pid=host or in the job's PID namespace to name the holder"
        who += "; the job's own bytes are unknown (MIG/vGPU)" if unknown_lineage else ""
        message = (
            f"GPU{dev.index} uses {format_mib(rise)} MiB more than at the start, "
            f"{format_mib(unexplained)} MiB of it not held by the job{who}"
        )
        holder = holders[0] if len(holders) == 1 else None
        yield _finding(
            "residual", "info" if unknown_lineage else "leak", message, remedy, holder,
            named=False, rank=None, gpu_bytes=unexplained, device_index=dev.index,
        )


def _parent_residual(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """The parent's own GPU memory after the work (``Timeline.parent_memory``)."""
    memory = timeline.parent_memory
    if memory is None:
        return
    root = timeline.root
    cmdline = next(
        (p.cmdline for rec in timeline.epochs for p in rec.processes if p.key == root), None
    )
    scopes = ", ".join(memory.scopes) or None
    who = culprit("parent", root.pid, cmdline)
    # Each case: its bytes per device, severity, words around the devices' bytes, fix, scope.
    cases: tuple[tuple[Mapping[int, int], Severity, str, str, str, str | None], ...] = (
        (
            memory.kept_tensor_bytes,
            "leak",
            "still holds ",
            " of CUDA tensors more than at the start"
            + (f" after the teardown of {scopes}" if scopes else ""),
            REMEDY_SCOPE
            if scopes
            else "drop references to CUDA tensors the work keeps (module-level lists, caches, "
            "stored exceptions)",
            scopes,
        ),
        (
            memory.driver_bytes,
            "info" if memory.torch_in_use else "leak",
            "holds ",
            " more than at the start outside torch's allocator"
            + (" (or kernels loaded on first use)" if memory.torch_in_use else ""),
            "free GPU memory the work allocates outside torch (library pools), or raise the "
            "tolerance",
            None,
        ),
    )
    for values, severity, before, after, remedy, scope in cases:
        if held := {d: b for d, b in values.items() if b > config.tolerance_bytes}:
            message = f"{who} {before}{_devices_text(held)}{after}"
            yield _finding(
                "residual", severity, message, remedy, pid=root.pid, start_ticks=root.start_ticks,
                role="parent", cmdline=cmdline, gpu_bytes=sum(held.values()),
                device_index=min(held) if len(held) == 1 else None, scope=scope,
            )


_SHM_CAUSES: dict[str, tuple[str, str]] = {
    "cuda.shm.": (
        "CUDA IPC: workers returned CUDA tensors",
        "return CPU tensors from workers and move them to the GPU in the main process",
    ),
    "torch_": (
        "a torch shared tensor (file_system sharing)",
        "let the loader's iterators finish or `del` them, so their workers free their segments",
    ),
    "psm_": (
        "a SharedMemory never unlinked",
        "call unlink() on the SharedMemory that made it (close() alone leaves the file)",
    ),
    "nccl-": (
        "NCCL's: a process group not destroyed",
        "call torch.distributed.destroy_process_group() when the work ends",
    ),
    "": (
        "shared memory the work created itself",
        "unlink the shared memory the work creates (SharedMemory.unlink(), os.unlink)",
    ),
}
"""Why a /dev/shm file exists, by its name's prefix, and what to do about it."""


def _size_text(num_bytes: int) -> str:
    if num_bytes >= MIB:
        return f"{format_mib(num_bytes)} MiB"
    if num_bytes >= 1024:
        return f"{num_bytes / 1024:.0f} KiB"
    return f"{num_bytes} B"


def _shm_finding(item: ShmFile) -> Finding:
    prefix = next(prefix for prefix in _SHM_CAUSES if item.name.startswith(prefix))
    cause, remedy = _SHM_CAUSES[prefix]
    if item.name.startswith("torch_") and item.allocated_bytes == 0 and item.size_bytes:
        # torch made the file, then could not reserve it (posix_fallocate): /dev/shm was full.
        cause = "an empty torch segment whose reservation failed: /dev/shm was full"
        remedy = "give the job more shared memory (--shm-size, --ipc=host), then remove the file"
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
        if not prefix:  # "the work created itself" is not known here
            cause = "its name does not say who made it"
            remedy = (
                "nothing to do if another job made it; if the work did, unlink it when done "
                "(os.unlink)"
            )
    message = f"/dev/shm/{item.name} ({_size_text(item.size_bytes)}) {where}: {cause}"
    return _finding(
        "shm", severity, message, remedy, pid=item.holder_pid, role=item.holder_role,
        scope=item.scope, shm_name=item.name, size_bytes=item.size_bytes,
    )


@_rule
def shm(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Report the ``/dev/shm`` files left behind, and the epoch nearest to filling it."""
    yield from map(_shm_finding, timeline.shm_files)
    # Capacity pressure: the epoch whose /dev/shm use came nearest the filesystem's size.
    measured = [
        (rec.shm_used_peak_bytes, rec.shm_total_bytes, rec)
        for rec in sorted(timeline.epochs, key=lambda rec: rec.index)
        if rec.shm_total_bytes and rec.shm_used_peak_bytes is not None
    ]
    worst = max(measured, key=lambda item: item[0] / item[1], default=None)
    if worst is not None and worst[0] / worst[1] >= config.shm_pressure_fraction:
        used, total, rec = worst
        job = f", the job's files {_size_text(rec.shm_bytes)}" if rec.shm_bytes is not None else ""
        message = (
            f"/dev/shm was {used / total:.0%} full during {rec.label} ({_size_text(used)} of "
            f"{_size_text(total)}{job}): a batch fails or a worker dies of a bus error when it "
            "fills"
        )
        remedy = "give the job more shared memory (docker run --shm-size=8g or --ipc=host)"
        yield _finding("shm", "info", message, remedy, epoch=rec.index, size_bytes=used)


@_rule
def blind(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Say plainly when NVML's PIDs belong to another PID namespace."""
    if timeline.attribution == "blind-namespace":
        reason = f" ({timeline.attribution_reason})" if timeline.attribution_reason else ""
        message = (
            f"NVML reports PIDs of another PID namespace{reason}: only device totals are judged"
        )
        remedy = "run with --pid=host (docker) or inside the job's PID namespace"
        yield _finding("blind", "info", message, remedy)


@_rule
def descriptor_holder(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Note processes outliving the work with ``/dev/nvidia*`` fds but no GPU memory."""
    if not per_pid_bytes_known(timeline):
        # Without per-PID bytes every process looks memory-free; the rule would guess.
        return
    closed = timeline.final is not None and timeline.final.closed
    for obs in _Walk.of(timeline).seen.values():
        for rec, proc in obs:
            # Outliving the work that started it is where held descriptors matter.
            if rec is None:
                outlives = proc.role == "orphan" or (closed and proc.role in _CHILD_ROLES)
            else:
                outlives = proc.alive_at_end and proc.role in ("orphan", "descendant")
            held = proc.gpu_bytes_unknown or any(b > 0 for b in proc.gpu_bytes_end.values())
            if not outlives or not proc.nvidia_fds or held:
                continue
            where = f"at the end of {rec.label}" if rec is not None else "after the work"
            # No count: the processes of one cause share one line (the JSON has each one's
            # `nvidia_fds`).
            what = (
                f"holds /dev/nvidia* fds but no GPU memory {where}: forked from a parent that "
                "used CUDA"
            )
            fix = "start workers with multiprocessing_context='spawn' or 'forkserver'"
            yield _finding(
                "descriptor-holder", "info", what, fix, proc, gpu_bytes=0,
                epoch=rec.index if rec else None, nvidia_fds=proc.nvidia_fds,
            )
            break


@_rule
def context_kept(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Note a parent that keeps its CUDA context, with no tensors, after the work ended."""
    final = timeline.final
    if final is None or not final.closed or not per_pid_bytes_known(timeline):
        return
    if final.parent_allocated_gpu_bytes != 0:
        return
    for proc in final.processes:
        if proc.role == "parent" and proc.total_gpu_bytes_end > 0:
            what = (
                f"keeps its CUDA context ({_devices_text(proc.gpu_bytes_end)}) after the work, "
                "with no tensors allocated"
            )
            fix = "harmless (freed at exit); leakcheck.release_device() frees it sooner"
            held = proc.total_gpu_bytes_end
            yield _finding(
                "context-kept", "info", what, fix, proc, gpu_bytes=held, nvidia_fds=proc.nvidia_fds
            )


@_rule
def device_mismatch(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Find processes of a rank holding more than the tolerance on a GPU not their rank's.

    One finding per process and device; a process whose rank's device is unknown is not judged.
    """
    if not per_pid_bytes_known(timeline):
        return
    final_devices = timeline.final.devices if timeline.final is not None else ()
    states = [*timeline.baseline_devices, *(d for e in timeline.epochs for d in e.devices)]
    known = {state.index for state in (*states, *final_devices)}  # empty: none read
    for obs in _Walk.of(timeline).seen.values():
        held: dict[int, int] = {}
        first: dict[int, _Seen] = {}
        own: int | None = None
        for rec, proc in obs:
            if proc.role not in LINEAGE_ROLES or proc.rank is None:
                continue
            # The GPU its rank trains on: the rank's own record, else its environment.
            device = timeline.rank_devices.get(proc.rank, proc.rank_device)
            if device is None or (
                proc.rank not in timeline.rank_devices and known and device not in known
            ):
                continue
            own = device
            for index, used in (*proc.gpu_bytes_end.items(), *proc.gpu_bytes_peak.items()):
                if index == device or used <= config.tolerance_bytes:
                    continue
                held[index] = max(held.get(index, 0), used)
                first.setdefault(index, (rec, proc))
        for index, used in sorted(held.items()):
            rec, proc = first[index]
            where = f"in {rec.label}" if rec is not None else "after the job"
            what = (
                f"holds GPU{index} {format_mib(used)} MiB {where}, but rank {proc.rank} trains "
                f"on GPU{own}"
            )
            fix = "call torch.cuda.set_device(LOCAL_RANK) before anything in the rank touches CUDA"
            yield _finding(
                "device-mismatch", "leak", what, fix, proc, gpu_bytes=used,
                epoch=rec.index if rec else None, device_index=index,
                nvidia_fds=proc.nvidia_fds, scope=proc.scope,
            )


@_rule
def high_clocks(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Note a device left at high SM clocks after the work ended, with no job memory."""
    final = timeline.final
    if final is None or not final.closed or not _has_nvml(timeline):
        return
    lineage = [p for p in final.processes if p.role in LINEAGE_ROLES]
    for dev in sorted(final.devices, key=lambda d: d.index):
        clock, clock_max = dev.sm_clock_mhz, dev.sm_clock_max_mhz
        if clock is None or not clock_max or clock < config.high_clock_fraction * clock_max:
            continue
        if any(p.gpu_bytes_end.get(dev.index, 0) > 0 for p in lineage):
            continue
        message = f"GPU{dev.index} SM clock stays at {clock} of {clock_max} MHz after work ended"
        if dev.temperature_c is not None:
            message += f", {dev.temperature_c} C"
        if dev.power_w is not None:
            message += f", {dev.power_w:.0f} W"
        remedy = "wait before timing the next run (leakcheck sweep --cooldown-temp C waits for it)"
        yield _finding("high-clocks", "info", message, remedy, device_index=dev.index)


@_rule
def tracker_failure(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Report each failure leakcheck recorded while sampling, one finding each."""
    for failure in timeline.failures:
        message = f"leakcheck's own sampling failed: {' '.join(failure.split())}"
        remedy = "rerun with strict=True to see the traceback, and report it as a leakcheck bug"
        yield _finding("tracker-failure", "info", message, remedy)


@_rule
def fd_pressure(timeline: Timeline, config: RuleConfig) -> Iterator[Finding]:
    """Note processes whose open descriptors (read at epoch ends) reached the pressure share."""
    for obs in _Walk.of(timeline).seen.values():
        shares = [(p.open_fds / p.fd_limit, rec, p) for rec, p in obs if p.open_fds and p.fd_limit]
        if not shares:
            continue
        share, rec, proc = max(shares, key=lambda item: item[0])
        if share < config.fd_pressure_fraction:
            continue
        when = f"at the end of epoch {rec.index}" if rec is not None else "after the work"
        message = (
            f"held {proc.open_fds} open descriptors of its limit {proc.fd_limit} ({share:.0%}) "
            f"{when}"
        )
        remedy = (
            "raise it (ulimit -n 65536), or "
            "torch.multiprocessing.set_sharing_strategy('file_system')"
        )
        epoch = rec.index if rec else None
        yield _finding("fd-pressure", "info", message, remedy, proc, epoch=epoch)


RULES: Mapping[Rule, RuleFunction] = {
    cast(Rule, rule.__name__.replace("_", "-")): rule  # a rule's name is its function's
    for rule in (
        survivor, orphan, growth, host_growth, copy_on_read, residual, blind, descriptor_holder,
        context_kept, high_clocks, tracker_failure, shm, device_mismatch, died, fd_pressure, hang,
        pinned_growth, shutdown_hang,
    )
}
"""Every rule by name, in report order for ties."""


def _sort_key(f: Finding) -> tuple[bool, bool, int, bool, int]:
    return (f.severity != "leak", f.epoch is None, f.epoch or 0, f.pid is None, f.pid or 0)


def judge(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """Run every rule; the findings leaks first, then by epoch, then PID."""
    # Rule by rule in RULES order: the stable sort keeps that order for ties.
    findings = [f for rule in RULES.values() for f in rule(timeline, config)]
    # An orphan is not also a survivor (nobody will reap it).
    orphans = {(f.pid, f.start_ticks) for f in findings if f.rule == "orphan"}
    boot = timeline.boot_unix_s
    shown = [
        f
        if f.start_ticks is None or boot is None
        else replace(f, create_time=create_time_s(f.start_ticks, boot))
        for f in findings
        if not (f.rule == "survivor" and (f.pid, f.start_ticks) in orphans)
    ]
    return tuple(sorted(shown, key=_sort_key))
