"""The sweep engine: worker counts x epochs, one ``Tracker`` per configuration.

For each worker count it builds a fresh loader (``FACTORY(num_workers)``), iterates it for
some epochs through ``watch()``'s wrapper (NOTE [the watch() code path]) and keeps a row per
epoch (``judge.report.EpochRow``): a frozen ``SweepResult``, as text (``format``), JSON
(``to_dict``) and a picture (``judge.plot``, which reads it by shape).

NOTE [one tracker per configuration]: each configuration has its own tracker, so its own
session tag: a leftover of one configuration is never counted in the next, and the cleanup
after it (``cleanup_orphans``) signals only live, reparented processes with that tag, each
identity checked again right before the signal (NOTE [process identity] in procs.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from leakcheck.adapters.dataloader import WatchedLoader
from leakcheck.commands.common import one_line
from leakcheck.commands.progress import Progress
from leakcheck.core.errors import LeakCheckError
from leakcheck.core.files import environment
from leakcheck.core.model import MIB, DeviceState, ProcInfo, TrackerCost
from leakcheck.core.names import process_name
from leakcheck.core.records import to_jsonable
from leakcheck.core.units import format_mib, format_size, plural
from leakcheck.judge.report import (
    SCHEMA_VERSION,
    EpochRow,
    align_columns,
    column_table,
    combined_verdict,
    epoch_row,
    gpu_unchecked,
    or_dash,
)
from leakcheck.judge.verdict import epoch_counts
from leakcheck.observe import nvml, procs
from leakcheck.observe.torch_state import initialized_cuda
from leakcheck.track.tracker import Tracker

if TYPE_CHECKING:
    from leakcheck.core.model import TeardownRecord
    from leakcheck.judge.report import Report

SWEEP_SCHEMA_VERSION = 3
"""Version of ``SweepResult.to_dict``'s layout (docs/REFERENCE.md); bumped when incompatible."""

Timing = tuple[int | None, float, float]
"""An epoch's ``(samples, wait_s, loop_s)``, as the sweep's loop measured it."""

LoaderFactory = Callable[[int], Iterable[Any]]
"""``FACTORY(num_workers)``: returns an iterable loader; each ``iter()`` is one epoch."""


class LoaderError(LeakCheckError):
    """The loader could not be built or iterated; the message is one line."""


@dataclass(frozen=True)
class SweepOptions:
    """What to sweep and how to judge it (``rollup_share`` 1: every row's host memory a USS)."""

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
    hang_after_s: float = 0.0
    judge_failures: bool = False
    """A loader failure ends its configuration, judged, not the sweep (the failure stagings)."""


@dataclass(frozen=True)
class Cooldown:
    """The wait for the GPU to cool down before one configuration (``note``: why none)."""

    target_c: float
    start_c: int | None
    end_c: int | None
    waited_s: float
    reached: bool
    note: str = ""

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
    """A leftover process of the sweep; ``outcome``: terminated, killed, gone, failed: why."""

    pid: int
    start_ticks: int
    create_time: float
    cmdline: str
    outcome: str


@dataclass(frozen=True)
class ConfigResult:
    """One configuration of the sweep: its judged report, its loop's timings, its cleanup."""

    num_workers: int
    persistent_workers: bool
    report: Report
    device_index: int | None = None
    timings: tuple[Timing, ...] = ()
    cooldown: Cooldown | None = None
    cleaned: tuple[CleanedProcess, ...] = ()
    wall_s: float = 0.0
    cost: TrackerCost | None = None
    failure: str | None = None
    """How the loader failed, where ``judge_failures`` kept the configuration."""

    @functools.cached_property
    def rows(self) -> tuple[EpochRow, ...]:
        """The table's rows: each epoch record with its loop's timing."""
        timeline, timings = self.report.timeline, dict(enumerate(self.timings))
        counts = epoch_counts(timeline, self.report.config.grace_s)
        return tuple(
            epoch_row(
                rec, timeline, counts[rec.index], num_workers=self.num_workers,
                device_index=self.device_index, timing=timings.get(i),
            )
            for i, rec in enumerate(self.report.epochs)
        )  # fmt: skip

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
    def throughput(self) -> dict[str, float | None]:
        """The loop's speed, its share waiting, and the most memory per worker of any epoch.

        Samples and batches per second; host and GPU (peak) bytes; None where not read.
        """
        rows = self.rows

        def total(name: str) -> float | None:
            values = [getattr(row, name) for row in rows]
            return None if not values or None in values else sum(values)

        def per_worker(name: str) -> int | None:
            totals = [(getattr(row, name), row.worker_count) for row in rows]
            return max((total // n for total, n in totals if n and total is not None), default=None)

        samples, wait_s, loop_s = total("samples"), total("wait_s"), total("loop_s")
        batches = sum(row.batches or 0 for row in rows)
        return {
            "samples_per_s": None if samples is None or not loop_s else samples / loop_s,
            "batches_per_s": batches / loop_s if loop_s else None,
            "wait_share": None if wait_s is None or not loop_s else wait_s / loop_s,
            "worker_host_bytes": per_worker("workers_host_bytes"),
            "worker_gpu_bytes": per_worker("workers_gpu_bytes_peak"),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with the configuration's full ``Report.to_dict()``."""
        report = self.report
        data: dict[str, Any] = to_jsonable({
            "num_workers": self.num_workers,
            "persistent_workers": self.persistent_workers,
            "wall_s": self.wall_s,
            "verdict": report.verdict,
            "leak_count": len(report.leaks),
            "info_count": len(report.infos),
            "summary": report.summary(gpu=False, named=False),  # as the text says it
            "cooldown": self.cooldown,
            "rows": self.rows,
            "teardown": _teardown_summary(report.timeline.teardowns),
            "tracker_cost": self.cost,
            "accounted_cost_fraction": self.accounted_cost_fraction,
            "tracker_ms_per_epoch": self.tracker_ms_per_epoch,
            "throughput": self.throughput,
            "cleanup": self.cleaned,
            "failure": self.failure,
        })  # fmt: skip
        return data | {"report": report.to_dict()}


RECOMMEND_WITHIN = 0.05
"""The recommended worker count is the smallest within this share of the best throughput."""


def recommend_workers(rates: Mapping[int, float | None]) -> int | None:
    """The fewest workers within ``RECOMMEND_WITHIN`` of the best rate (None: none measured)."""
    measured = {n: rate for n, rate in rates.items() if rate is not None}
    if not measured:
        return None
    best = max(measured.values())
    return min(n for n, rate in measured.items() if rate >= best * (1 - RECOMMEND_WITHIN))


@dataclass(frozen=True)
class Recommendation:
    """The fewest workers near the best throughput, and their cost (None: not read).

    ``unit``: what the rates count, ``samples``, or ``batches`` where no batch's size was read.
    """

    num_workers: int
    rate_per_s: float
    unit: str
    best_workers: int
    best_rate_per_s: float
    worker_host_bytes: int | None
    worker_gpu_bytes: int | None

    def describe(self, *, gpu_available: bool) -> str:
        """One line: the count, its throughput against the best, its memory cost."""
        n = self.num_workers
        against = "the best"
        if self.best_workers != n:
            best = f"{self.best_rate_per_s:,.0f} at {self.best_workers}"
            against = f"within {RECOMMEND_WITHIN:.0%} of the best, {best}"
        costs = [("host", self.worker_host_bytes)]
        costs += [("GPU", self.worker_gpu_bytes)] if gpu_available else []
        cost = "costs " + ", ".join(
            f"{where} {format_mib(each * n)} MiB ({format_mib(each)} per worker)"
            if each is not None
            else f"{where} unknown"
            for where, each in costs
        )
        return (
            f"recommended: {plural(n, 'worker')} ({self.rate_per_s:,.0f} {self.unit}/s, "
            f"{against}); {cost if n else 'no worker memory'}"
        )


@dataclass(frozen=True)
class SweepResult:
    """Everything a sweep observed and judged (``loader``: one line that describes it)."""

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

    @property
    def recommendation(self) -> Recommendation | None:
        """The worker-count answer (``recommend_workers`` on the throughputs; None: untimed)."""
        throughputs = {c.num_workers: c.throughput for c in self.configs}
        counted = all(t["samples_per_s"] is not None for t in throughputs.values())
        unit = "samples" if counted else "batches"
        rates = {n: t[f"{unit}_per_s"] for n, t in throughputs.items()}
        chosen = recommend_workers(rates)
        if chosen is None:
            return None
        best = max((n for n in rates if rates[n] is not None), key=lambda n: rates[n] or 0.0)
        host, gpu = (throughputs[chosen][f"worker_{where}_bytes"] for where in ("host", "gpu"))
        return Recommendation(
            num_workers=chosen,
            rate_per_s=rates[chosen] or 0.0,
            unit=unit,
            best_workers=best,
            best_rate_per_s=rates[best] or 0.0,
            worker_host_bytes=None if host is None else int(host),
            worker_gpu_bytes=None if gpu is None or not self.gpu_available else int(gpu),
        )

    @property
    def recommendation_line(self) -> str | None:
        """The worker-count answer in one line (None: nothing was timed)."""
        answer = self.recommendation
        return None if answer is None else answer.describe(gpu_available=self.gpu_available)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data, with ``schema`` and ``schema_version``."""
        reported = self.options.device_index
        if reported is None and self.devices:
            reported = self.devices[0].index
        data: dict[str, Any] = to_jsonable({
            "schema": "leakcheck.commands.sweep",
            "schema_version": SWEEP_SCHEMA_VERSION,
            "report_schema_version": SCHEMA_VERSION,
            "started_unix_s": self.started_unix_s,
            "wall_s": self.wall_s,
            "loader": self.loader,
            "options": self.options,
            "environment": self.environment,
            "gpu": {
                "available": self.gpu_available,
                "reason": self.gpu_reason,
                "reported_device": reported,
                "devices": self.devices,
            },
            "verdict": self.verdict,
            "leak_count": self.leak_count,
            "recommendation": self.recommendation,
        })  # fmt: skip
        return data | {"configurations": [config.to_dict() for config in self.configs]}

    def format(self) -> str:
        """The text report: header, the table, then per configuration its verdict."""
        options = self.options
        lines = [
            f"leakcheck sweep: {self.loader}",
            f"  workers {','.join(str(n) for n in options.workers)} x {options.epochs} epochs; "
            f"tolerance {format_size(options.tolerance_bytes)}, grace {options.grace_s:g} s, "
            f"sampling every {options.interval_s * 1000:g} ms; "
            f"teardown policy {'on' if options.teardown else 'off'}",
        ]
        for device in self.devices if self.gpu_available else ():
            size, clock = format_mib(device.total_bytes), device.sm_clock_max_mhz
            max_clock = "" if clock is None else f", SM clock max {clock} MHz"
            lines.append(f"  GPU {device.index}: {device.name}, {size} MiB{max_clock}")
        if not self.gpu_available:
            lines.append(f"  {gpu_unchecked(self.gpu_reason)}: host memory and processes only")
        lines += ["  memory in MiB; host: uss = private memory, rss = resident", ""]
        lines += _format_table(self) + _format_answer(self)
        for config in self.configs:
            lines.extend(_config_lines(config))
        lines += [
            "",
            f"leakcheck sweep: {plural(len(self.configs), 'configuration')}, "
            f"verdict {self.verdict}, {plural(self.leak_count, 'leak')}",
        ]
        return "\n".join(lines)


# --------------------------------------------------------------------------- running


def run_sweep(
    options: SweepOptions,
    factory: LoaderFactory,
    *,
    loader: str,
    progress: Progress | None = None,
    gpu: tuple[bool, str] | None = None,
) -> SweepResult:
    """Run and judge every configuration (``gpu``: ``nvml.availability()``, if asked already).

    Raises:
        LoaderError: Calling the factory or iterating its loader failed (one line).

    """
    started_unix_s, started_s = time.time(), time.monotonic()
    gpu_available, gpu_reason = gpu if gpu is not None else nvml.availability()
    devices: tuple[DeviceState, ...] = ()
    if gpu_available:
        try:
            selected = None if options.device_index is None else [options.device_index]
            devices = nvml.get().devices(selected)
        except LeakCheckError as exc:
            gpu_available, gpu_reason = False, str(exc)
    progress = progress or Progress(0, enabled=False)
    # Warnings raised while the progress line is drawn (torch's "this DataLoader will create
    # 8 worker processes", each configuration) are held, then shown once each, the filters
    # in force deciding as always ("error" still raises).
    with warnings.catch_warnings(record=True) as caught:
        configs = tuple(
            _run_config(options, factory, n, position, gpu_available, progress)
            for position, n in enumerate(options.workers)
        )
    progress.close()
    once: dict[tuple[type[Warning], str], warnings.WarningMessage] = {}
    for item in caught:
        once.setdefault((item.category, str(item.message)), item)
    for item in once.values():
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    return SweepResult(
        options=options,
        loader=loader,
        configs=configs,
        gpu_available=gpu_available,
        gpu_reason=gpu_reason,
        devices=devices,
        started_unix_s=started_unix_s,
        wall_s=time.monotonic() - started_s,
        environment=environment(devices),
    )


def _run_config(
    options: SweepOptions,
    factory: LoaderFactory,
    num_workers: int,
    position: int,
    gpu_available: bool,
    progress: Progress,
) -> ConfigResult:
    """One configuration: build the loader, watch it for every epoch, judge, clean up.

    NOTE [the watch() code path]: the loader is iterated through ``WatchedLoader``, built as
    ``watch()`` builds it, so every DataLoader (built-in or ``--loader``) gets the chained
    ``worker_init_fn``: exact worker identities, each worker's report at exit, and the
    teardown policy. The loader is built before the tracker starts, as in
    ``watch(DataLoader(...))``: a DataLoader starts no worker before it is iterated.
    """
    label = f"workers={num_workers}"
    cooldown = None
    if options.cooldown_temp_c is not None:
        cooldown = wait_for_cooldown(
            options.cooldown_temp_c,
            options.cooldown_timeout_s,
            device_index=options.device_index or 0,
            gpu_available=gpu_available,
        )
        progress.note(f"{label}: {cooldown.describe()}")
    started_s = time.monotonic()
    loader = _build_loader(factory, num_workers)
    if num_workers and not hasattr(loader, "worker_init_fn"):
        counted = isinstance(getattr(loader, "num_workers", None), int)
        unchecked = "" if counted else "its worker count is not checked and "
        progress.note(
            f"{label}: the loader is a {type(loader).__name__}, not a DataLoader: "
            f"{unchecked}its workers report nothing of themselves (their processes are still "
            "tracked)"
        )
    persistent = num_workers > 0 and (
        options.persistent or bool(getattr(loader, "persistent_workers", False))
    )
    # The configuration's tracker (NOTE [one tracker per configuration]).
    tracker = Tracker(
        interval=options.interval_s,
        devices=None if options.device_index is None else [options.device_index],
        tolerance=options.tolerance_bytes,
        warmup_epochs=options.warmup_epochs,
        grace=options.grace_s,
        persistent_workers=persistent,
        rollup_share=options.rollup_share,
        scan_at_epoch_end=True,  # each row's orphans are its epoch end's
        copy_tolerance=options.copy_tolerance_bytes,
        hang_after=options.hang_after_s,
    )
    watched = WatchedLoader(loader, tracker=tracker, on_leak="ignore", teardown=options.teardown)
    del loader  # the wrapper holds the only reference: dropping it stops persistent workers
    timings: list[Timing] = []
    cleaned: tuple[CleanedProcess, ...] = ()
    try:
        with watched:  # on Ctrl-C too, leaving it stops sampling
            failure = _run_epochs(watched, options, label, position, progress, timings)
            cost = tracker.cost()  # before close() waits out the grace period
    finally:
        if options.cleanup and tracker.session_id:
            cleaned = cleanup_orphans(tracker.session_id)
            for item in cleaned:
                progress.note(
                    f"{label}: cleanup: {item.outcome} leftover PID {item.pid} "
                    f"of this sweep ({item.cmdline})"
                )
    if failure is not None and not options.judge_failures:
        raise failure
    return ConfigResult(
        num_workers=num_workers,
        persistent_workers=persistent,
        report=watched.report(),
        device_index=options.device_index,
        timings=tuple(timings),
        cooldown=cooldown,
        cleaned=cleaned,
        wall_s=time.monotonic() - started_s,
        cost=cost,
        failure=None if failure is None else str(failure),
    )


def _build_loader(factory: LoaderFactory, num_workers: int) -> Iterable[Any]:
    """``FACTORY(num_workers)``, or a one-line ``LoaderError`` saying why there is none."""
    call = f"{getattr(factory, '__qualname__', 'FACTORY')}({num_workers})"
    try:
        loader: object = factory(num_workers)
    except Exception as exc:
        raise LoaderError(f"calling {call} failed: {one_line(exc)}") from None
    if not isinstance(loader, Iterable):
        raise LoaderError(
            f"{call} returned {type(loader).__name__}, "
            "expected an iterable loader (such as a DataLoader)"
        )
    declared = getattr(loader, "num_workers", None)
    if isinstance(declared, int) and declared != num_workers:
        # The sweep compares worker counts: a row labelled with one count must have it.
        raise LoaderError(
            f"{call} returned a loader with num_workers={declared}, expected "
            f"{num_workers}: pass the argument on to the DataLoader"
        )
    return loader


def _run_epochs(
    watched: WatchedLoader[Any],
    options: SweepOptions,
    label: str,
    position: int,
    progress: Progress,
    timings: list[Timing],
) -> LoaderError | None:
    """Iterate every epoch into ``timings``; a loader failure is returned (cleanup comes first)."""
    try:
        total = len(watched)
    except Exception:
        total = None
    first_batches: int | None = None
    try:
        for epoch in range(options.epochs):
            progress.begin(
                f"config {position + 1}/{len(options.workers)} {label} "
                f"epoch {epoch} ({epoch + 1} of {options.epochs})"
            )
            batches, wait_s = 0, 0.0
            counted: int | None = 0
            started_s = handled_s = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    # An exhausted iterable is this sweep's usage error (below), not a warning.
                    warnings.filterwarnings("ignore", message=r"leakcheck: epoch \d+ .* no batches")
                    batch_iter = iter(watched)  # one iter() is one epoch (NOTE [epoch ends])
                    asked_s = time.perf_counter()
                    for batch in batch_iter:
                        wait_s += time.perf_counter() - asked_s
                        batches += 1
                        size = batch_samples(batch)
                        counted = None if counted is None or size is None else counted + size
                        del batch
                        progress.batch(batches, total)
                        asked_s = handled_s = time.perf_counter()
            except Exception as exc:
                # A worker's error ends in its cause (the DataLoader quotes its traceback).
                cause = str(exc).strip().splitlines()[-1:] if options.judge_failures else ()
                return LoaderError(
                    f"iterating the loader ({label}, epoch {epoch}) failed: "
                    + (cause[0] if cause else one_line(exc))
                )
            timings.append((counted, wait_s, handled_s - started_s))
            if first_batches is None:
                first_batches = batches
            elif batches == 0 and first_batches > 0:
                return LoaderError(
                    f"the loader ({label}) yielded no batches in epoch {epoch}, where "
                    f"epoch 0 yielded {first_batches}: it can be iterated once (a generator or "
                    "an iterator); return one that can be iterated again, such as a DataLoader"
                )
            # Epochs can be shorter than the USS reads the sampler makes after each end:
            # waiting for them keeps every row's host memory a USS of its epoch's end.
            watched.tracker.finish_reads()
            progress.end(_epoch_summary(watched.tracker, batches) if progress.wants_summary else "")
    finally:
        # Persistent workers shut down when their iterator is collected: before the tracker
        # closes, so that their exit and teardown reports belong to this configuration.
        watched.drop_loader()
        gc.collect()
        # The parent's cached CUDA blocks would count in the next configuration's baseline
        # (only where torch initialised CUDA already; the context stays: context-kept).
        cuda = initialized_cuda()
        if cuda is not None:
            with contextlib.suppress(Exception):
                cuda.empty_cache()
    return None


def _epoch_summary(tracker: Tracker, batches: int) -> str:
    timeline = tracker.timeline(last_epochs=1)
    if not timeline.epochs:
        return f"{batches} batches"
    row = epoch_row(timeline.epochs[-1], timeline)
    gpu = ""  # no per-process GPU bytes read: the header said so
    if row.parent_gpu_bytes is not None:
        gpu = (
            f"GPU parent {format_mib(row.parent_gpu_bytes)} MiB, "
            f"workers {format_mib(row.workers_gpu_bytes)} MiB; "
        )
    return (
        f"{batches if row.batches is None else row.batches} batches in {row.duration_s:.1f} s, "
        f"{row.worker_count} workers; {gpu}host {row.host_source or '-'} parent "
        f"{format_mib(row.parent_host_bytes)} MiB, workers {format_mib(row.workers_host_bytes)} MiB"
    )


def batch_samples(batch: Any) -> int | None:
    """The samples in a batch: the leading dimension of its first tensor (or array).

    What ``default_collate`` makes of any sample (a tensor, a tuple, a list or a dict of
    them) has the batch's size as its first tensor's first dimension. None: no such tensor.
    """
    while isinstance(batch, Mapping | list | tuple):
        batch = next(iter(batch.values() if isinstance(batch, Mapping) else batch), None)
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if isinstance(shape, tuple | list) and shape else None


def wait_for_cooldown(
    target_c: float,
    timeout_s: float,
    *,
    device_index: int = 0,
    gpu_available: bool = True,
    poll_s: float = 1.0,
) -> Cooldown:
    """Wait until the GPU is at or below ``target_c`` degrees, at most ``timeout_s``.

    Temperature changes timings by about 10% on long runs: compared configurations should
    start equally cool.
    """
    started_s = time.monotonic()

    def read() -> int | None:
        with contextlib.suppress(LeakCheckError):
            for state in nvml.get().devices([device_index]):
                return state.temperature_c
        return None

    first = current = read() if gpu_available else None
    if first is None:
        note = "temperature unknown" if gpu_available else "no GPU to read"
        return Cooldown(target_c, None, None, 0.0, False, note=f"skipped: {note}")
    while current is not None and current > target_c and time.monotonic() - started_s < timeout_s:
        time.sleep(poll_s)
        current = read()
    reached = current is not None and current <= target_c
    return Cooldown(target_c, first, current, time.monotonic() - started_s, reached)


def cleanup_orphans(session_id: str, *, wait_s: float = 3.0) -> tuple[CleanedProcess, ...]:
    """Terminate live processes tagged ``session_id`` that left this process's tree.

    The sweep's own orphans (NOTE [one tracker per configuration]); what happened to each.
    """
    import psutil

    me = os.getpid()
    own = {info.key.pid for info in procs.descendants(me, with_cmdline=False)} | {me}
    outcomes: dict[ProcInfo, str] = {}
    victims: dict[ProcInfo, psutil.Process] = {}
    for info in procs.scan_all(session_id=session_id):
        if not info.tagged or info.key.pid in own:
            continue
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
            victims[info] = process
        except psutil.NoSuchProcess:
            outcomes[info] = "gone"
        except psutil.Error as exc:
            outcomes[info] = f"failed: {exc}"
    _gone, alive = psutil.wait_procs(list(victims.values()), timeout=wait_s)
    for info, process in victims.items():
        outcomes[info] = "terminated"
        if process in alive:
            try:
                process.kill()  # psutil refuses if the PID was reused meanwhile
                outcomes[info] = "killed"
            except psutil.NoSuchProcess:
                pass  # it exited after all: the SIGTERM did it
            except psutil.Error as exc:
                outcomes[info] = f"failed: {exc}"
    return tuple(
        CleanedProcess(
            info.key.pid,
            info.key.start_ticks,
            procs.create_time_s(info.key.start_ticks),
            process_name(info.cmdline),
            outcome,
        )
        for info, outcome in outcomes.items()
    )


# --------------------------------------------------------------------------- text


def _teardown_summary(records: Iterable[TeardownRecord]) -> dict[str, Any]:
    """Totals of the workers the policy released; ``reported``: all that reported at exit."""
    reported = tuple(records)
    released = tuple(r for r in reported if r.released)
    before = [r.gpu_bytes_before for r in released if r.gpu_bytes_before is not None]
    return {
        "workers": len(released),
        "reported": len(reported),
        "cuda_initialized": sum(1 for r in released if r.cuda_initialized),
        "contexts_released": sum(1 for r in released if r.context_released),
        "left_nvml": sum(1 for r in released if r.left_nvml),
        "freed_cache_bytes": sum(r.freed_cache_bytes for r in released),
        "gpu_bytes_before": sum(before) if before else None,
        "gpu_bytes_before_per_worker": (sum(before) // len(before)) if before else None,
        "errors": [r.error for r in reported if r.error],
    }


# The table's columns (what each is: docs/REFERENCE.md; memory in MiB) and their cells: ``?``
# (never 0) where unknown; the GPU's say n/a without one.
_COLUMNS: tuple[tuple[str, Callable[[EpochRow], str]], ...] = (
    ("workers", lambda r: str(r.num_workers)),
    ("epoch", lambda r: str(r.epoch)),
    ("time s", lambda r: f"{r.duration_s:.2f}"),
    ("GPU parent", lambda r: format_mib(r.parent_gpu_bytes)),
    ("GPU wk peak", lambda r: r.workers_peak_text),
    ("alive after", lambda r: str(r.alive_after)),
    ("orphans", lambda r: str(r.orphans)),
    ("host parent", lambda r: format_mib(r.parent_host_bytes)),
    ("host wk", lambda r: r.workers_host_text),
    ("host", lambda r: r.host_source or "-"),
    ("GPU used", lambda r: format_mib(r.device_used_bytes)),
    ("temp °C", lambda r: or_dash(r.temperature_c)),
)  # fmt: skip
COLUMN_NAMES = tuple(name for name, _ in _COLUMNS)
TABLE_WIDTH = 120
"""The table is at most this many characters wide (``tests/test_sweep.py`` holds it)."""


def _format_table(result: SweepResult) -> list[str]:
    """The per-epoch table (a column with only n/a or - on this machine left out), its note."""
    rows = [row for config in result.configs for row in config.rows]
    blank = () if result.gpu_available else ("GPU", "temp")
    cells = [
        {name: "n/a" if name.startswith(blank) else cell(row) for name, cell in _COLUMNS}
        for row in rows
    ]
    table = column_table(COLUMN_NAMES, cells, ("n/a", "-"))
    unknown = sum(row.workers_peak_unknown or 0 for row in rows)
    if not result.gpu_available or not unknown:
        return table
    epochs = sum(1 for row in rows if row.workers_peak_unknown)
    return [
        *table,
        "",
        f"? = not known, not 0: {plural(unknown, 'worker')} in "
        f"{plural(epochs, 'epoch')} exited before any read saw them on a GPU "
        "and reported nothing at exit (column wk ?), so the workers' peak of those epochs is "
        "unknown",
    ]


def _format_answer(result: SweepResult) -> list[str]:
    """The worker-count table (``-``: no workers, ``?``: not read), the recommendation under it.

    The waiting share is in the JSON only: the sweep's loop does no step, so it always waits.
    """
    answer = result.recommendation
    if answer is None:
        return []  # nothing was timed (a result built by hand)
    header = ["workers", f"{answer.unit}/s", "host MiB/wk", "GPU MiB/wk"]
    header = header[: 4 if result.gpu_available else 3]
    table = [header]
    for config in result.configs:
        throughput = config.throughput
        rate = throughput[f"{answer.unit}_per_s"]
        memory = [
            "-" if not config.num_workers else "?" if value is None else format_mib(value)
            for value in (throughput["worker_host_bytes"], throughput["worker_gpu_bytes"])
        ]
        cells = [str(config.num_workers), "n/a" if rate is None else f"{rate:,.0f}", *memory]
        table.append(cells[: len(header)])
    return ["", *align_columns(table), answer.describe(gpu_available=result.gpu_available)]


def _config_lines(config: ConfigResult) -> list[str]:
    report = config.report
    mode = "persistent workers" if config.persistent_workers else "workers per epoch"
    lines = [
        "",
        f"workers={config.num_workers} ({mode if config.num_workers else 'no workers'}, "
        f"{config.wall_s:.1f} s): verdict {report.verdict.upper()}",
    ]
    if config.cooldown is not None:
        lines.append(f"  {config.cooldown.describe()}")
    lines.extend([f"  {config.failure}"] if config.failure else [])
    lines.extend(report.finding_lines(indent="  "))
    teardown = _teardown_summary(report.timeline.teardowns)
    workers = plural(teardown["workers"], "worker")
    per_worker = teardown["gpu_bytes_before_per_worker"]
    if teardown["workers"] and not teardown["cuda_initialized"]:
        lines.append(
            f"  teardown: {workers} exited through the teardown policy (CUDA never initialised "
            "in them: nothing to release)"
        )
    elif teardown["workers"]:
        freed = "" if per_worker is None else f", {format_mib(per_worker)} MiB per worker freed"
        lines.append(
            f"  teardown: {workers}, {teardown['contexts_released']} released their CUDA context "
            f"before exiting{freed}"
        )
    elif teardown["reported"]:
        lines.append(
            f"  teardown: policy off; {plural(teardown['reported'], 'worker')} reported what "
            "they held at exit and released nothing"
        )
    lines.extend(
        f"  cleanup: {cleaned.outcome} PID {cleaned.pid} (left over by this sweep: "
        f"{cleaned.cmdline})"
        for cleaned in config.cleaned
    )
    fraction, cost = config.accounted_cost_fraction, config.cost
    epochs_s = sum(record.duration_s for record in report.epochs)
    # Said from 1% of at least 1 s of epochs: a share of a loop too short to time is noise.
    if fraction is not None and cost is not None and fraction >= 0.01 and epochs_s >= 1:
        lines.append(
            f"  tracker cost: {fraction:.2%} of the epochs' time (sampler CPU "
            f"{cost.sampler_cpu_s * 1000:.0f} ms, the loop's time inside leakcheck "
            f"{cost.caller_wall_s * 1000:.0f} ms: {config.tracker_ms_per_epoch:.1f} ms per epoch)"
        )
    lines.append(f"  {report.summary(gpu=False, named=False)}")  # GPU: said in the header
    return lines
