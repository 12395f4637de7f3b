"""``leakcheck.Tracker``: a job's lifecycle over its sampler (NOTE [tracker lifecycle])."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

from leakcheck.core import ranks
from leakcheck.core.errors import LeakCheckError, UsageError
from leakcheck.core.model import (
    EndReason,
    EpochRecord,
    FinalState,
    ProcessKey,
    RuleConfig,
    TeardownRecord,
    Timeline,
    TrackerCost,
)
from leakcheck.core.options import parse_interval_option, parse_share_option
from leakcheck.core.units import parse_duration, parse_size
from leakcheck.judge.report import Report, build_report
from leakcheck.observe import mailbox, procs, torch_state
from leakcheck.observe.snapshot import Snapshot, take_snapshot
from leakcheck.track import claims, exports
from leakcheck.track.sampler import Sampler
from leakcheck.track.table import ProcessTable

__all__ = ["Tracker", "end_reason_for", "own_rank_device"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _caller_timed(
    method: Callable[Concatenate[Tracker, _P], _R],
) -> Callable[Concatenate[Tracker, _P], _R]:
    """Add the wall time of a public call to the caller cost (outermost call only)."""

    @functools.wraps(method)
    def timed(tracker: Tracker, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with tracker.meter.caller():
            return method(tracker, *args, **kwargs)

    return timed


def own_rank_device() -> tuple[int, int] | None:
    """``(rank, NVML index)`` of the device this rank chose with ``torch.cuda.set_device``.

    None outside a rank, before CUDA, or on device 0 (its ``LOCAL_RANK`` then says).
    """
    info = ranks.rank_from_environ(os.environ)
    index = torch_state.current_device() if info is not None else None
    device = ranks.physical_device(index, os.environ) if index else None
    return None if info is None or device is None else (info.rank, device)


def end_reason_for(error: BaseException | None) -> tuple[EndReason, str | None]:
    """Map how an epoch ended (the exception, or None) to its end reason and error line."""
    if error is None:
        return "completed", None
    if isinstance(error, KeyboardInterrupt):
        return "interrupt", "KeyboardInterrupt"
    if isinstance(error, GeneratorExit):
        return "break", None
    return "exception", f"{type(error).__name__}: {error}".splitlines()[0]


def _is_int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_options(
    warmup_epochs: object,
    devices: list[int] | None,
    root_pid: int | None,
    session_tag: tuple[str, str] | None,
    switches: Mapping[str, object],
) -> None:
    for name, value in switches.items():  # `strict="no"` would be true
        if not isinstance(value, bool):
            raise UsageError(f"{name}: expected True or False, got {value!r}")
    if not _is_int_at_least(warmup_epochs, 0):
        raise UsageError(f"warmup_epochs: expected an integer >= 0, got {warmup_epochs!r}")
    if devices is not None and not (
        isinstance(devices, (list, tuple)) and all(_is_int_at_least(d, 0) for d in devices)
    ):
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
            f"session_tag: expected (NAME, VALUE) of an environment variable, got {session_tag!r}"
        )


class Tracker(Sampler):
    """Attribute GPU and host memory to every process of a job, per epoch.

    Use as a context manager::

        with leakcheck.Tracker() as tracker:
            for epoch in range(5):
                with tracker.epoch(f"epoch {epoch}"):
                    train_one_epoch()
        print(tracker.report().format())

    Args:
        root_pid: The job's root process (default: this process).
        interval: Seconds between background samples.
        devices: Device indices to watch (default: all).
        tolerance: Growth or residual below this is noise (``"16MiB"``, bytes).
        warmup_epochs: Epochs the growth rule ignores.
        grace: Seconds a process born in an epoch may outlive it.
        strict: Raise leakcheck's own failures instead of recording them.
        session_tag: ``(NAME, VALUE)`` of the variable that finds processes reparented away
            in place of ``LEAKCHECK_SESSION`` (NOTE [run tag] in launcher.py).
        rollup_share: Share of the time USS and PSS reads may take (NOTE [host pacing]).
        copy_tolerance: What a forked worker may copy of its parent's memory.
        hang_after: Seconds without a batch before the job's stacks are written; 0: never.

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
        switches = dict(
            persistent_workers=persistent_workers,
            strict=strict,
            use_nvml=use_nvml,
            scan_at_epoch_end=scan_at_epoch_end,
        )
        _check_options(warmup_epochs, devices, root_pid, session_tag, switches)
        self._config = RuleConfig(
            tolerance_bytes=parse_size(tolerance, source="tolerance"),
            warmup_epochs=warmup_epochs,
            grace_s=parse_duration(grace, source="grace"),
            copy_tolerance_bytes=parse_size(copy_tolerance, source="copy_tolerance"),
        )
        self._persistent_workers, self._session_tag = persistent_workers, session_tag
        self._scan_at_epoch_end = scan_at_epoch_end
        super().__init__(
            root_pid=os.getpid() if root_pid is None else root_pid,
            interval_s=interval_s,
            devices=list(devices) if devices is not None else None,
            config=self._config,
            strict=strict,
            use_nvml=use_nvml,
            rollup_share=rollup_share,
            hang_after_s=parse_duration(hang_after, source="hang_after"),
        )
        self._started_unix_s = 0.0
        self._boot_unix_s: float | None = None
        self._export_token: int | None = None
        self._final: FinalState | None = None

    @property
    def session_id(self) -> str:
        """The tag every child inherits as ``LEAKCHECK_SESSION`` (set by ``start()``)."""
        return self.table.session if self.table is not None else ""

    @property
    def config(self) -> RuleConfig:
        """Rule thresholds resolved from the constructor's options."""
        return self._config

    @_caller_timed
    def start(self) -> Tracker:
        """Take the baseline and start the sampler thread. Idempotent."""
        with self.lock:
            if self.table is not None or self.closed:
                return self
            root_key = procs.root_key(self.root_pid, "root_pid")
            self._started_unix_s, self._boot_unix_s = time.time(), procs.boot_time_s()
            session = procs.new_session_id(self.root_pid)
            mailbox_dir = self.failures.guard(mailbox.create, "mailbox")
            if self._own_process:
                values = {procs.SESSION_ENV: session}
                if mailbox_dir:
                    values[mailbox.MAILBOX_ENV] = mailbox_dir
                self._export_token = exports.export(values)
            table = ProcessTable(
                root_key, procs.read_proc(self.root_pid), session=session,
                tag=self._session_tag, persistent_workers=self._persistent_workers,
            )  # fmt: skip
            self._baseline(table, mailbox_dir)
        self._start_thread()
        return self

    @_caller_timed
    def close(self) -> None:
        """Close an open epoch, wait out undecided survivors (at most ``grace``), stop."""
        table = self.table
        if table is not None and not self.closed:
            self._end("closed")
            with self.lock:
                pending, deadline = self.book.pending_survivors(table)
            while pending and self.now() < deadline and not self.stopping:
                time.sleep(min(self.interval_s, max(0.0, deadline - self.now())))
                with self.lock:
                    pending = [proc for proc in pending if proc.exited_s is None]
            with self.lock:  # at the deadline: "alive after the grace" is an observation
                self._sample(epoch_end=False)
            self._stop()
            self.finish_reads()  # planned at the last epoch end, not read yet
            with self.lock:
                self._final = self._current_state(closed=True)
                self._closed = True
                if self._export_token is not None:
                    exports.withdraw(self._export_token)
                    self._export_token = None
                if self.mailbox_dir:
                    mailbox.remove(self.mailbox_dir)
                claims.session_closed(self.session_id)
        self._closed = True
        self.failures.raise_pending()

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
        if self.table is None:
            self.start()
        table = self.table
        if self.closed or table is None:
            raise LeakCheckError("this Tracker is closed; create a new one to track more epochs")
        self._end("closed")
        # The reads the last end planned, before this epoch's work changes what they read.
        self.finish_reads()
        with self.lock:
            index = self.book.begin(label, self.now())
            self.failures.guard(self.shm.begin_epoch, "shm")
            claims.epoch_opened(table.session)
            table.changed = True
        self.failures.raise_pending()
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
        """Close the open epoch (only if it is ``index``, where given); True if one closed."""
        closed = self._end(reason, error, batches, index)
        self.failures.raise_pending()
        return closed

    def _end(
        self,
        reason: EndReason,
        error: str | None = None,
        batches: int | None = None,
        index: int | None = None,
    ) -> bool:
        """Close the open epoch with one full sample and the costlier extras."""
        with self.lock:
            opened, table = self.book.open, self.table
            if opened is None or table is None or index not in (None, opened.index):
                return False
            self._sample(epoch_end=True, scan_tags=self._scan_at_epoch_end)
            self.book.apply_accounting(table, self.nvml.accounting())
            if self._own_process:  # the loop's process is this one
                opened.pinned = torch_state.pinned_host_bytes()
            self.tag_scan_due = True
            host = self.host.end_status(table)
            shm = self.failures.guard(lambda: self.shm.epoch_end(table), "shm")
            self.book.end(
                table, now=self.now(), reason=reason, error=error, batches=batches,
                devices=self.nvml.device_states(), host=host, shm=shm,
            )  # fmt: skip
            own = None
            if self.host.plan(opened.index, table):
                # The loop's memory as its epoch ended, on its thread (NOTE [host pacing]).
                own = self.host.take(table.root) if self._own_process else None
                if self.host.pending is not None:
                    self._wake()  # the rest off this thread, right away
            claims.epoch_closed(table.session)
        if own is not None:
            self.host.read(own, self.lock, self.book.apply_rollup)
        return True

    def name_end(self, index: int, reason: EndReason, error: str | None) -> None:
        """Give ended epoch ``index`` the reason found after its end (NOTE [epoch ends])."""
        with self.lock:
            epochs = self.book.epochs
            record = epochs[index].record if 0 <= index < len(epochs) else None
            if record is not None and (record.end_reason, record.error) == ("exception", None):
                epochs[index].record = replace(record, end_reason=reason, error=error)

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
        key = procs.process_key(pid) if start_ticks is None else ProcessKey(pid, start_ticks)
        if key is not None:
            with self.lock:
                self._register_worker(key, persistent)

    def batch_wanted(self) -> None:
        """The loop asks for its next batch: the hang watch counts the wait (one clock read)."""
        self.hang.waiting_since_s = time.monotonic()

    def batch_arrived(self) -> None:
        """A batch came, or the loop stopped asking for one: the wait is over."""
        self.hang.waiting_since_s = None

    def worker_stuck(self, pid: int, joined_s: float) -> None:
        """A worker its shutdown joined ``joined_s`` and ends: its stacks (NOTE [exit watch])."""
        with self.lock:
            if self.table is None or self.closed:
                return
            self._sample(epoch_end=False)  # the mailbox: whether it dumps its stacks
            key = self.table.by_pid.get(pid) or procs.process_key(pid)
            if key is None or any(t.key == key and t.interrupted for t in self.book.teardowns):
                return  # a Ctrl-C reached it: interrupted, not stuck (NOTE [exit watch])
            proc, epoch = self.table.procs.get(key), self.book.open_index
        dumps = proc is not None and proc.dumps_stacks
        self._keep_stall([key] if dumps else [], epoch, joined_s, pid=key.pid)

    @_caller_timed
    def note_exit(self, pid: int, exit_code: int) -> None:
        """Tell how a process of the job ended; ``exit_code`` < 0 (minus the signal): a death."""
        if exit_code < 0:
            with self.lock:
                table = self.table
                if table is not None and not self.closed:
                    self._sample(epoch_end=False)  # the mailbox: one that died unregistered
                    proc = table.procs.get(table.by_pid.get(pid, ProcessKey(0, 0)))
                    if proc is not None and all(death.key != proc.key for death in self.deaths):
                        death = self.failures.guard(lambda: self._death(proc, -exit_code), "death")
                        if death is not None:
                            self.deaths.append(death)
        self.failures.raise_pending()  # strict mode: on every path, as each call of the tracker

    @_caller_timed
    def finish_reads(self) -> None:
        """Make now the host reads the last epoch end left to the thread (before a loader goes)."""
        super().finish_reads()

    def worker_keys(self) -> list[ProcessKey]:
        """Workers registered so far."""
        with self.lock:
            return sorted(self.table.workers) if self.table is not None else []

    @_caller_timed
    def sample(self) -> None:
        """Take one sample now, as the sampler thread does every ``interval`` (with a walk)."""
        with self.lock:
            self._sample(epoch_end=False, quick=True)
        self.failures.raise_pending()

    def cost(self) -> TrackerCost:
        """What tracking has cost so far (own time of the sampler and of the calling threads)."""
        return self.meter.snapshot()

    def epochs(self) -> tuple[EpochRecord, ...]:
        """Closed epochs so far."""
        return self.timeline().epochs

    def teardowns(self) -> tuple[TeardownRecord, ...]:
        """Teardown records the workers posted so far."""
        with self.lock:
            return tuple(self.book.teardowns)

    @_caller_timed
    def snapshot(self) -> Snapshot:
        """Who in the job holds what, right now (a fresh read, not the last sample)."""
        with self.lock:
            births = self.table.births() if self.table is not None else {}
        return take_snapshot(
            root_pid=self.root_pid,
            devices=self.devices,
            known_workers=self.worker_keys(),
            births=births,
        )

    @_caller_timed
    def timeline(self, *, last_epochs: int | None = None, fresh: bool = False) -> Timeline:
        """All observations so far, frozen: the latest ``last_epochs`` closed epochs (None: all).

        ``fresh``: before ``close()``, also read who is alive now (``final``, ``closed=False``).
        """
        if last_epochs is not None and not _is_int_at_least(last_epochs, 1):
            raise UsageError(f"last_epochs: expected a positive int or None, got {last_epochs!r}")
        own = own_rank_device() if self._own_process else None
        with self.lock:
            final, table = self._final, self.table
            if final is None and fresh and table is not None and not self.closed:
                final = self._current_state(closed=False)
            return Timeline(
                session_id=self.session_id,
                root=table.root if table is not None else ProcessKey(self.root_pid, 0),
                started_unix_s=self._started_unix_s,
                boot_unix_s=self._boot_unix_s,
                attribution=self.nvml.attribution,
                attribution_reason=self.nvml.attribution_reason,
                baseline_devices=self.baseline_devices,
                baseline_gpu_bytes=dict(self.baseline_gpu_bytes),
                epochs=self.book.records(table, last=last_epochs) if table else (),
                final=final,
                failures=self.failures.lines(),
                teardowns=tuple(self.book.teardowns),
                shm_files=self.shm_files,
                deaths=tuple(self.deaths),
                stalls=tuple(self.stalls),
                rank_devices={own[0]: own[1]} if own is not None else {},
            )

    @_caller_timed
    def report(self, *, last_epochs: int | None = None, fresh: bool = True) -> Report:
        """Judge what was observed (the arguments: ``timeline()``'s, fresh by default)."""
        timeline = self.timeline(last_epochs=last_epochs, fresh=fresh)
        self.failures.raise_pending()
        return build_report(timeline, self._config)
