"""``leakcheck.Tracker``: the public front over the sampler (NOTE [tracker lifecycle]).

It validates options, times the caller's calls (``cost()``), and judges what was observed.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

from leakcheck.core import ranks
from leakcheck.core.errors import LeakCheckError, UsageError
from leakcheck.core.model import (
    EndReason,
    EpochRecord,
    ProcessKey,
    RuleConfig,
    TeardownRecord,
    Timeline,
    TrackerCost,
)
from leakcheck.core.options import parse_interval_option, parse_share_option
from leakcheck.core.units import parse_duration, parse_size
from leakcheck.judge.report import Report, build_report
from leakcheck.observe import torch_state
from leakcheck.observe.procs import process_key
from leakcheck.observe.snapshot import Snapshot, take_snapshot
from leakcheck.track.reads import CostMeter
from leakcheck.track.sampler import Sampler, end_reason_for

__all__ = ["Tracker", "end_reason_for", "own_rank_device"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _caller_timed(
    method: Callable[Concatenate[Tracker, _P], _R],
) -> Callable[Concatenate[Tracker, _P], _R]:
    """Add the wall time of a public call to the caller cost (outermost call only)."""

    @functools.wraps(method)
    def timed(tracker: Tracker, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        meter = tracker.meter
        if not meter.enter_call():
            return method(tracker, *args, **kwargs)
        started = time.perf_counter()
        try:
            return method(tracker, *args, **kwargs)
        finally:
            meter.leave_call(time.perf_counter() - started)

    return timed


def own_rank_device() -> tuple[int, int] | None:
    """``(rank, NVML index)`` of the device this rank chose with ``torch.cuda.set_device``.

    None outside a rank, before CUDA, or on device 0 (its ``LOCAL_RANK`` then says).
    """
    info = ranks.rank_from_environ(os.environ)
    if info is None:
        return None
    index = torch_state.current_device()
    if not index:
        return None
    device = ranks.physical_device(index, os.environ)
    return None if device is None else (info.rank, device)


def _is_int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


class Tracker:
    """Attribute GPU and host memory to every process of a job, per epoch.

    Use as a context manager::

        with leakcheck.Tracker() as tracker:
            for epoch in range(5):
                with tracker.epoch(f"epoch {epoch}"):
                    train_one_epoch()
        print(tracker.report().format())

    Args:
        root_pid: The job's root process (default: this process).
        interval: Seconds between background samples (default 0.05).
        devices: Device indices to watch (default: all).
        tolerance: Growth/residual below this is noise (``"16MiB"``, bytes).
        warmup_epochs: Epochs the growth rule ignores.
        grace: Seconds a process born in an epoch may outlive it.
        persistent_workers: Workers are expected to live across epochs.
        strict: Raise leakcheck's own failures instead of recording them.
        use_nvml: Read NVML (False: host-side checks only).
        session_tag: ``(NAME, VALUE)`` of the environment variable that finds processes
            reparented away instead of ``LEAKCHECK_SESSION`` (NOTE [run tag] in launcher.py).
        rollup_share: Share of the time USS and PSS reads at epoch ends may take (NOTE
            [host pacing]; default 0.1%); 1.0 reads at every epoch end.
        scan_at_epoch_end: Also scan for processes reparented away at each epoch end.
        copy_tolerance: What a forked worker may copy of its parent's memory before the
            copy-on-read rule calls it a leak (NOTE [copy on read] in hostmem.py).
        hang_after: Seconds the loop may wait for a batch before the job's stacks are
            written (NOTE [hang watch] in hang.py); 0: never.

    """

    def __init__(
        self,
        *,
        root_pid: int | None = None,
        interval: float | str = 0.05,
        devices: list[int] | None = None,
        tolerance: str | int = "16MiB",
        warmup_epochs: int = 1,
        grace: float | str = 2.0,
        persistent_workers: bool = False,
        strict: bool = False,
        use_nvml: bool = True,
        session_tag: tuple[str, str] | None = None,
        rollup_share: float | None = None,
        scan_at_epoch_end: bool = False,
        copy_tolerance: str | int = "64MiB",
        hang_after: float | str = 0,
    ) -> None:
        interval_s = parse_interval_option(interval, "interval")
        if rollup_share is not None:
            rollup_share = parse_share_option(rollup_share, "rollup_share")
        if not _is_int_at_least(warmup_epochs, 0):
            raise UsageError(f"warmup_epochs: expected an integer >= 0, got {warmup_epochs!r}")
        if devices is not None and not all(_is_int_at_least(d, 0) for d in devices):
            raise UsageError(f"devices: expected device indices >= 0, got {devices!r}")
        if root_pid is not None and not _is_int_at_least(root_pid, 1):
            raise UsageError(f"root_pid: expected a process ID > 0, got {root_pid!r}")
        if session_tag is not None and not (
            isinstance(session_tag, tuple)
            and len(session_tag) == 2
            and all(isinstance(part, str) and part and "\0" not in part for part in session_tag)
            and "=" not in session_tag[0]
        ):
            raise UsageError(
                f"session_tag: expected (NAME, VALUE) of an environment variable, got "
                f"{session_tag!r}"
            )
        self._config = RuleConfig(
            tolerance_bytes=parse_size(tolerance, source="tolerance"),
            warmup_epochs=warmup_epochs,
            grace_s=parse_duration(grace, source="grace"),
            copy_tolerance_bytes=parse_size(copy_tolerance, source="copy_tolerance"),
        )
        self._sampler = Sampler(
            root_pid=os.getpid() if root_pid is None else root_pid,
            interval_s=interval_s,
            devices=list(devices) if devices is not None else None,
            config=self._config,
            persistent_workers=persistent_workers,
            strict=strict,
            use_nvml=use_nvml,
            session_tag=session_tag,
            rollup_share=rollup_share,
            scan_at_epoch_end=bool(scan_at_epoch_end),
            hang_after_s=parse_duration(hang_after, source="hang_after"),
        )

    @property
    def meter(self) -> CostMeter:
        """The counters behind ``cost()``."""
        return self._sampler.meter

    @property
    def session_id(self) -> str:
        """The tag every child inherits as ``LEAKCHECK_SESSION`` (set by ``start()``)."""
        return self._sampler.session_id

    @property
    def mailbox_dir(self) -> str | None:
        """The folder the workers report to (NOTE [worker mailbox]); None before ``start()``."""
        return self._sampler.mailbox_dir

    @property
    def config(self) -> RuleConfig:
        """Rule thresholds resolved from the constructor's options."""
        return self._config

    @property
    def root_pid(self) -> int:
        """The job's root process."""
        return self._sampler.root_pid

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._sampler.closed

    @_caller_timed
    def start(self) -> Tracker:
        """Take the baseline and start the sampler thread. Idempotent."""
        self._sampler.start()
        return self

    @_caller_timed
    def close(self) -> None:
        """Close an open epoch, wait out undecided survivors (at most ``grace``), stop."""
        self._sampler.close()
        self._sampler.failures.raise_pending()

    def __enter__(self) -> Tracker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end_epoch(*(end_reason_for(exc) if exc is not None else ("closed", None)))
        self.close()

    @_caller_timed
    def begin_epoch(self, label: str | None = None) -> int:
        """Open an epoch (closing any open one as ``closed``); returns its index."""
        if not self._sampler.started:
            self.start()
        if self._sampler.closed:
            raise LeakCheckError("this Tracker is closed; create a new one to track more epochs")
        index = self._sampler.begin_epoch(label)
        self._sampler.failures.raise_pending()
        return index

    @_caller_timed
    def end_epoch(
        self,
        reason: EndReason = "completed",
        error: str | None = None,
        batches: int | None = None,
        *,
        index: int | None = None,
    ) -> bool:
        """Close the open epoch (only if it is ``index``, where given); True if one closed.

        ``error``: the exception that ended it, as one line; ``batches``: those it yielded.
        """
        closed = self._sampler.end_epoch(reason, error, batches, index)
        self._sampler.failures.raise_pending()
        return closed

    @contextmanager
    def epoch(self, label: str | None = None) -> Iterator[int]:
        """Context manager around one epoch; the end reason follows how the block ended."""
        index = self.begin_epoch(label)
        try:
            yield index
        except BaseException as error:
            self.end_epoch(*end_reason_for(error), index=index)
            raise
        else:
            self.end_epoch("completed", index=index)

    @_caller_timed
    def register_worker(
        self, pid: int, start_ticks: int | None = None, *, persistent: bool | None = None
    ) -> None:
        """Declare a process a worker of the job (exact identities, not a guess).

        ``start_ticks``: its start (NOTE [process identity] in procs.py; None: read now);
        ``persistent``: whether it lives across epochs (None: ``persistent_workers``).
        """
        key = process_key(pid) if start_ticks is None else ProcessKey(pid, start_ticks)
        if key is not None:
            with self._sampler.lock:
                self._sampler.register_worker(key, persistent)

    def batch_wanted(self) -> None:
        """The loop asks for its next batch: the hang watch counts the wait (one clock read)."""
        self._sampler.hang.batch_wanted()

    def batch_arrived(self) -> None:
        """A batch came, or the loop stopped asking for one: the wait is over."""
        self._sampler.hang.batch_arrived()

    def worker_stuck(self, pid: int) -> None:
        """A worker its loader's shutdown is about to terminate: its stacks, said and kept.

        To stderr and the report (NOTE [exit watch] in hang.py).
        """
        self._sampler.worker_stuck(pid)

    @_caller_timed
    def note_exit(self, pid: int, exit_code: int) -> None:
        """Tell how a process of the job ended; ``exit_code`` < 0 (minus the signal) is a death."""
        self._sampler.note_exit(pid, exit_code)
        self._sampler.failures.raise_pending()

    @_caller_timed
    def finish_reads(self) -> None:
        """Make now the USS and PSS reads the last epoch end left to the sampler thread.

        Call it before changing the job's processes right after an epoch (dropping a loader).
        """
        self._sampler.finish_reads()

    def worker_keys(self) -> list[ProcessKey]:
        """Workers registered so far."""
        with self._sampler.lock:
            table = self._sampler.table
            return sorted(table.workers) if table is not None else []

    @_caller_timed
    def sample(self) -> None:
        """Take one sample now, as the sampler thread does every ``interval`` (with a walk)."""
        with self._sampler.lock:
            self._sampler.sample(epoch_end=False, quick=True)
        self._sampler.failures.raise_pending()

    def cost(self) -> TrackerCost:
        """What tracking has cost so far (own time of the sampler and of the calling threads)."""
        return self.meter.snapshot()

    def epochs(self) -> tuple[EpochRecord, ...]:
        """Closed epochs so far."""
        return self.timeline().epochs

    def teardowns(self) -> tuple[TeardownRecord, ...]:
        """Teardown records the workers posted so far."""
        with self._sampler.lock:
            return tuple(self._sampler.book.teardowns)

    @_caller_timed
    def snapshot(self) -> Snapshot:
        """Who in the job holds what, right now (a fresh read, not the last sample)."""
        with self._sampler.lock:
            table = self._sampler.table
            births = table.births() if table is not None else {}
        return take_snapshot(
            root_pid=self._sampler.root_pid,
            devices=self._sampler.devices,
            known_workers=self.worker_keys(),
            births=births,
        )

    @_caller_timed
    def timeline(self, *, last_epochs: int | None = None, fresh: bool = False) -> Timeline:
        """All observations so far, frozen.

        Args:
            last_epochs: Only the latest this-many closed epochs (None: all).
            fresh: Before ``close()``, also read who is alive now and what each holds (the
                ``final`` state, ``closed=False``).

        """
        if last_epochs is not None and not _is_int_at_least(last_epochs, 1):
            raise UsageError(f"last_epochs: expected a positive int or None, got {last_epochs!r}")
        sampler = self._sampler
        own = own_rank_device() if sampler.root_pid == os.getpid() else None
        with sampler.lock:
            final = sampler.final
            if final is None and fresh and sampler.started and not sampler.closed:
                final = sampler.current_state(closed=False)
            table = sampler.table
            timeline = Timeline(
                session_id=sampler.session_id,
                root=sampler.root_key,
                started_unix_s=sampler.started_unix_s,
                boot_unix_s=sampler.boot_unix_s,
                attribution=sampler.nvml.attribution,
                attribution_reason=sampler.nvml.attribution_reason,
                baseline_devices=sampler.baseline_devices,
                baseline_gpu_bytes=dict(sampler.baseline_gpu_bytes),
                epochs=sampler.book.records(table, last=last_epochs) if table else (),
                final=final,
                failures=sampler.failures.lines(),
                teardowns=tuple(sampler.book.teardowns),
                # Files left in /dev/shm are judged once the work is over (at close).
                shm_files=sampler.shm_files if final is not None and final.closed else (),
                deaths=tuple(sampler.deaths),
                stalls=tuple(sampler.stalls),
                rank_devices={own[0]: own[1]} if own is not None else {},
            )
        return timeline

    @_caller_timed
    def report(self, *, last_epochs: int | None = None, fresh: bool = True) -> Report:
        """Judge what was observed (``fresh``: with a read of what is alive now).

        ``last_epochs``: judge only the latest this-many closed epochs.
        """
        timeline = self.timeline(last_epochs=last_epochs, fresh=fresh)
        self._sampler.failures.raise_pending()
        return build_report(timeline, self._config)
