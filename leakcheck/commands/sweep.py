"""The sweep engine: worker counts x epochs, one ``Tracker`` per configuration.

``leakcheck sweep`` is the classic leak-hunting script done right: for each number of
workers it builds a fresh loader (``FACTORY(num_workers)``), iterates it for a number of
epochs through ``watch()``'s own wrapper (NOTE [the watch() code path] in ``_run_config``),
and keeps what each epoch showed per process and per device. The result is a frozen
``SweepResult`` that renders as a text table (``format``) and as JSON (``to_dict``, with a
schema version); ``leakcheck.judge.plot`` draws it.

Layers: this module is the command line's engine, part of the ``cli`` adapter; it drives
the epoch driver of ``leakcheck.adapters.dataloader`` (``WatchedLoader``), which sits below the
command line as the one place that iterates a watched loader. Nothing below imports it;
``leakcheck.judge.plot`` reads its result by shape (protocols), never by import.

NOTE [one tracker per configuration]: each configuration gets its own tracker, so its own
session tag: a process left over by one configuration can never be counted as part of the
next one, and the cleanup after a configuration touches only processes carrying that
configuration's tag.

NOTE [cleanup]: after a configuration is judged, the sweep terminates the processes it
created that were reparented away and are still alive (the orphans): it finds them by the
configuration's session tag, checks each identity ``(pid, start_ticks)`` again right before
signalling it (NOTE [process identity] in procs.py), and says what it did. Nothing without
the tag is ever signalled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from leakcheck.adapters.dataloader import WatchedLoader
from leakcheck.commands.progress import Progress
from leakcheck.core.errors import LeakCheckError
from leakcheck.core.files import environment, write_json
from leakcheck.core.model import (
    MIB,
    DeviceState,
    EpochRecord,
    ProcInfo,
    TeardownRecord,
    TrackerCost,
)
from leakcheck.core.names import process_name
from leakcheck.core.units import format_mib, format_size, plural
from leakcheck.judge.report import (
    align_columns,
    combined_verdict,
    gpu_unchecked,
    host_totals,
    or_dash,
    workers_peak_bytes,
)
from leakcheck.judge.verdict import EpochCounts, epoch_counts, per_pid_bytes_known
from leakcheck.observe import nvml, procs
from leakcheck.observe.torch_state import initialized_cuda
from leakcheck.track.tracker import Tracker

if TYPE_CHECKING:
    from leakcheck.commands.workload import WorkloadSpec
    from leakcheck.judge.report import Report

__all__ = [
    "SWEEP_SCHEMA_VERSION",
    "CleanedProcess",
    "ConfigResult",
    "Cooldown",
    "EpochRow",
    "LoaderError",
    "LoaderFactory",
    "SweepOptions",
    "SweepPlan",
    "SweepResult",
    "WorkerBound",
    "one_line",
    "run_sweep",
    "write_json",
]

SWEEP_SCHEMA_VERSION = 3
"""Version of ``SweepResult.to_dict``'s layout; bumped on any incompatible change.

2: a row's ``workers_gpu_bytes_peak`` includes what the workers reported at exit and is
null when any worker's peak is unknown (``workers_peak_unknown``, new, with
``workers_peak_reported`` and ``batches``); ``teardown.workers`` counts the workers the
policy released (``teardown.reported``, new: every worker that reported at exit).
3: host memory per row (``parent_host_bytes``, ``workers_host_bytes``, ``host_source``) and
the job's ``/dev/shm`` bytes (``shm_bytes``); the table has three more columns; the options
carry ``rollup_share``. Since added, with defaults (no bump): the rows' forked workers' shared
and copied bytes (``workers_shared_bytes``, ``workers_copied_bytes``), the options'
``copy_tolerance_bytes``; the rows' loop timing (``samples``, ``wait_s``, ``loop_s``), each
configuration's ``throughput`` and the sweep's ``recommendation``."""

LoaderFactory = Callable[[int], Iterable[Any]]
"""``FACTORY(num_workers)``: returns an iterable loader; each ``iter()`` is one epoch."""

_CLEANUP_WAIT_S = 3.0
_COOLDOWN_POLL_S = 1.0
_UNAVAILABLE = "n/a"
_UNKNOWN = "?"


class LoaderError(LeakCheckError):
    """The loader could not be built or iterated; the message is one line."""


def _fields(obj: Any) -> dict[str, Any]:
    """A flat dataclass's fields by name, in declaration order (its JSON-able form)."""
    return {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)}


@dataclass(frozen=True)
class WorkerBound:
    """The largest worker count a sweep starts without ``--max-workers``, and why.

    Attributes:
        max_workers: The bound.
        why: What sets it, for the error message (``16 CPUs x 8``).

    """

    max_workers: int
    why: str


@dataclass(frozen=True)
class SweepPlan:
    """Validated ``sweep`` arguments."""

    options: SweepOptions
    workload: WorkloadSpec | None
    """None with ``--loader``."""
    loader: str | None
    json_path: str | None
    plot_path: str | None
    fail_on_leak: bool


@dataclass(frozen=True)
class SweepOptions:
    """What to sweep and how to judge it.

    Attributes:
        workers: Worker counts, one configuration each, in this order.
        epochs: Epochs per configuration.
        persistent: Workers live across epochs (tells the tracker what to expect).
        device_index: The device to watch and to report on (None: all watched, the first
            shown).
        cooldown_temp_c: Before each configuration, wait until the GPU is at or below this.
        cooldown_timeout_s: Give up waiting for the cooldown after this long.
        interval_s: Tracker sampling interval.
        tolerance_bytes: Growth or residual below this is noise.
        grace_s: How long a process born in an epoch may outlive it.
        warmup_epochs: Epochs the growth rule ignores.
        cleanup: Terminate the sweep's own orphans after each configuration.
        teardown: Install the teardown policy in the workers of any DataLoader, built-in or
            ``--loader`` (False: workers still report who they are and what they held at
            exit, and release nothing).
        rollup_share: Share of the time the trackers' USS reads may take (``Tracker``'s
            option). A sweep reads them at every epoch end (1.0): it runs a loader only to
            measure it, its epochs are short, and its rows and plot should say USS
            throughout; what that cost is in each configuration's tracker cost line.
        copy_tolerance_bytes: What each forked worker may copy of the parent's memory (the
            copy-on-read rule).

    """

    workers: tuple[int, ...] = (0, 4, 8)
    epochs: int = 5
    persistent: bool = False
    device_index: int | None = None
    cooldown_temp_c: float | None = None
    cooldown_timeout_s: float = 600.0
    interval_s: float = 0.05
    tolerance_bytes: int = 16 * MIB
    grace_s: float = 2.0
    warmup_epochs: int = 1
    cleanup: bool = True
    teardown: bool = True
    rollup_share: float = 1.0
    copy_tolerance_bytes: int = 64 * MIB

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {**_fields(self), "workers": list(self.workers)}


@dataclass(frozen=True)
class EpochRow:
    """One row of the sweep table: one epoch of one configuration.

    GPU byte counts are summed over the watched devices; device and telemetry fields are
    for the reported device. Every GPU field is None when no GPU can be read (no NVML,
    or NVML's PIDs are not in this PID namespace, for the per-process ones).

    Attributes:
        num_workers: The configuration.
        epoch: Epoch index (0-based).
        label: The tracker's epoch label.
        duration_s: Wall seconds of the epoch.
        end_reason: How the epoch ended (``completed``, ``exception``...).
        parent_gpu_bytes: The parent's GPU bytes at the end of the epoch.
        worker_count: Worker processes seen during the epoch.
        workers_gpu_bytes: Sum of the workers' GPU bytes at the end of the epoch.
        worker_gpu_bytes_max: The largest single worker at the end of the epoch.
        workers_gpu_bytes_peak: Sum of the workers' peaks during the epoch (each the larger
            of what was sampled and what the worker reported at exit; never below
            ``workers_gpu_bytes``); None also when any worker's peak is unknown.
        alive_after: Processes born in the epoch (not persistent) still alive after it
            and its grace period.
        orphans: Processes of the job reparented away, alive at the end of the epoch.
        other_gpu_bytes: GPU bytes of the job's other processes (descendants, orphans).
        workers_peak_reported: Workers whose peak includes their own report at exit.
        workers_peak_unknown: Workers whose peak is unknown: they exited before any read
            saw them on a GPU and reported nothing (shown as ``?``, never 0).
        batches: Batches the epoch yielded.
        parent_host_bytes: The parent's host memory at the end of the epoch (USS where
            read, else RSS: ``host_source``); None: unknown.
        workers_host_bytes: The workers' host memory summed: each at the end of the epoch,
            or, for a worker gone by then, as it reported at exit; None when any worker's
            is unknown (``?``, never 0).
        host_source: ``uss`` or ``rss`` when every host figure of the row is that,
            ``uss+rss`` when both are; None: none known.
        workers_shared_bytes: The forked workers' memory still shared with the parent
            (``Shared_Dirty``), summed, at the reading ``workers_copied_bytes`` is from;
            None where no worker's is known (spawn workers, or not read).
        workers_copied_bytes: What the forked workers copied of the parent's memory since
            they started, summed (NOTE [copy on read] in hostmem.py); None likewise.
        shm_bytes: The job's files in ``/dev/shm`` at the end of the epoch.
        device_used_bytes: Device memory used at the end of the epoch.
        device_total_bytes: Device memory size.
        temperature_c: GPU temperature at the end of the epoch.
        sm_clock_mhz: SM clock at the end of the epoch.
        power_w: Board power at the end of the epoch.
        error: The exception that ended the epoch, if one did.
        samples: Samples the epoch yielded (each batch's leading dimension); None where a
            batch's size could not be read.
        wait_s: Seconds the loop spent inside ``next()`` waiting for its batches (the
            workers' start included; not the epoch's end, where leakcheck closes it).
        loop_s: Seconds from the first batch requested to the last one handled.

    """

    num_workers: int
    epoch: int
    label: str
    duration_s: float
    end_reason: str
    parent_gpu_bytes: int | None
    worker_count: int
    workers_gpu_bytes: int | None
    worker_gpu_bytes_max: int | None
    workers_gpu_bytes_peak: int | None
    alive_after: int
    orphans: int
    other_gpu_bytes: int | None
    workers_peak_reported: int | None = None
    workers_peak_unknown: int | None = None
    batches: int | None = None
    parent_host_bytes: int | None = None
    workers_host_bytes: int | None = None
    host_source: str | None = None
    workers_shared_bytes: int | None = None
    workers_copied_bytes: int | None = None
    shm_bytes: int | None = None
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    power_w: float | None = None
    error: str | None = None
    samples: int | None = None
    wait_s: float | None = None
    loop_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (bytes, seconds, degrees Celsius, MHz, watts)."""
        return _fields(self)


@dataclass(frozen=True)
class Cooldown:
    """The wait for the GPU to cool down before one configuration.

    Attributes:
        target_c: The temperature asked for.
        start_c: Temperature when the wait began (None: unknown).
        end_c: Temperature when it ended (None: unknown).
        waited_s: Seconds waited.
        reached: The target was reached before the timeout.
        note: Why there was no wait or it failed, if so.

    """

    target_c: float
    start_c: int | None
    end_c: int | None
    waited_s: float
    reached: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return _fields(self)

    def describe(self) -> str:
        """One line for the text report."""
        if self.note:
            return f"cooldown to {self.target_c:g} °C: {self.note}"
        outcome = "reached" if self.reached else "NOT reached (timeout)"
        return (
            f"cooldown to {self.target_c:g} °C {outcome}: {or_dash(self.start_c)} -> "
            f"{or_dash(self.end_c)} °C in {self.waited_s:.1f} s"
        )


@dataclass(frozen=True)
class CleanedProcess:
    """A leftover process of the sweep and what the cleanup did to it.

    Attributes:
        pid: Process ID.
        start_ticks: With ``pid``, its identity: its start in clock ticks since boot.
        create_time: Its start as a Unix time, for people (never compared).
        cmdline: Its command line, shortened.
        outcome: ``terminated``, ``killed``, ``gone`` (exited before the signal), or
            ``failed: <reason>``.

    """

    pid: int
    start_ticks: int
    create_time: float
    cmdline: str
    outcome: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return _fields(self)


@dataclass(frozen=True)
class ConfigResult:
    """One configuration of the sweep: its rows, its judged report, its cleanup.

    Attributes:
        num_workers: Worker count.
        persistent_workers: Whether workers were expected to live across epochs.
        rows: One per epoch.
        report: The tracker's judged report (findings, verdict, the full timeline).
        cooldown: The wait before the configuration, if one was asked for.
        cleaned: Leftover processes the sweep terminated after judging.
        wall_s: Seconds the configuration took (loader, epochs, tracker close).
        cost: What tracking cost up to the end of the last epoch (``Tracker.cost()``).

    """

    num_workers: int
    persistent_workers: bool
    rows: tuple[EpochRow, ...]
    report: Report
    cooldown: Cooldown | None = None
    cleaned: tuple[CleanedProcess, ...] = ()
    wall_s: float = 0.0
    cost: TrackerCost | None = None

    @property
    def accounted_cost_fraction(self) -> float | None:
        """The tracker's own time (sampler CPU + the loop's time inside it) over the epochs'."""
        epochs_s = sum(record.duration_s for record in self.report.epochs)
        if self.cost is None or epochs_s <= 0:
            return None
        return (self.cost.sampler_cpu_s + self.cost.caller_wall_s) / epochs_s

    @property
    def tracker_ms_per_epoch(self) -> float | None:
        """The loop's time inside the tracker per epoch, in milliseconds."""
        if self.cost is None:
            return None
        return self.cost.caller_wall_s * 1000 / max(1, len(self.report.epochs))

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second of the loop over every epoch; None where not counted."""
        samples = [row.samples for row in self.rows]
        if not samples or None in samples:
            return None
        return _rate(sum(n for n in samples if n is not None), self.rows)

    @property
    def batches_per_s(self) -> float | None:
        """Batches per second of the loop over every epoch; None where not timed."""
        return _rate(sum(row.batches or 0 for row in self.rows), self.rows)

    @property
    def wait_share(self) -> float | None:
        """Share of the loop's time spent waiting for batches (``EpochRow.wait_s``)."""
        loop_s = sum(row.loop_s or 0.0 for row in self.rows)
        if loop_s <= 0 or any(row.wait_s is None for row in self.rows):
            return None
        return sum(row.wait_s or 0.0 for row in self.rows) / loop_s

    @property
    def worker_host_bytes(self) -> int | None:
        """Host memory per worker: the most of any epoch; None where never read."""
        return _per_worker(self.rows, lambda row: row.workers_host_bytes)

    @property
    def worker_gpu_bytes(self) -> int | None:
        """GPU memory per worker (its peak): the most of any epoch; None where never read."""
        return _per_worker(self.rows, lambda row: row.workers_gpu_bytes_peak)

    @property
    def teardowns(self) -> tuple[TeardownRecord, ...]:
        """What the teardown policy freed in each worker (empty when it was off)."""
        return self.report.timeline.teardowns

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with the configuration's full ``Report.to_dict()``."""
        return {
            "num_workers": self.num_workers,
            "persistent_workers": self.persistent_workers,
            "wall_s": self.wall_s,
            "verdict": self.report.verdict,
            "leak_count": len(self.report.leaks),
            "info_count": len(self.report.infos),
            "summary": self.report.summary(gpu=False, named=False),  # as the text says it
            "cooldown": None if self.cooldown is None else self.cooldown.to_dict(),
            "rows": [row.to_dict() for row in self.rows],
            "teardown": teardown_summary(self.teardowns),
            "tracker_cost": None if self.cost is None else dataclasses.asdict(self.cost),
            "accounted_cost_fraction": self.accounted_cost_fraction,
            "tracker_ms_per_epoch": self.tracker_ms_per_epoch,
            "throughput": {
                "samples_per_s": self.samples_per_s,
                "batches_per_s": self.batches_per_s,
                "wait_share": self.wait_share,
                "worker_host_bytes": self.worker_host_bytes,
                "worker_gpu_bytes": self.worker_gpu_bytes,
            },
            "cleanup": [cleaned.to_dict() for cleaned in self.cleaned],
            "report": self.report.to_dict(),
        }


def _rate(count: int, rows: Iterable[EpochRow]) -> float | None:
    loop_s = [row.loop_s for row in rows]
    if not loop_s or None in loop_s or sum(t for t in loop_s if t) <= 0:
        return None
    return count / sum(t for t in loop_s if t)


def _per_worker(rows: Iterable[EpochRow], value: Callable[[EpochRow], int | None]) -> int | None:
    known = [
        total // row.worker_count
        for row in rows
        if row.worker_count and (total := value(row)) is not None
    ]
    return max(known, default=None)


RECOMMEND_WITHIN = 0.05
"""The recommended worker count is the smallest within this share of the best throughput."""


def recommend_workers(rates: Mapping[int, float | None]) -> int | None:
    """The smallest worker count whose throughput is within ``RECOMMEND_WITHIN`` of the best.

    Args:
        rates: Throughput (samples or batches per second) by worker count; None where not
            measured (left out).

    Returns:
        The worker count; None where no count was measured.

    """
    measured = {n: rate for n, rate in rates.items() if rate is not None}
    if not measured:
        return None
    best = max(measured.values())
    return min(n for n, rate in measured.items() if rate >= best * (1 - RECOMMEND_WITHIN))


@dataclass(frozen=True)
class Recommendation:
    """The worker-count answer: the fewest workers near the best throughput, and their cost.

    Attributes:
        num_workers: The recommended count.
        rate_per_s: Its throughput.
        unit: What the rates count: ``samples``, or ``batches`` where a batch's size could
            not be read.
        best_workers: The count with the best throughput.
        best_rate_per_s: That throughput.
        worker_host_bytes: Host memory per worker of the recommended count (None: not
            read, or no workers).
        worker_gpu_bytes: GPU memory per worker likewise.

    """

    num_workers: int
    rate_per_s: float
    unit: str
    best_workers: int
    best_rate_per_s: float
    worker_host_bytes: int | None
    worker_gpu_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (bytes, per second)."""
        return _fields(self)

    def describe(self, *, gpu_available: bool) -> str:
        """One line: the count, its throughput against the best, its memory cost."""
        rate = f"{self.rate_per_s:,.0f} {self.unit}/s"
        if self.best_workers == self.num_workers:
            against = "the best"
        else:
            best = f"{self.best_rate_per_s:,.0f} at {self.best_workers}"
            against = f"within {RECOMMEND_WITHIN:.0%} of the best, {best}"
        costs = [
            ("host", self.worker_host_bytes, True),
            ("GPU", self.worker_gpu_bytes, gpu_available),
        ]
        if self.num_workers == 0:
            cost = "no worker memory"
        else:
            parts = [
                f"{where} {_cost(per_worker, self.num_workers)}"
                for where, per_worker, read in costs
                if read
            ]
            cost = "costs " + ", ".join(parts)
        return f"recommended: {plural(self.num_workers, 'worker')} ({rate}, {against}); {cost}"


def _cost(per_worker: int | None, count: int) -> str:
    if per_worker is None:
        return "unknown"
    return f"{format_mib(per_worker * count)} MiB ({format_mib(per_worker)} per worker)"


def recommendation(result: SweepResult) -> Recommendation | None:
    """The sweep's worker-count answer (``recommend_workers`` on its throughputs)."""
    unit = "samples"
    rates = {c.num_workers: c.samples_per_s for c in result.configs}
    if None in rates.values():
        unit, rates = "batches", {c.num_workers: c.batches_per_s for c in result.configs}
    chosen = recommend_workers(rates)
    if chosen is None:
        return None
    best = max((n for n in rates if rates[n] is not None), key=lambda n: rates[n] or 0.0)
    config = next(c for c in result.configs if c.num_workers == chosen)
    return Recommendation(
        num_workers=chosen,
        rate_per_s=rates[chosen] or 0.0,
        unit=unit,
        best_workers=best,
        best_rate_per_s=rates[best] or 0.0,
        worker_host_bytes=config.worker_host_bytes,
        worker_gpu_bytes=config.worker_gpu_bytes if result.gpu_available else None,
    )


@dataclass(frozen=True)
class SweepResult:
    """Everything a sweep observed and judged.

    Attributes:
        options: What was swept.
        loader: One line describing the loader (built-in workload or ``MODULE:FACTORY``).
        configs: One result per worker count, in sweep order.
        gpu_available: NVML could be read.
        gpu_reason: Why not, in one line (empty when available).
        devices: The devices at the start of the sweep (empty without a GPU).
        started_unix_s: When the sweep began.
        wall_s: How long it took.
        environment: Versions and machine, for the record.

    """

    options: SweepOptions
    loader: str
    configs: tuple[ConfigResult, ...]
    gpu_available: bool
    gpu_reason: str
    devices: tuple[DeviceState, ...] = ()
    started_unix_s: float = 0.0
    wall_s: float = 0.0
    environment: Mapping[str, Any] = field(default_factory=dict)

    @property
    def leak_count(self) -> int:
        """Leaks over all configurations."""
        return sum(len(config.report.leaks) for config in self.configs)

    @property
    def verdict(self) -> str:
        """``leak`` if any configuration leaked, ``blind`` if any was blind, else ``clean``."""
        return combined_verdict(config.report.verdict for config in self.configs)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data, with ``schema`` and ``schema_version``."""
        from leakcheck.judge.report import SCHEMA_VERSION

        answer = recommendation(self)
        return {
            "schema": "leakcheck.commands.sweep",
            "schema_version": SWEEP_SCHEMA_VERSION,
            "report_schema_version": SCHEMA_VERSION,
            "started_unix_s": self.started_unix_s,
            "wall_s": self.wall_s,
            "loader": self.loader,
            "options": self.options.to_dict(),
            "environment": dict(self.environment),
            "gpu": {
                "available": self.gpu_available,
                "reason": self.gpu_reason,
                "reported_device": reported_device_index(self),
                "devices": [device.to_dict() for device in self.devices],
            },
            "verdict": self.verdict,
            "leak_count": self.leak_count,
            "recommendation": None if answer is None else answer.to_dict(),
            "configurations": [config.to_dict() for config in self.configs],
        }

    @property
    def recommendation_line(self) -> str | None:
        """The worker-count answer in one line (None: nothing was timed)."""
        answer = recommendation(self)
        return None if answer is None else answer.describe(gpu_available=self.gpu_available)

    def format(self) -> str:
        """The text report: header, the table, then per configuration its verdict."""
        return format_sweep(self)


# --------------------------------------------------------------------------- running


def run_sweep(
    options: SweepOptions,
    factory: LoaderFactory,
    *,
    loader: str,
    progress: Progress | None = None,
    gpu: tuple[bool, str] | None = None,
) -> SweepResult:
    """Run every configuration of the sweep and judge each.

    Args:
        options: What to sweep.
        factory: ``FACTORY(num_workers)`` returning an iterable loader.
        loader: One line describing the loader, for the report.
        progress: Where progress goes (default: none).
        gpu: ``nvml.availability()`` when the caller already asked.

    Returns:
        The frozen result.

    Raises:
        LoaderError: Calling the factory or iterating its loader failed (one line).

    """
    started_unix_s = time.time()
    started_s = time.monotonic()
    gpu_available, gpu_reason = gpu if gpu is not None else nvml.availability()
    devices: tuple[DeviceState, ...] = ()
    if gpu_available:
        try:
            selected = None if options.device_index is None else [options.device_index]
            devices = nvml.get().devices(selected)
        except LeakCheckError as exc:
            gpu_available, gpu_reason = False, str(exc)
    report_progress = progress or Progress(0, enabled=False)
    configs = []
    # Libraries warn while the sweep draws its progress line (torch's "this DataLoader will
    # create 8 worker processes" for each configuration): held until the line is gone, then
    # shown once each, the filters in force deciding as always ("error" still raises).
    with warnings.catch_warnings(record=True) as caught:
        for position, num_workers in enumerate(options.workers):
            configs.append(
                _run_config(
                    options,
                    factory,
                    num_workers,
                    position,
                    gpu_available=gpu_available,
                    progress=report_progress,
                )
            )
    report_progress.close()
    _warn_once(caught)
    return SweepResult(
        options=options,
        loader=loader,
        configs=tuple(configs),
        gpu_available=gpu_available,
        gpu_reason=gpu_reason,
        devices=devices,
        started_unix_s=started_unix_s,
        wall_s=time.monotonic() - started_s,
        environment=environment(devices),
    )


def _warn_once(caught: Iterable[warnings.WarningMessage]) -> None:
    """Show the warnings held during the sweep, each text once (from where it was raised)."""
    seen: set[tuple[type[Warning], str]] = set()
    for item in caught:
        key = (item.category, str(item.message))
        if key in seen:
            continue
        seen.add(key)
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


def _run_config(
    options: SweepOptions,
    factory: LoaderFactory,
    num_workers: int,
    position: int,
    *,
    gpu_available: bool,
    progress: Progress,
) -> ConfigResult:
    """One configuration: build the loader, watch it for every epoch, judge, clean up.

    NOTE [the watch() code path]: the loader is iterated through ``WatchedLoader``, built as
    ``watch()`` builds it, so every DataLoader (the built-in one or a ``--loader``) gets the
    chained ``worker_init_fn``: exact worker identities through the mailbox, each worker's
    own report of what it held at exit, and the teardown policy (``SweepOptions.teardown``).
    The loader is built before the tracker starts, as ``watch(DataLoader(...))`` does;
    a DataLoader starts no worker before it is iterated.
    """
    cooldown = None
    if options.cooldown_temp_c is not None:
        cooldown = wait_for_cooldown(
            options.cooldown_temp_c,
            options.cooldown_timeout_s,
            device_index=options.device_index or 0,
            gpu_available=gpu_available,
        )
        progress.note(f"workers={num_workers}: {cooldown.describe()}")
    started_s = time.monotonic()
    loader = _build_loader(factory, num_workers)
    if num_workers and not hasattr(loader, "worker_init_fn"):
        unchecked = (
            ""
            if isinstance(getattr(loader, "num_workers", None), int)
            else ("its worker count is not checked and ")
        )
        progress.note(
            f"workers={num_workers}: the loader is a {type(loader).__name__}, not a DataLoader: "
            f"{unchecked}its workers report nothing of themselves (their processes are still "
            "tracked)"
        )
    # The loader's own setting counts too: its workers say so through the mailbox anyway.
    persistent = num_workers > 0 and (
        options.persistent or bool(getattr(loader, "persistent_workers", False))
    )
    tracker = Tracker(
        interval=options.interval_s,
        devices=None if options.device_index is None else [options.device_index],
        tolerance=options.tolerance_bytes,
        warmup_epochs=options.warmup_epochs,
        grace=options.grace_s,
        persistent_workers=persistent,
        # Always asked: where NVML is unavailable the tracker records why, in its words.
        use_nvml=True,
        rollup_share=options.rollup_share,
        # Each row's orphan count is its epoch end's, however short the epochs.
        scan_at_epoch_end=True,
        copy_tolerance=options.copy_tolerance_bytes,
    )
    watched = WatchedLoader(loader, tracker=tracker, on_leak="ignore", teardown=options.teardown)
    del loader  # the wrapper holds the only reference: dropping it stops persistent workers
    failure: LoaderError | None = None
    timings: list[tuple[int | None, float, float]] = []
    cleaned: tuple[CleanedProcess, ...] = ()
    cost: TrackerCost | None = None
    try:
        # Even on Ctrl-C, leaving the block stops sampling (after the workers are gone).
        with watched:
            failure = _run_epochs(watched, options, num_workers, position, progress, timings)
            # What tracking cost the epochs, before close() waits out the grace period.
            cost = tracker.cost()
    finally:
        # Then remove what this configuration left behind (NOTE [cleanup]).
        if options.cleanup and tracker.session_id:
            cleaned = cleanup_orphans(tracker.session_id)
            for item in cleaned:
                progress.note(
                    f"workers={num_workers}: cleanup: {item.outcome} leftover PID {item.pid} "
                    f"of this sweep ({item.cmdline})"
                )
    if failure is not None:
        raise failure
    report = watched.report()
    counts = epoch_counts(report.timeline, report.config.grace_s)
    rows = tuple(
        _timed(
            epoch_row(record, num_workers, report, options.device_index, counts[record.index]),
            timings,
        )
        for record in report.epochs
    )
    return ConfigResult(
        num_workers=num_workers,
        persistent_workers=persistent,
        rows=rows,
        report=report,
        cooldown=cooldown,
        cleaned=cleaned,
        wall_s=time.monotonic() - started_s,
        cost=cost,
    )


def _timed(row: EpochRow, timings: list[tuple[int | None, float, float]]) -> EpochRow:
    """The row with its epoch's loop timing, where the loop timed it."""
    if row.epoch >= len(timings):
        return row
    samples, wait_s, loop_s = timings[row.epoch]
    return dataclasses.replace(row, samples=samples, wait_s=wait_s, loop_s=loop_s)


def _build_loader(factory: LoaderFactory, num_workers: int) -> Iterable[Any]:
    """``FACTORY(num_workers)``, or a one-line ``LoaderError`` saying why there is none."""
    name = getattr(factory, "__qualname__", "FACTORY")
    try:
        loader: object = factory(num_workers)
    except Exception as exc:
        raise LoaderError(f"calling {name}({num_workers}) failed: {one_line(exc)}") from None
    if loader is None or not isinstance(loader, Iterable):
        raise LoaderError(
            f"{name}({num_workers}) returned {type(loader).__name__}, "
            "expected an iterable loader (such as a DataLoader)"
        )
    declared = getattr(loader, "num_workers", None)
    if isinstance(declared, int) and declared != num_workers:
        # The sweep compares worker counts: a row labelled with one count must have it.
        raise LoaderError(
            f"{name}({num_workers}) returned a loader with num_workers={declared}, expected "
            f"{num_workers}: pass the argument on to the DataLoader"
        )
    return loader


def _run_epochs(
    watched: WatchedLoader[Any],
    options: SweepOptions,
    num_workers: int,
    position: int,
    progress: Progress,
    timings: list[tuple[int | None, float, float]],
) -> LoaderError | None:
    """Iterate the watched loader for every epoch, with progress per batch.

    Each epoch's ``(samples, wait_s, loop_s)`` goes to ``timings`` (``EpochRow`` says what
    each is). A loader failure is returned, not raised, so that the caller closes the
    tracker and cleans up first.
    """
    total = _length(watched)
    config_label = f"workers={num_workers}"
    first_batches: int | None = None
    try:
        for epoch in range(options.epochs):
            progress.begin(
                f"config {position + 1}/{len(options.workers)} {config_label} "
                # The table's epoch number, and how far along the sweep is.
                f"epoch {epoch} ({epoch + 1} of {options.epochs})"
            )
            batches = 0
            samples: int | None = 0
            wait_s = 0.0
            started_s = handled_s = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    # An exhausted iterable is this sweep's usage error (below), not a warning.
                    warnings.filterwarnings("ignore", message=r"leakcheck: epoch \d+ .* no batches")
                    batch_iter = iter(watched)  # one iter() is one epoch (NOTE [epoch ends])
                    while True:
                        asked_s = time.perf_counter()
                        try:
                            batch = next(batch_iter)
                        except StopIteration:
                            break
                        wait_s += time.perf_counter() - asked_s
                        batches += 1
                        size = batch_samples(batch)
                        samples = None if samples is None or size is None else samples + size
                        del batch
                        progress.batch(batches, total)
                        handled_s = time.perf_counter()
            except Exception as exc:
                return LoaderError(
                    f"iterating the loader ({config_label}, epoch {epoch}) failed: {one_line(exc)}"
                )
            timings.append((samples, wait_s, handled_s - started_s))
            if first_batches is None:
                first_batches = batches
            elif batches == 0 and first_batches > 0:
                return LoaderError(
                    f"the loader ({config_label}) yielded no batches in epoch {epoch}, where "
                    f"epoch 0 yielded {first_batches}: it can be iterated once (a generator or "
                    "an iterator); return one that can be iterated again, such as a DataLoader"
                )
            # A sweep's epochs can be shorter than the USS reads the sampler thread makes after
            # each end: waiting for them here keeps every row's host memory a USS of that
            # epoch's end (the wait counts as the loop's time inside leakcheck).
            watched.tracker.finish_reads()
            # The summary reads the tracker's epochs: only when it is printed.
            progress.end(_epoch_summary(watched.tracker, batches) if progress.wants_summary else "")
    finally:
        # Drop the loader before the tracker closes: persistent workers shut down when
        # their iterator is collected, and their exit (and teardown reports) belong to
        # this configuration.
        watched.drop_loader()
        gc.collect()
        _empty_parent_cache()
    return None


def _empty_parent_cache() -> None:
    """Give the parent's cached CUDA blocks back between configurations.

    Only where torch already initialised CUDA in this process (never initialise it here):
    the allocator's cache of one configuration would otherwise count in the next one's
    baseline. The context itself stays (the ``context-kept`` advice says so).
    """
    cuda = initialized_cuda()
    if cuda is not None:
        with contextlib.suppress(Exception):
            cuda.empty_cache()


def _epoch_summary(tracker: Tracker, batches: int) -> str:
    timeline = tracker.timeline(last_epochs=1)
    if not timeline.epochs:
        return f"{batches} batches"
    record: EpochRecord = timeline.epochs[-1]
    counted = record.batches if record.batches is not None else batches
    workers = [p for p in record.processes if p.role == "worker"]
    host = host_totals(record.processes)
    gpu = ""  # no per-process GPU bytes read (no GPU): the header said so, not repeated here
    if timeline.attribution == "ok":
        parent = sum(p.total_gpu_bytes_end for p in record.processes if p.role == "parent")
        worker_bytes = sum(p.total_gpu_bytes_end for p in workers)
        gpu = f"GPU parent {format_mib(parent)} MiB, workers {format_mib(worker_bytes)} MiB; "
    return (
        f"{counted} batches in {record.duration_s:.1f} s, {len(workers)} workers; {gpu}"
        f"host {host.source or '-'} parent {format_mib(host.parent_bytes)} MiB, workers "
        f"{format_mib(host.workers_bytes)} MiB"
    )


def batch_samples(batch: Any) -> int | None:
    """The samples in a batch: the leading dimension of its first tensor (or array).

    What ``default_collate`` makes of any sample (a tensor, a tuple, a list or a dict of
    them) has the batch's size as its first tensor's first dimension. None: no such tensor.
    """
    while True:
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, list | tuple):
            batch = batch[0] if batch else None
        else:
            break
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if isinstance(shape, tuple | list) and shape else None


def _length(loader: Iterable[Any]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except Exception:
        return None


def one_line(exc: BaseException) -> str:
    """An exception as one line: ``TypeName: message`` with its whitespace folded."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- rows


def _pick_device(devices: Iterable[DeviceState], index: int | None) -> DeviceState | None:
    devices = tuple(devices)
    for device in devices:
        if index is None or device.index == index:
            return device
    return None


def epoch_row(
    record: EpochRecord,
    num_workers: int,
    report: Report,
    device_index: int | None,
    counts: EpochCounts,
) -> EpochRow:
    """Fold one epoch record, and what its end left running, into a table row."""
    processes = record.processes
    workers = [p for p in processes if p.role == "worker"]
    others = [p for p in processes if p.role in ("descendant", "orphan")]
    worker_end = [p.total_gpu_bytes_end for p in workers]
    device = _pick_device(record.devices, device_index)
    per_process = per_pid_bytes_known(report.timeline)

    def known(value: int) -> int | None:
        return value if per_process else None

    peak = workers_peak_bytes(workers)  # None when any worker's peak is unknown
    if peak is not None:
        peak = max(peak, sum(worker_end))  # peak >= end per process, so the sums keep it
    host = host_totals(processes)
    copied = [p for p in workers if p.copied_bytes_end is not None]
    return EpochRow(
        num_workers=num_workers,
        epoch=record.index,
        label=record.label,
        duration_s=record.duration_s,
        end_reason=record.end_reason,
        parent_gpu_bytes=known(sum(p.total_gpu_bytes_end for p in processes if p.role == "parent")),
        worker_count=len(workers),
        workers_gpu_bytes=known(sum(worker_end)),
        worker_gpu_bytes_max=known(max(worker_end, default=0)),
        workers_gpu_bytes_peak=peak if per_process else None,
        alive_after=counts.alive_after,
        orphans=counts.orphans,
        other_gpu_bytes=known(sum(p.total_gpu_bytes_end for p in others)),
        workers_peak_reported=known(sum(1 for p in workers if p.gpu_peak_source == "reported")),
        workers_peak_unknown=known(sum(1 for p in workers if p.gpu_peak_source == "unknown")),
        batches=record.batches,
        parent_host_bytes=host.parent_bytes,
        workers_host_bytes=host.workers_bytes,
        host_source=host.source,
        workers_shared_bytes=sum(p.shared_bytes_end or 0 for p in copied) if copied else None,
        workers_copied_bytes=sum(p.copied_bytes_end or 0 for p in copied) if copied else None,
        shm_bytes=record.shm_bytes,
        device_used_bytes=None if device is None else device.used_bytes,
        device_total_bytes=None if device is None else device.total_bytes,
        temperature_c=None if device is None else device.temperature_c,
        sm_clock_mhz=None if device is None else device.sm_clock_mhz,
        power_w=None if device is None else device.power_w,
        error=record.error,
    )


# --------------------------------------------------------------------------- cooldown


def wait_for_cooldown(
    target_c: float,
    timeout_s: float,
    *,
    device_index: int = 0,
    gpu_available: bool = True,
    poll_s: float = _COOLDOWN_POLL_S,
) -> Cooldown:
    """Wait until the GPU is at or below ``target_c`` degrees, at most ``timeout_s``.

    Temperature changes timings by about 10% on long runs, so configurations compared
    side by side should start equally cool.
    """
    if not gpu_available:
        return Cooldown(target_c, None, None, 0.0, False, note="skipped: no GPU to read")
    started_s = time.monotonic()

    def read() -> int | None:
        try:
            states = nvml.get().devices([device_index])
        except LeakCheckError:
            return None
        return states[0].temperature_c if states else None

    first = current = read()
    if first is None:
        return Cooldown(target_c, None, None, 0.0, False, note="skipped: temperature unknown")
    while current is not None and current > target_c:
        if time.monotonic() - started_s >= timeout_s:
            break
        time.sleep(poll_s)
        current = read()
    reached = current is not None and current <= target_c
    return Cooldown(target_c, first, current, time.monotonic() - started_s, reached)


# --------------------------------------------------------------------------- cleanup


def cleanup_orphans(
    session_id: str, *, wait_s: float = _CLEANUP_WAIT_S
) -> tuple[CleanedProcess, ...]:
    """Terminate live processes tagged with ``session_id`` that left this process's tree.

    Only processes whose environment carries this session's tag and that are no longer
    below this process are signalled: the orphans this sweep created (see NOTE
    [cleanup]). Each identity is checked again right before the signal.

    Returns:
        One entry per process found, with what happened to it.

    """
    import psutil

    me = os.getpid()
    tagged = [info for info in procs.scan_all(session_id=session_id) if info.tagged]
    own = {info.key.pid for info in procs.descendants(me, with_cmdline=False)} | {me}
    leftovers = [info for info in tagged if info.key.pid not in own]
    cleaned: list[CleanedProcess] = []
    victims: list[tuple[Any, str, Any]] = []
    for info in leftovers:
        cmdline = process_name(info.cmdline)
        try:
            # psutil holds the process from here on (and refuses to signal its PID once
            # reused); /proc says whether it is still the one the scan found.
            process = psutil.Process(info.key.pid)
            now = procs.process_key(info.key.pid)
            if now is None:
                raise psutil.NoSuchProcess(info.key.pid)
            if now != info.key or procs.tagged_session(info.key.pid) != session_id:
                continue  # the PID now belongs to someone else: never touch it
            process.terminate()
        except psutil.NoSuchProcess:
            cleaned.append(_cleaned(info, cmdline, "gone"))
            continue
        except psutil.Error as exc:
            cleaned.append(_cleaned(info, cmdline, f"failed: {exc}"))
            continue
        victims.append((info, cmdline, process))
    _gone, alive = psutil.wait_procs([process for _, _, process in victims], timeout=wait_s)
    alive_pids = {process.pid for process in alive}
    for info, cmdline, process in victims:
        outcome = "terminated"
        if process.pid in alive_pids:
            try:
                process.kill()  # psutil refuses if the PID was reused meanwhile
                outcome = "killed"
            except psutil.NoSuchProcess:
                pass  # it exited after all: the SIGTERM did it
            except psutil.Error as exc:
                outcome = f"failed: {exc}"
        cleaned.append(_cleaned(info, cmdline, outcome))
    return tuple(cleaned)


def _cleaned(info: ProcInfo, cmdline: str, outcome: str) -> CleanedProcess:
    key = info.key
    shown = procs.create_time_s(key.start_ticks)
    return CleanedProcess(key.pid, key.start_ticks, shown, cmdline, outcome)


# --------------------------------------------------------------------------- text


def teardown_summary(records: Iterable[TeardownRecord]) -> dict[str, Any]:
    """Totals of the worker teardowns: how many workers, contexts released, bytes freed.

    ``workers`` and the totals after it count the workers in which the teardown policy ran
    (it released what they held); ``reported`` counts every worker that reported at exit,
    those with the policy off (``teardown=False``: they only say what they held) included.
    """
    reported = tuple(records)
    records = tuple(r for r in reported if r.released)
    before = [r.gpu_bytes_before for r in records if r.gpu_bytes_before is not None]
    return {
        "workers": len(records),
        "reported": len(reported),
        "cuda_initialized": sum(1 for r in records if r.cuda_initialized),
        "contexts_released": sum(1 for r in records if r.context_released),
        "left_nvml": sum(1 for r in records if r.left_nvml),
        "freed_cache_bytes": sum(r.freed_cache_bytes for r in records),
        "gpu_bytes_before": sum(before) if before else None,
        "gpu_bytes_before_per_worker": (sum(before) // len(before)) if before else None,
        "errors": [r.error for r in reported if r.error],
    }


def reported_device_index(result: SweepResult) -> int | None:
    """The device whose memory and telemetry the rows show."""
    if result.options.device_index is not None:
        return result.options.device_index
    return result.devices[0].index if result.devices else None


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("workers", "configuration: DataLoader workers"),
    ("epoch", "epoch index"),
    ("time s", "epoch wall time"),
    ("GPU parent", "GPU memory of the parent process at the end of the epoch"),
    ("GPU wk peak", "sum of the workers' GPU peaks during the epoch (? when one is unknown)"),
    ("alive after", "processes born in the epoch still alive after it and its grace period"),
    ("orphans", "processes of the job reparented away, alive at the end"),
    ("host parent", "host memory of the parent at the end of the epoch (USS, else RSS)"),
    (
        "host wk",
        "host memory of the workers, summed: at the end of the epoch, or at exit for those "
        "gone by then (? when one is unknown)",
    ),
    ("host", "what the host figures are: uss (private), rss (resident), or uss+rss"),
    ("GPU used", "device memory used at the end of the epoch"),
    ("temp °C", "GPU temperature at the end of the epoch"),
)
"""The table's columns, in order: memory in MiB. A column without data on this machine (the
GPU's, without one) is left out; the JSON rows have every field, those not shown included."""
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in _COLUMNS)
TABLE_WIDTH = 120
"""The table is at most this many characters wide (``tests/test_sweep.py`` holds it)."""
_NO_DATA = frozenset((_UNAVAILABLE, "-"))


def row_cells(row: EpochRow, *, gpu_available: bool) -> list[str]:
    """The text cells of one row, in ``COLUMN_NAMES`` order (``n/a`` where not read)."""
    cells = {
        "workers": str(row.num_workers),
        "epoch": str(row.epoch),
        "time s": f"{row.duration_s:.2f}",
        "GPU parent": format_mib(row.parent_gpu_bytes),
        "GPU wk peak": _peak_cell(row),
        "alive after": str(row.alive_after),
        "orphans": str(row.orphans),
        "host parent": format_mib(row.parent_host_bytes),
        "host wk": _workers_host_cell(row),
        "host": row.host_source or "-",
        "GPU used": format_mib(row.device_used_bytes),
        "temp °C": or_dash(row.temperature_c),
    }
    if not gpu_available:
        for name in COLUMN_NAMES:
            if name.startswith(("GPU", "temp")):
                cells[name] = _UNAVAILABLE
    return [cells[name] for name in COLUMN_NAMES]


def _workers_host_cell(row: EpochRow) -> str:
    """The workers' host memory, ``?`` (never 0) when one of them is unknown."""
    if row.workers_host_bytes is None and row.worker_count and row.host_source is not None:
        return _UNKNOWN
    return format_mib(row.workers_host_bytes)


def _peak_cell(row: EpochRow) -> str:
    """The workers' peak, ``?`` (never 0) when one of them is unknown."""
    if row.workers_peak_unknown:
        return _UNKNOWN
    return format_mib(row.workers_gpu_bytes_peak)


def unknown_peak_note(result: SweepResult) -> str | None:
    """The line under the table that says what ``?`` means, when one appears."""
    rows = [row for config in result.configs for row in config.rows]
    unknown = sum(row.workers_peak_unknown or 0 for row in rows)
    if not result.gpu_available or not unknown:
        return None
    epochs = sum(1 for row in rows if row.workers_peak_unknown)
    return (
        f"{_UNKNOWN} = not known, not 0: {plural(unknown, 'worker')} in "
        f"{plural(epochs, 'epoch')} exited before any read saw them on a GPU "
        "and reported nothing at exit (column wk ?), so the workers' peak of those epochs is "
        "unknown"
    )


def format_table(result: SweepResult) -> list[str]:
    """The per-epoch table, one line per (workers, epoch), header first.

    Only the columns with data on this machine: a column whose every cell is ``n/a`` or
    ``-`` (the GPU's, without one; temperatures a driver does not give) is left out.
    """
    rows = [
        row_cells(row, gpu_available=result.gpu_available)
        for config in result.configs
        for row in config.rows
    ]
    shown = [
        index
        for index in range(len(COLUMN_NAMES))
        if index < 3 or any(cells[index] not in _NO_DATA for cells in rows)
    ]
    table = [[COLUMN_NAMES[i] for i in shown], *([cells[i] for i in shown] for cells in rows)]
    return align_columns(table)


def format_answer(result: SweepResult) -> list[str]:
    """The worker-count table (one line per configuration) and the recommendation under it.

    Throughput in samples per second (batches, where a batch's size could not be read) and
    memory per worker (the most of any epoch; ``-`` without workers, ``?`` where not read);
    the GPU column only where a GPU was read. The share of the loop spent waiting for batches
    is in the JSON only: the sweep's loop does no training step, so it waits all the time.
    """
    answer = recommendation(result)
    if answer is None:
        return []  # nothing was timed (a result built by hand)
    unit = answer.unit
    header = ["workers", f"{unit}/s", "host MiB/wk"]
    if result.gpu_available:
        header.append("GPU MiB/wk")
    table = [header]
    for config in result.configs:
        rate = config.samples_per_s if unit == "samples" else config.batches_per_s
        per_worker = [config.worker_host_bytes, config.worker_gpu_bytes]
        memory = [
            "-" if not config.num_workers else _UNKNOWN if value is None else format_mib(value)
            for value in per_worker
        ]
        cells = [
            str(config.num_workers),
            _UNAVAILABLE if rate is None else f"{rate:,.0f}",
            *memory,
        ]
        table.append(cells[: len(header)])
    return [*align_columns(table), answer.describe(gpu_available=result.gpu_available)]


def _device_line(device: DeviceState) -> str:
    parts = [f"GPU {device.index}: {device.name}", f"{format_mib(device.total_bytes)} MiB"]
    if device.sm_clock_max_mhz is not None:
        parts.append(f"SM clock max {device.sm_clock_max_mhz} MHz")
    return ", ".join(parts)


def _config_lines(config: ConfigResult) -> list[str]:
    report = config.report
    mode = "persistent workers" if config.persistent_workers else "workers per epoch"
    head = (
        f"workers={config.num_workers} ({mode if config.num_workers else 'no workers'}, "
        f"{config.wall_s:.1f} s): verdict {report.verdict.upper()}"
    )
    lines = [head]
    if config.cooldown is not None:
        lines.append(f"  {config.cooldown.describe()}")
    lines.extend(report.finding_lines(indent="  "))
    teardown = teardown_summary(config.teardowns)
    if teardown["workers"] and not teardown["cuda_initialized"]:
        lines.append(
            f"  teardown: {plural(teardown['workers'], 'worker')} exited through the teardown "
            "policy "
            "(CUDA never initialised in them: nothing to release)"
        )
    elif teardown["workers"]:
        per_worker = teardown["gpu_bytes_before_per_worker"]
        freed = "" if per_worker is None else f", {format_mib(per_worker)} MiB per worker freed"
        lines.append(
            f"  teardown: {plural(teardown['workers'], 'worker')}, {teardown['contexts_released']} "
            f"released their CUDA context before exiting{freed}"
        )
    elif teardown["reported"]:
        count = teardown["reported"]
        lines.append(
            f"  teardown: policy off; {plural(count, 'worker')} reported what "
            "they held at exit and released nothing"
        )
    for cleaned in config.cleaned:
        lines.append(
            f"  cleanup: {cleaned.outcome} PID {cleaned.pid} (left over by this sweep: "
            f"{cleaned.cmdline})"
        )
    fraction = config.accounted_cost_fraction
    epochs_s = sum(record.duration_s for record in report.epochs)
    # Said where it means something: a share of a loop too short to time is noise.
    if fraction is not None and config.cost is not None and _cost_worth_saying(fraction, epochs_s):
        lines.append(
            f"  tracker cost: {fraction:.2%} of the epochs' time (sampler CPU "
            f"{config.cost.sampler_cpu_s * 1000:.0f} ms, the loop's time inside leakcheck "
            f"{config.cost.caller_wall_s * 1000:.0f} ms: "
            f"{config.cost.caller_wall_s * 1000 / max(1, len(report.epochs)):.1f} ms per epoch)"
        )
    lines.append(f"  {report.summary(gpu=False, named=False)}")  # GPU: said in the header
    return lines


COST_SHARE_SHOWN = 0.01
"""The tracker cost line shows from this share of the epochs' time..."""
COST_LOOP_SHOWN_S = 1.0
"""...of epochs this long together (the JSON always has the cost)."""


def _cost_worth_saying(fraction: float, epochs_s: float) -> bool:
    return fraction >= COST_SHARE_SHOWN and epochs_s >= COST_LOOP_SHOWN_S


def format_sweep(result: SweepResult) -> str:
    """Render a whole sweep as text (see ``SweepResult.format``)."""
    options = result.options
    lines = [
        f"leakcheck sweep: {result.loader}",
        f"  workers {','.join(str(n) for n in options.workers)} x {options.epochs} epochs; "
        f"tolerance {format_size(options.tolerance_bytes)}, grace {options.grace_s:g} s, "
        f"sampling every {options.interval_s * 1000:g} ms; "
        f"teardown policy {'on' if options.teardown else 'off'}",
    ]
    if result.gpu_available:
        lines.extend(f"  {_device_line(device)}" for device in result.devices)
    else:
        lines.append(f"  {gpu_unchecked(result.gpu_reason)}: host memory and processes only")
    lines.append("  memory in MiB; host: uss = private memory, rss = resident")
    lines.append("")
    lines.extend(format_table(result))
    note = unknown_peak_note(result)
    if note is not None:
        lines.extend(["", note])
    answer = format_answer(result)
    if answer:
        lines.extend(["", *answer])
    for config in result.configs:
        lines.append("")
        lines.extend(_config_lines(config))
    lines.append("")
    configs = len(result.configs)
    lines.append(
        f"leakcheck sweep: {plural(configs, 'configuration')}, "
        f"verdict {result.verdict}, {plural(result.leak_count, 'leak')}"
    )
    return "\n".join(lines)
