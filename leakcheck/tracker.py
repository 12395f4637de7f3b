"""Tracker: samples the job's processes and devices in the background, per epoch.

NOTE [tracker lifecycle]: ``start()`` takes a baseline (devices, the root's own GPU bytes,
processes already below the root: those are pre-existing and never judged as survivors),
exports ``LEAKCHECK_SESSION`` and ``LEAKCHECK_MAILBOX`` so that every child inherits them, and
starts one daemon sampler thread. Each tick (``interval``) reads the devices' used memory and,
where it moved, NVML's per-PID memory (NOTE [list gating]), as far as pacing allows (NOTE [nvml
pacing]). Every ``_WALK_EVERY``-th tick it also reads the mailbox (exact worker identities,
teardown records; NOTE [worker mailbox] in mailbox.py) and walks the root's descendants from
/proc, checking the identities seen before (alive here? still below the root? if not,
reparented: an orphan); a tick whose NVML lists show a PID the tracker has not placed yet walks
at once. The walk is most of a tick's cost, and a process that appears or exits between two
walks is placed at most ``_WALK_EVERY`` ticks late, while every epoch end, ``sample()`` and
``close()`` walk at once. A tick that neither walked nor read the lists leaves the epoch's
record as it was (nothing in it can have moved but the device's used memory). Each tick costs
its thread a wake-up as well (60-150 us of CPU on the machines measured, more than a quiet
tick's own work: ``tools/diag_wake.py``), so the sampler waits between ticks on a timed lock
acquire, the cheapest way measured that ``close()`` can still interrupt; and it does not wake
for a tick that would have nothing to do (NOTE [idle ticks]). The sampler's walks (and
``sample()``'s) are quick ones (NOTE [quick walk] in procs.py); epoch ends, the grace deadline
and ``close()`` read every process in full. An epoch end is one synchronous sample with the
costlier extras (``/dev/nvidia*`` descriptor counts, telemetry); the costliest, a scan of /proc
for tagged processes that were reparented between ticks (``procs.TagScan``: it reads the tags
of unknown processes younger than the root only, and only of processes new in /proc since its
last scan: NOTE [incremental tag scan] in procs.py), runs on the sampler's next wake instead,
off the caller's thread, and once more in ``close()``: what it finds joins the next epoch and
the final state.
Survivors are judged later, from how long after the epoch end each process was still seen:
so the sampler keeps running between epochs, and ``close()`` waits out the grace period
(never longer) for processes born in the last epoch. Every failure of leakcheck's own is
caught in the sample and recorded, never raised into the user's loop (``strict=True``
re-raises it at the next call instead). A process is only ever walked while alive
(``_live``), so a tick costs what the job is now, not everything it ever started.

NOTE [list gating]: NVML's per-PID lists are the costliest call of a tick while the GPU is busy
(about 1.2 ms of CPU each on an H200 under a DataLoader's load, against 0.07 ms for the
device's used memory). Every process's memory is part of its device's used bytes, so a tick
that finds every device's used bytes exactly where they were at the last list read skips the
lists and keeps the last attribution. Epoch ends, ``sample()`` and ``close()`` always read
them, walking ticks do unless paced out (NOTE [nvml pacing]), and a failed list read is retried
at the next tick. Reading a list holds a driver lock that the workers' own driver calls wait
for (public reports of NVML monitors stalling other processes' driver calls; on an H200 the
sweep's own timings were too noisy to show it: docs/gpu-test-log.md, runs 16-18), so a tick
that reads the lists without walking leaves out the graphics list while the last full read
found no graphics context (a CUDA job has none), and when the lists show a process new on the
GPU, the walk that places it reuses them (every PID in them existed before the walk began).
What this can miss: a change in one process that the device total does not show (one process
freeing exactly what another allocates on the same device between two ticks), and a process
whose only context is a graphics one while the job had none; both are seen at the next walking
tick that reads the lists. And, as without gating, what rises and falls back between two reads.
An epoch end reads the lists, except one closed from inside a tick in progress (a loader
collected mid-sample): that one uses the last list read's attribution.

NOTE [nvml pacing]: the sampler's NVML reads are paced by what they cost. While the GPU is idle
a read takes microseconds of CPU; while workers create contexts and compute, a list read takes
1-2 ms of it, inside the driver and under a lock that the workers' own driver calls wait for.
So the sampler times each kind of read (device memory, process lists) and, after a read that
used ``c`` seconds of its thread's CPU, leaves that kind out of its ticks for the next
``c / _NVML_SHARE`` seconds, never more than ``_NVML_MAX_GAP_S``: each kind works in the driver
at most about ``_NVML_SHARE`` of the time, or ``c / _NVML_MAX_GAP_S`` where one read costs more
than the longest gap allows (one list read covers every device: on a host of many GPUs under
load, tens of milliseconds). Idle, that is every tick; under load on one GPU, a list read every
few hundred milliseconds. CPU time, not wall time: a read that waits for the lock while a
worker holds it (tens of milliseconds while contexts are created or torn down) costs the
workers nothing, and pacing by its wall time left whole epochs unread on an H200
(docs/gpu-test-log.md, run 19). A tick whose memory read is paced out keeps the last value
read, and its lists are due if that value differs from the one at the last list read
(NOTE [list gating]); a walking tick whose lists are paced out walks without them. Memory
reads are the one read that most ticks make, so they take a quarter of the share
(``_MEMORY_SHARE``): idle, a read of microseconds still comes every tick; under load on an H200
a read costs 0.12-0.17 ms of CPU, and at the lists' share that was every tick, a third of the
sampler's CPU (docs/gpu-test-log.md, run 32); at a quarter, one tick in two or three, and the
ticks left with nothing to do are not taken (NOTE [idle ticks]). What pacing costs: under
load, peaks within an epoch are sampled less often (a context that lives less than a gap may
be missed), and a process new on the GPU is placed up to one gap later (a memory gap, or the
next walk, whichever comes first). Epoch ends, ``sample()``, the grace wait and ``close()``
are never paced: what the rules judge is read when it is asked for. ``TrackerCost.nvml_wall_s``
counts the wall time of the samples' memory and list reads, waits for the driver's lock and
for the interpreter lock included, and ``nvml_cpu_s`` their CPU time; the telemetry read at
epoch ends is in neither.

NOTE [idle ticks]: a tick that does not walk and whose NVML reads are all paced out (or that
has no NVML to read) reads nothing and changes nothing, yet its wake-up alone costs the sampler
60-100 us of CPU. So after each tick the sampler works out how many ticks it may sleep through:
up to the next walking tick, and no further than the first tick at which a memory or list read
will be due (NOTE [nvml pacing], NOTE [list gating]). Every read and walk still happens at the
first tick at which it is due; only empty ticks are left out: without NVML, three in four;
under load on an H200, where memory reads come every second or third tick, about half (in
the diagnostic of docs/gpu-test-log.md, run 33: 72 ticks taken in 7.2 s; run 32, before
memory reads took a quarter share: 146 in 7.6 s).
What it delays: a tag scan asked for by an epoch end runs at the sampler's next wake, at most
``_WALK_EVERY`` ticks later, where it ran within one tick before.
``TrackerCost.samples`` and an epoch's ``samples`` count the ticks taken.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from leakcheck import mailbox, nvml, procs
from leakcheck.errors import LeakCheckError, UsageError
from leakcheck.model import (
    Attribution,
    DeviceState,
    EndReason,
    EpochRecord,
    FinalState,
    GpuProcess,
    ProcessEpoch,
    ProcessKey,
    ProcInfo,
    Role,
    RuleConfig,
    TeardownRecord,
    Timeline,
    TrackerCost,
)
from leakcheck.torch_state import initialized_cuda
from leakcheck.units import parse_duration, parse_size, shorten_cmdline

if TYPE_CHECKING:
    from leakcheck.report import Report
    from leakcheck.snapshot import Snapshot

# Processes the Python runtime starts for itself: they live as long as the parent, by design.
_RUNTIME_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_MAX_FAILURES = 50
# The sampler walks the process tree on every _WALK_EVERY-th tick (NOTE [tracker lifecycle]).
_WALK_EVERY = 4
# The share of the time the sampler's NVML reads may work in the driver, and the longest
# a kind of read may be left out (NOTE [nvml pacing]).
_NVML_SHARE = 0.005
# Memory reads take a quarter of it: a read of 0.12-0.17 ms (an H200 under load) then comes
# every second or third tick at the default interval, a read of microseconds every tick.
_MEMORY_SHARE = _NVML_SHARE / 4
_NVML_MAX_GAP_S = 1.0
_P = ParamSpec("_P")
_R = TypeVar("_R")
_CMDLINE_CHARS = 160


@dataclass
class _Proc:
    """Mutable record of one identity, owned by the tracker under its lock."""

    key: ProcessKey
    ppid: int
    cmdline: str
    first_seen_s: float
    last_seen_s: float
    born_epoch: int | None
    pre_existing: bool
    exited_s: float | None = None
    in_lineage: bool = True
    foreign: bool = False
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    gpu_unknown: bool = False
    nvidia_fds: int | None = None
    # Whether the command line was read at an epoch end after the process had exec'd (it
    # differs from its parent's): see _confirm_cmdlines.
    cmdline_confirmed: bool = False


@dataclass
class _Epoch:
    """Mutable accumulator of the open (or a closed) epoch."""

    index: int
    label: str
    start_s: float
    end_s: float | None = None
    reason: EndReason = "completed"
    error: str | None = None
    peak: dict[ProcessKey, dict[int, int]] = field(default_factory=dict)
    device_peak: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    seen: set[ProcessKey] = field(default_factory=set)
    end_state: dict[ProcessKey, tuple[Role, int, bool, dict[int, int], bool, int | None]] = field(
        default_factory=dict
    )
    devices: tuple[DeviceState, ...] = ()


def _caller_timed(
    method: Callable[Concatenate[Tracker, _P], _R],
) -> Callable[Concatenate[Tracker, _P], _R]:
    """Add the wall time of a public call to the tracker's caller cost (outermost call only)."""

    @functools.wraps(method)
    def timed(tracker: Tracker, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        calls = tracker._calls
        if getattr(calls, "depth", 0) or threading.current_thread() is tracker._thread:
            # Nested, or the sampler's own (a worker registered from the mailbox): not the
            # caller's time.
            return method(tracker, *args, **kwargs)
        calls.depth = 1
        started = time.perf_counter()
        try:
            return method(tracker, *args, **kwargs)
        finally:
            calls.depth = 0
            elapsed_s = time.perf_counter() - started
            with tracker._cost_lock:
                tracker._caller_wall_s += elapsed_s

    return timed


class Tracker:
    """Attribute GPU memory to every process of a job, per epoch.

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
    ) -> None:
        interval_s = parse_duration(interval, source="interval")
        if interval_s <= 0:
            raise UsageError(f"interval: expected seconds above 0 such as 0.05, got {interval!r}")
        if not _is_int_at_least(warmup_epochs, 0):
            raise UsageError(f"warmup_epochs: expected an integer >= 0, got {warmup_epochs!r}")
        if devices is not None and not all(_is_int_at_least(d, 0) for d in devices):
            raise UsageError(f"devices: expected device indices >= 0, got {devices!r}")
        self._config = RuleConfig(
            tolerance_bytes=parse_size(tolerance, source="tolerance"),
            warmup_epochs=warmup_epochs,
            grace_s=parse_duration(grace, source="grace"),
        )
        self._root_pid = os.getpid() if root_pid is None else root_pid
        self._interval_s = interval_s
        self._devices = list(devices) if devices is not None else None
        self._persistent_workers = persistent_workers
        self._strict = strict
        self._use_nvml = use_nvml

        self._lock = threading.RLock()
        # Held until ``close()`` releases it: the sampler waits on it between ticks, so a
        # close wakes it at once. A timed acquire of a plain lock, not ``Event.wait`` (a
        # Condition with a fresh lock per call): on the H200 host a wake costs 80 us of CPU
        # this way against 88-99 (tools/diag_wake.py), and the sampler wakes 20 times a second.
        self._stop_gate = threading.Lock()
        self._stop_gate.acquire()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started = False
        self._closed = False
        self._t0 = 0.0
        self._started_unix_s = 0.0
        self._session_id = ""
        self._mailbox_dir: str | None = None
        self._inbox: mailbox.Inbox | None = None
        self._saved_env: dict[str, str | None] = {}
        self._root_key = ProcessKey(self._root_pid, 0.0)
        self._tag_scan: procs.TagScan | None = None
        self._nvml: nvml.Nvml | None = None
        self._attribution: Attribution = "nvml-unavailable"
        self._attribution_reason = "tracking has not started"
        self._baseline_devices: tuple[DeviceState, ...] = ()
        self._baseline_gpu_bytes: dict[int, int] = {}
        self._procs: dict[ProcessKey, _Proc] = {}
        # The live subset: each walk checks it, not every process ever seen (a long run with
        # per-epoch workers sees thousands).
        self._live: dict[ProcessKey, _Proc] = {}
        self._sampling = False
        self._tag_scan_due = False
        self._ticks_since_walk = 0
        self._by_pid: dict[int, ProcessKey] = {}
        self._workers: dict[ProcessKey, bool | None] = {}
        self._teardowns: list[TeardownRecord] = []
        self._epochs: list[_Epoch] = []
        self._open: _Epoch | None = None
        # Failure line -> how often (insertion order kept, at most _MAX_FAILURES lines).
        self._failure_counts: dict[str, int] = {}
        self._pending_error: BaseException | None = None
        self._final: FinalState | None = None
        self._device_used: dict[int, int] = {}
        self._used_at_lists: dict[int, int] = {}  # device used bytes at the last list read
        self._graphics_seen = True  # the last full list read found a graphics context
        # perf_counter seconds before which the sampler skips a kind of read (NOTE [nvml pacing]).
        self._memory_due_s = 0.0
        self._lists_due_s = 0.0
        # The open epoch's seen set and peaks lag the processes (``_sample_body``).
        self._peaks_stale = True
        # Own cost (``cost()``): what the user's loop and the machine pay for tracking.
        self._cost_lock = threading.Lock()
        self._calls = threading.local()
        self._samples_taken = 0
        self._sample_wall_s = 0.0
        self._sampler_cpu_s = 0.0
        self._caller_wall_s = 0.0
        self._nvml_wall_s = 0.0
        self._nvml_cpu_s = 0.0

    # ----------------------------------------------------------------- properties

    @property
    def session_id(self) -> str:
        """The tag every child inherits as ``LEAKCHECK_SESSION`` (set by ``start()``)."""
        return self._session_id

    @property
    def config(self) -> RuleConfig:
        """Rule thresholds resolved from the constructor's options."""
        return self._config

    @property
    def root_pid(self) -> int:
        """The job's root process."""
        return self._root_pid

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    # ------------------------------------------------------------------ lifecycle

    @_caller_timed
    def start(self) -> Tracker:
        """Take the baseline and start the sampler thread. Idempotent."""
        with self._lock:
            if self._started:
                return self
            self._started = True
            self._t0 = time.monotonic()
            self._started_unix_s = time.time()
            from leakcheck.snapshot import new_session_id

            root_key = procs.process_key(self._root_pid)
            if root_key is None:
                raise UsageError(f"root_pid: no running process with PID {self._root_pid}")
            self._root_key = root_key
            self._session_id = new_session_id(self._root_pid)
            self._tag_scan = procs.TagScan(self._session_id, born_since=root_key)
            self._mailbox_dir = self._guard(mailbox.create, "mailbox")
            if self._mailbox_dir:
                self._inbox = mailbox.Inbox(self._mailbox_dir)
            if self._root_pid == os.getpid():
                self._export_env()
            self._open_nvml()
            self._register_root()
            for info in self._guard(lambda: procs.descendants(self._root_pid), "lineage") or []:
                self._add_proc(info, now=0.0, pre_existing=True)
            self._sample_locked(epoch_end=False)
            self._baseline_devices = self._read_devices()
            root = self._procs[self._root_key]
            self._baseline_gpu_bytes = dict(root.gpu_bytes)
        self._thread = threading.Thread(target=self._run, name="leakcheck-sampler", daemon=True)
        self._thread.start()
        return self

    @_caller_timed
    def close(self) -> None:
        """Stop sampling and take the final state. Idempotent.

        Closes an open epoch (reason ``closed``), then waits, at most ``grace`` seconds after
        the last epoch ended, for the processes born in it to exit, so survivors are judged
        on evidence (NOTE [tracker lifecycle]).
        """
        if not self._started or self._closed:
            self._closed = True
            return
        self.end_epoch("closed")
        self._wait_for_grace()
        if not self._stopping:
            self._stopping = True
            with contextlib.suppress(RuntimeError):  # a concurrent close() released it
                self._stop_gate.release()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 10 * self._interval_s))
        with self._lock:
            self._sample_locked(epoch_end=True, scan_tags=True)
            self._final = self._final_state()
            self._closed = True
            self._restore_env()
            if self._mailbox_dir:
                mailbox.remove(self._mailbox_dir)
        self._raise_pending()

    def __enter__(self) -> Tracker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._open is not None:
            self.end_epoch(*(end_reason_for(exc) if exc is not None else ("closed", None)))
        self.close()

    # --------------------------------------------------------------------- epochs

    @_caller_timed
    def begin_epoch(self, label: str | None = None) -> int:
        """Open an epoch (closing any open one as ``closed``); returns its index."""
        if not self._started:
            self.start()
        if self._closed:
            raise LeakCheckError("this Tracker is closed; create a new one to track more epochs")
        self.end_epoch("closed")
        with self._lock:
            index = len(self._epochs)
            self._open = _Epoch(
                index=index,
                label=label if label is not None else f"epoch {index}",
                start_s=self._now(),
            )
            self._epochs.append(self._open)
            self._peaks_stale = True
            return index

    @_caller_timed
    def end_epoch(self, reason: EndReason = "completed", error: str | None = None) -> None:
        """Close the open epoch; a no-op when none is open."""
        with self._lock:
            current = self._open
            if current is None:
                return
            self._sample_locked(epoch_end=True)
            self._tag_scan_due = True
            current.end_s = self._now()
            current.reason = reason
            current.error = error
            current.devices = self._read_devices()
            for key in current.seen | set(self._live):
                proc = self._procs[key]
                if proc.foreign:
                    continue
                alive = proc.exited_s is None
                current.end_state[key] = (
                    self._role(proc),
                    proc.ppid,
                    alive,
                    dict(proc.gpu_bytes) if alive else {},
                    proc.gpu_unknown and alive,
                    proc.nvidia_fds if alive else None,
                )
                current.seen.add(key)
            self._open = None
        self._raise_pending()

    @contextmanager
    def epoch(self, label: str | None = None) -> Iterator[int]:
        """Context manager around one epoch; the end reason follows how the block ended."""
        index = self.begin_epoch(label)
        try:
            yield index
        except BaseException as error:
            self.end_epoch(*end_reason_for(error))
            raise
        else:
            self.end_epoch("completed")

    # -------------------------------------------------------------------- workers

    @_caller_timed
    def register_worker(
        self, pid: int, create_time: float | None = None, *, persistent: bool | None = None
    ) -> None:
        """Declare a process as a worker of the job (exact identities, not a guess).

        Args:
            pid: Worker PID.
            create_time: Its start time (as ``psutil``); read from /proc when None.
            persistent: Whether it is meant to live across epochs (None: the tracker's
                ``persistent_workers`` setting).

        """
        with self._lock:
            if create_time is None:
                key = procs.process_key(pid)
                if key is None:
                    return
            else:
                key = ProcessKey(pid, create_time)
            self._workers[key] = persistent
            proc = self._procs.get(key)
            if proc is None and self._started and not self._closed:
                # A worker that lived and died between two ticks is known from its record
                # alone: keep it, born and gone in the open epoch.
                info = procs.read_proc(pid)
                if info is not None and info.key == key:
                    proc = self._add_proc(info, now=self._now())
                else:
                    proc = self._add_proc(
                        ProcInfo(key=key, ppid=self._root_pid, name="", cmdline=""),
                        now=self._now(),
                    )
                    self._mark_exited(proc, proc.first_seen_s)
                if self._open is not None:
                    self._open.seen.add(key)

    def cost(self) -> TrackerCost:
        """What tracking has cost so far (own time of the sampler and of the calling threads)."""
        with self._cost_lock:
            return TrackerCost(
                samples=self._samples_taken,
                sample_wall_s=self._sample_wall_s,
                sampler_cpu_s=self._sampler_cpu_s,
                caller_wall_s=self._caller_wall_s,
                nvml_wall_s=self._nvml_wall_s,
                nvml_cpu_s=self._nvml_cpu_s,
            )

    def worker_keys(self) -> list[ProcessKey]:
        """Workers registered so far."""
        with self._lock:
            return sorted(self._workers)

    @_caller_timed
    def sample(self) -> None:
        """Take one sample now, as the sampler thread does every ``interval`` (with a walk)."""
        with self._lock:
            self._sample_locked(epoch_end=False, quick=True)
        self._raise_pending()

    # ------------------------------------------------------------------- results

    def epochs(self) -> tuple[EpochRecord, ...]:
        """Closed epochs so far."""
        return self.timeline().epochs

    @_caller_timed
    def snapshot(self) -> Snapshot:
        """Who in the job holds what, right now (a fresh read, not the last sample)."""
        from leakcheck.snapshot import take_snapshot

        return take_snapshot(root_pid=self._root_pid, devices=self._devices)

    def teardowns(self) -> tuple[TeardownRecord, ...]:
        """Teardown records the workers posted so far."""
        with self._lock:
            return tuple(self._teardowns)

    @_caller_timed
    def timeline(self, *, last_epochs: int | None = None) -> Timeline:
        """All observations so far, frozen.

        Args:
            last_epochs: Only the latest this-many closed epochs: a cost that does not grow
                with the length of the run (NOTE [judged window] in dataloader.py). None:
                every closed epoch.

        Raises:
            UsageError: ``last_epochs`` is not a positive int.

        """
        if last_epochs is not None and not _is_int_at_least(last_epochs, 1):
            raise UsageError(f"last_epochs: expected a positive int or None, got {last_epochs!r}")
        with self._lock:
            # Only the last epoch can still be open.
            candidates = self._epochs if last_epochs is None else self._epochs[-last_epochs - 1 :]
            closed = [epoch for epoch in candidates if epoch.end_s is not None]
            if last_epochs is not None:
                closed = closed[-last_epochs:]
            epochs = tuple(self._freeze_epoch(epoch) for epoch in closed)
            return Timeline(
                session_id=self._session_id,
                root=self._root_key,
                started_unix_s=self._started_unix_s,
                attribution=self._attribution,
                attribution_reason=self._attribution_reason,
                baseline_devices=self._baseline_devices,
                baseline_gpu_bytes=dict(self._baseline_gpu_bytes),
                epochs=epochs,
                final=self._final,
                failures=tuple(
                    msg if count == 1 else f"{msg} (x{count})"
                    for msg, count in self._failure_counts.items()
                ),
                teardowns=tuple(self._teardowns),
            )

    @_caller_timed
    def report(self, *, last_epochs: int | None = None) -> Report:
        """Judge the timeline (closed epochs, and the final state once closed).

        Args:
            last_epochs: Judge only the latest this-many closed epochs (see ``timeline``).

        Raises:
            UsageError: ``last_epochs`` is not a positive int.

        """
        from leakcheck.report import build_report

        return build_report(self.timeline(last_epochs=last_epochs), self._config)

    # ------------------------------------------------------------------ internals

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _run(self) -> None:
        ticks = 1  # how many ticks the next wait spans (NOTE [idle ticks])
        while not self._stop_gate.acquire(timeout=ticks * self._interval_s):
            cpu_start_s = time.thread_time()
            with self._lock:
                if self._closed:
                    return
                scan_tags, self._tag_scan_due = self._tag_scan_due, False
                self._ticks_since_walk += ticks
                walk = scan_tags or self._ticks_since_walk >= _WALK_EVERY
                self._sample_locked(
                    epoch_end=False, scan_tags=scan_tags, walk=walk, quick=True, paced=True
                )
                ticks = self._ticks_until_work()
            cpu_s = time.thread_time() - cpu_start_s
            with self._cost_lock:
                self._sampler_cpu_s += cpu_s

    def _ticks_until_work(self) -> int:
        """Ticks from now to the next one with work (NOTE [idle ticks]); at least 1."""
        to_walk = max(1, _WALK_EVERY - self._ticks_since_walk)
        if self._nvml is None or to_walk == 1:
            return to_walk
        # The lists are due at the end of their gap if memory has moved since they were read
        # (NOTE [list gating]), else after a memory read that finds so.
        due_s = self._memory_due_s
        if self._lists_due(quick=True):
            due_s = min(due_s, self._lists_due_s)
        ahead_s = due_s - time.perf_counter()
        if ahead_s <= self._interval_s:
            return 1
        return min(to_walk, math.ceil(ahead_s / self._interval_s))

    def _guard(self, call: Any, what: str) -> Any:
        """Run one step of leakcheck's own; record (or, strict, keep to raise) a failure."""
        try:
            return call()
        except Exception as error:
            self._record_failure(f"{what}: {type(error).__name__}: {error}", error)
            return None

    def _record_failure(self, message: str, error: BaseException | None = None) -> None:
        line = message.splitlines()[0] if message else "unknown failure"
        if line in self._failure_counts:
            self._failure_counts[line] += 1
        elif len(self._failure_counts) < _MAX_FAILURES:
            self._failure_counts[line] = 1
        if self._strict and self._pending_error is None:
            self._pending_error = error or LeakCheckError(line)

    def _raise_pending(self) -> None:
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            if isinstance(error, LeakCheckError):
                raise error
            raise LeakCheckError(f"leakcheck failed (strict mode): {error}") from error

    def _export_env(self) -> None:
        values = {procs.SESSION_ENV: self._session_id}
        if self._mailbox_dir:
            values[mailbox.MAILBOX_ENV] = self._mailbox_dir
        for name, value in values.items():
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value

    def _restore_env(self) -> None:
        for name, value in self._saved_env.items():
            if os.environ.get(name) != self._env_value(name):
                continue  # someone else changed it since: leave theirs
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()

    def _env_value(self, name: str) -> str | None:
        if name == procs.SESSION_ENV:
            return self._session_id
        return self._mailbox_dir

    def _open_nvml(self) -> None:
        if not self._use_nvml:
            self._attribution, self._attribution_reason = (
                "nvml-unavailable",
                "NVML reading is off (use_nvml=False): host-side checks only",
            )
            return
        available, reason = nvml.availability()
        if not available:
            self._attribution, self._attribution_reason = "nvml-unavailable", reason
            return
        handle = self._guard(nvml.get, "nvml")
        if handle is None:
            self._attribution, self._attribution_reason = (
                "nvml-unavailable",
                next(reversed(self._failure_counts), "NVML failed to start"),
            )
            return
        self._nvml = handle
        count = self._guard(handle.device_count, "nvml") or 0
        if count == 0:
            self._attribution, self._attribution_reason = (
                "no-gpu",
                "NVML sees no NVIDIA GPU: host-side checks only",
            )
            self._nvml = None
            return
        self._attribution, self._attribution_reason = "ok", ""

    def _register_root(self) -> None:
        info = procs.read_proc(self._root_pid)
        self._procs[self._root_key] = _Proc(
            key=self._root_key,
            ppid=info.ppid if info else 0,
            cmdline=_short(info.cmdline if info else ""),
            first_seen_s=0.0,
            last_seen_s=0.0,
            born_epoch=None,
            pre_existing=True,
        )
        self._live[self._root_key] = self._procs[self._root_key]
        self._by_pid[self._root_pid] = self._root_key

    def _add_proc(self, info: ProcInfo, *, now: float, pre_existing: bool = False) -> _Proc:
        proc = _Proc(
            key=info.key,
            ppid=info.ppid,
            cmdline=_short(info.cmdline or info.name),
            first_seen_s=now,
            last_seen_s=now,
            born_epoch=self._open.index if self._open is not None else None,
            pre_existing=pre_existing,
        )
        self._procs[info.key] = proc
        self._live[info.key] = proc
        self._by_pid[info.key.pid] = info.key
        self._peaks_stale = True
        return proc

    def _sample_locked(
        self,
        *,
        epoch_end: bool,
        scan_tags: bool = False,
        walk: bool = True,
        quick: bool = False,
        paced: bool = False,
    ) -> None:
        """One sample (NOTE [tracker lifecycle]); the caller holds the lock.

        ``paced``: the sampler's ticks, whose NVML reads are paced (NOTE [nvml pacing]).
        """
        if self._closed or self._sampling:
            # Re-entered from the same thread (the lock is re-entrant): a loader iterator
            # collected by the garbage collector mid-sample closes its epoch from inside
            # this one. That epoch end uses the sample in progress.
            return
        self._sampling = True
        started = time.perf_counter()
        try:
            self._sample_body(
                epoch_end=epoch_end, scan_tags=scan_tags, walk=walk, quick=quick, paced=paced
            )
        except Exception as error:
            # Anything unforeseen is recorded, never raised into the caller's loop (and a
            # dead sampler thread would silently stop tracking); the next sample retries.
            self._record_failure(f"sample: {type(error).__name__}: {error}", error)
        finally:
            self._sampling = False
            elapsed_s = time.perf_counter() - started
            with self._cost_lock:
                self._samples_taken += 1
                self._sample_wall_s += elapsed_s

    def _sample_body(
        self, *, epoch_end: bool, scan_tags: bool, walk: bool, quick: bool, paced: bool
    ) -> None:
        now = self._now()
        if self._inbox is not None and (walk or not paced):
            # The sampler reads the mailbox on its walking ticks only: its records name
            # processes that the walk then places (NOTE [tracker lifecycle]).
            inbox = self._inbox
            self._guard(lambda: self._read_mailbox(inbox, quick=quick), "mailbox")
        nvml_handle = self._nvml
        lists_paced_out = paced and time.perf_counter() < self._lists_due_s
        memory_read = False
        if nvml_handle is not None and (not paced or time.perf_counter() >= self._memory_due_s):
            read_start = time.perf_counter(), time.thread_time()
            memory = self._guard(lambda: nvml_handle.memory(self._devices), "nvml memory")
            end_s, read_cpu_s = self._nvml_read_done(*read_start)
            self._memory_due_s = end_s + _nvml_gap_s(read_cpu_s, _MEMORY_SHARE)
            self._device_used = (
                {state.index: state.used_bytes for state in memory} if memory is not None else {}
            )
            memory_read = True
        gpu: tuple[GpuProcess, ...] | None = None
        new_on_gpu = False
        if not walk and not lists_paced_out and self._lists_due(quick=quick):
            gpu = self._read_gpu_processes(graphics=not quick or self._graphics_seen)
            # A process new on the GPU: place it in the tree before attributing it. The list
            # read before the walk serves: every PID in it existed before the walk began.
            new_on_gpu = gpu is not None and any(entry.pid not in self._by_pid for entry in gpu)
        if walk or new_on_gpu:
            if not self._walk(now, scan_tags=scan_tags, quick=quick):
                return
            if not new_on_gpu and not lists_paced_out:
                gpu = self._read_gpu_processes(graphics=True)
        if gpu is not None:
            self._attribute_gpu(gpu, now)
        if epoch_end:
            for proc in self._live.values():
                if not proc.foreign:
                    proc.nvidia_fds = self._job_nvidia_fds(proc)
            self._confirm_cmdlines()
        epoch = self._open
        if epoch is None:
            return
        epoch.samples += 1
        # What the epoch has seen and its peaks change only when processes or their GPU
        # bytes did (a walk, a list read, an adoption, a registration: each marks the peaks
        # stale), and the device peak only with a memory read: a tick that did neither
        # leaves them as they are.
        if self._peaks_stale:
            self._peaks_stale = False
            for key, proc in self._live.items():
                if proc.foreign:
                    continue
                epoch.seen.add(key)
                if proc.gpu_bytes:
                    peak = epoch.peak.setdefault(key, {})
                    for index, used in proc.gpu_bytes.items():
                        if used > peak.get(index, 0):
                            peak[index] = used
            memory_read = True
        if memory_read:
            for index, used in self._device_used.items():
                if used > epoch.device_peak.get(index, 0):
                    epoch.device_peak[index] = used

    def _lists_due(self, *, quick: bool) -> bool:
        """Whether a tick without a walk reads NVML's process lists (NOTE [list gating])."""
        if self._nvml is None:
            return False
        return not quick or not self._device_used or self._device_used != self._used_at_lists

    def _read_gpu_processes(self, *, graphics: bool) -> tuple[GpuProcess, ...] | None:
        nvml_handle = self._nvml
        if nvml_handle is None:
            return None
        used = dict(self._device_used)  # read before the lists: a change in between shows
        read_start = time.perf_counter(), time.thread_time()
        result: tuple[GpuProcess, ...] | None = self._guard(
            lambda: nvml_handle.processes(self._devices, graphics=graphics), "nvml processes"
        )
        end_s, read_cpu_s = self._nvml_read_done(*read_start)
        self._lists_due_s = end_s + _nvml_gap_s(read_cpu_s, _NVML_SHARE)
        # After a failed read nothing matches, so the next tick reads again.
        self._used_at_lists = used if result is not None else {}
        if result is not None and graphics:
            self._graphics_seen = any(entry.kind != "compute" for entry in result)
        return result

    def _nvml_read_done(self, start_s: float, start_cpu_s: float) -> tuple[float, float]:
        """Count an NVML read's wall and CPU time; return when it ended and its CPU seconds.

        NOTE [nvml pacing]. ``start_s`` and ``start_cpu_s``: ``time.perf_counter()`` and
        ``time.thread_time()`` when the read began, in this thread.
        """
        end_s = time.perf_counter()
        read_cpu_s = time.thread_time() - start_cpu_s
        with self._cost_lock:
            self._nvml_wall_s += end_s - start_s
            self._nvml_cpu_s += read_cpu_s
        return end_s, read_cpu_s

    def _walk(self, now: float, *, scan_tags: bool, quick: bool) -> bool:
        """Walk the root's descendants: new, reparented and exited processes.

        ``quick`` (the sampler's ticks): NOTE [quick walk] in procs.py; a process missing
        from a quick walk is only judged reparented by the next full one.
        Returns False when the lineage could not be read (recorded as a failure).
        """
        self._ticks_since_walk = 0
        # Command lines are read once per new process, not per tick (NOTE [tracker lifecycle]).
        lineage = self._guard(
            lambda: procs.descendants(self._root_pid, with_cmdline=False, quick=quick), "lineage"
        )
        if lineage is None:
            return False
        current: set[ProcessKey] = {self._root_key}
        for info in lineage:
            proc = self._procs.get(info.key)
            if proc is None:
                proc = self._add_proc(procs.read_proc(info.key.pid) or info, now=now)
            proc.ppid, proc.last_seen_s, proc.in_lineage = info.ppid, now, True
            current.add(info.key)
        root = self._procs.get(self._root_key)
        if root is not None:
            root.last_seen_s = now
        if scan_tags:
            self._guard(lambda: self._scan_tagged(now), "tag scan")
        for key, proc in list(self._live.items()):
            if key in current:
                continue
            if procs.is_alive(key):
                proc.last_seen_s = now
                if not proc.foreign and not quick:
                    proc.in_lineage = False  # alive but no longer below the root: reparented
                    info = procs.read_proc(key.pid, with_cmdline=False)
                    if info is not None:
                        proc.ppid = info.ppid
            else:
                self._mark_exited(proc, now)
        return True

    def _attribute_gpu(self, gpu: tuple[GpuProcess, ...], now: float) -> None:
        by_pid, unknown = nvml.gpu_bytes_by_pid(gpu)
        self._peaks_stale = True
        for proc in self._live.values():
            proc.gpu_bytes, proc.gpu_unknown = {}, False
        missing: list[int] = []
        for pid, per_device in by_pid.items():
            key = self._by_pid.get(pid)
            known = self._procs.get(key) if key is not None else None
            if known is not None and known.exited_s is not None and procs.process_key(pid) == key:
                continue  # ours, exiting: NVML lists it until its context is gone
            target = (
                known
                if known is not None and known.exited_s is None
                else self._adopt_gpu_pid(pid, now)
            )
            if target is None:
                missing.append(pid)
                continue
            target.gpu_bytes = per_device
            target.gpu_unknown = pid in unknown
        if missing and self._attribution == "ok" and procs.pid_namespace_nested():
            self._attribution = "blind-namespace"
            self._attribution_reason = (
                f"NVML reports PIDs {sorted(missing)[:5]} that do not exist in this PID "
                "namespace (a container without --pid=host?): only device totals are judged"
            )

    def _adopt_gpu_pid(self, pid: int, now: float) -> _Proc | None:
        """Adopt a GPU PID that the lineage walk did not see.

        It is a tagged (reparented) process of this session, or a foreign one.
        """
        info = procs.read_proc(pid, session_id=self._session_id)
        if info is None:
            return None
        proc = self._procs.get(info.key)
        if proc is not None:
            # Never replace what is known of a process: an exiting one is still ours.
            return proc if proc.exited_s is None else None
        proc = self._add_proc(info, now=now)
        if not info.tagged:
            proc.foreign, proc.in_lineage = True, False
        else:
            proc.in_lineage = procs.is_ancestor(self._root_pid, pid)
        return proc

    def _scan_tagged(self, now: float) -> None:
        """Add the tagged processes the walks have not seen: reparented out of the lineage."""
        if self._tag_scan is None:
            return
        for info in self._tag_scan.scan(self._procs):
            proc = self._add_proc(info, now=now)
            proc.in_lineage = False

    def _confirm_cmdlines(self) -> None:
        """Re-read at an epoch end the command lines that may still be a parent's.

        A child first seen between fork and exec showed its parent's command line. One that
        differs from its parent's has exec'd, and is not read again: a process that execs a
        second time keeps the first program's command line in the report. A forked child
        that never execs matches its parent at every epoch end and is read at each (one
        ``/proc`` read per process; a cost the epoch end no longer pays for the others).
        """
        for key, proc in self._live.items():
            if proc.foreign or proc.cmdline_confirmed or key == self._root_key:
                continue
            info = procs.read_proc(key.pid)
            if info is None or info.key != key:
                continue
            proc.cmdline = _short(info.cmdline or info.name)
            parent_key = self._by_pid.get(proc.ppid)
            parent = self._procs.get(parent_key) if parent_key is not None else None
            proc.cmdline_confirmed = parent is not None and proc.cmdline != parent.cmdline

    def _job_nvidia_fds(self, proc: _Proc) -> int | None:
        """Count a process's ``/dev/nvidia*`` descriptors that belong to the job.

        Leaves out those NVML opened for leakcheck in the root, which a forked child merely
        inherited (NOTE [descriptors] in nvml.py).
        """
        found = procs.nvidia_fds(proc.key.pid)
        if found is None:
            return None
        own = nvml.own_descriptors() if self._root_pid == os.getpid() else frozenset()
        if proc.key == self._root_key:
            return len(set(found) - own)
        root = self._procs.get(self._root_key)
        forked = root is not None and proc.cmdline == root.cmdline
        return len(set(found) - own) if forked else len(found)

    def _mark_exited(self, proc: _Proc, now: float) -> None:
        proc.exited_s = now
        proc.gpu_bytes = {}
        self._live.pop(proc.key, None)

    def _read_mailbox(self, inbox: mailbox.Inbox, *, quick: bool) -> None:
        for record in inbox.read(quick=quick):
            kind = record.get("kind")
            pid, create_time = record.get("pid"), record.get("create_time")
            if not isinstance(pid, int) or not isinstance(create_time, (int, float)):
                continue
            if kind == "worker":
                persistent = record.get("persistent")
                self.register_worker(
                    pid,
                    float(create_time),
                    persistent=persistent if isinstance(persistent, bool) else None,
                )
            elif kind == "teardown":
                self._teardowns.append(_teardown_from(record, ProcessKey(pid, create_time)))

    def _read_devices(self) -> tuple[DeviceState, ...]:
        """Memory and telemetry of the watched devices (epoch ends, baseline, final state)."""
        handle = self._nvml
        if handle is None:
            return ()
        states = self._guard(lambda: handle.devices(self._devices), "nvml devices")
        return tuple(states) if states else ()

    def _role(self, proc: _Proc) -> Role:
        if proc.key == self._root_key:
            return "parent"
        if proc.foreign:
            return "foreign"
        if not proc.in_lineage:
            return "orphan"
        if proc.key in self._workers:
            return "worker"
        # Without exact identities (no worker registered itself), a direct child is taken for
        # a pool worker; once workers register, every other process is a descendant.
        if (
            not self._workers
            and proc.ppid == self._root_pid
            and not _is_runtime_helper(proc.cmdline)
        ):
            return "worker"
        return "descendant"

    def _persistent(self, proc: _Proc) -> bool:
        if proc.key == self._root_key or proc.pre_existing or _is_runtime_helper(proc.cmdline):
            return True
        if self._role(proc) != "worker":
            return False
        registered = self._workers.get(proc.key)
        return self._persistent_workers if registered is None else registered

    def _freeze_epoch(self, epoch: _Epoch) -> EpochRecord:
        end_s = epoch.end_s if epoch.end_s is not None else self._now()
        processes: list[ProcessEpoch] = []
        for key in sorted(epoch.end_state):
            proc = self._procs[key]
            role, ppid, alive, gpu_end, unknown, fds = epoch.end_state[key]
            exited_after = (
                proc.exited_s - end_s
                if proc.exited_s is not None and proc.exited_s >= end_s
                else None
            )
            processes.append(
                ProcessEpoch(
                    key=key,
                    role=role,
                    ppid=ppid,
                    cmdline=proc.cmdline,
                    born_in_epoch=proc.born_epoch == epoch.index and not proc.pre_existing,
                    persistent=self._persistent(proc),
                    alive_at_end=alive,
                    exited_after_s=exited_after,
                    last_seen_after_s=(proc.last_seen_s - end_s) if alive else None,
                    gpu_bytes_end=gpu_end,
                    gpu_bytes_peak=dict(epoch.peak.get(key, {})),
                    gpu_bytes_unknown=unknown,
                    nvidia_fds=fds,
                )
            )
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
        )

    def _wait_for_grace(self) -> None:
        """Give processes born in the last epoch up to ``grace`` seconds after its end."""
        with self._lock:
            last = self._epochs[-1] if self._epochs else None
            if last is None or last.end_s is None:
                return
            deadline = last.end_s + self._config.grace_s
            pending = [
                proc
                for proc in self._live.values()
                if proc.born_epoch == last.index and not proc.foreign and not self._persistent(proc)
            ]
        while pending and self._now() < deadline and not self._stopping:
            time.sleep(min(self._interval_s, max(0.0, deadline - self._now())))
            with self._lock:
                pending = [proc for proc in pending if proc.exited_s is None]
        # One more sample right at the deadline, so "alive after grace" is an observation.
        with self._lock:
            self._sample_locked(epoch_end=False)

    def _final_state(self) -> FinalState:
        processes: list[ProcessEpoch] = []
        now = self._now()
        last_end = self._epochs[-1].end_s if self._epochs else None
        for key, proc in sorted(self._live.items()):
            if proc.foreign and not proc.gpu_bytes:
                continue
            processes.append(
                ProcessEpoch(
                    key=key,
                    role=self._role(proc),
                    ppid=proc.ppid,
                    cmdline=proc.cmdline,
                    born_in_epoch=False,
                    persistent=self._persistent(proc),
                    alive_at_end=True,
                    last_seen_after_s=(proc.last_seen_s - last_end) if last_end else None,
                    gpu_bytes_end=dict(proc.gpu_bytes),
                    gpu_bytes_peak=dict(proc.gpu_bytes),
                    gpu_bytes_unknown=proc.gpu_unknown,
                    nvidia_fds=proc.nvidia_fds,
                )
            )
        return FinalState(
            time_s=now,
            devices=self._read_devices(),
            processes=tuple(processes),
            parent_allocated_gpu_bytes=(
                _torch_allocated_bytes() if self._root_pid == os.getpid() else None
            ),
        )


def _nvml_gap_s(read_cpu_s: float, share: float) -> float:
    """How long a kind of NVML read is left out after one that used ``read_cpu_s``."""
    return min(read_cpu_s / share, _NVML_MAX_GAP_S)


def _is_int_at_least(value: object, minimum: int) -> bool:
    """An int (a bool is not one here) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def end_reason_for(error: BaseException | None) -> tuple[EndReason, str | None]:
    """Map how an epoch ended (the exception, or None) to its end reason and error line."""
    if error is None:
        return "completed", None
    if isinstance(error, KeyboardInterrupt):
        return "interrupt", "KeyboardInterrupt"
    if isinstance(error, GeneratorExit):
        return "break", None
    return "exception", f"{type(error).__name__}: {error}".splitlines()[0]


def _short(cmdline: str) -> str:
    return shorten_cmdline(cmdline, _CMDLINE_CHARS, empty="")


def _is_runtime_helper(cmdline: str) -> bool:
    return any(marker in cmdline for marker in _RUNTIME_HELPERS)


def _torch_allocated_bytes() -> int | None:
    """Bytes the torch allocator holds in this process.

    Read only where CUDA is already initialised here: leakcheck never initialises CUDA.
    """
    cuda = initialized_cuda()
    if cuda is None:
        return None
    try:
        return int(sum(cuda.memory_allocated(index) for index in range(cuda.device_count())))
    except Exception:
        return None


def _teardown_from(record: dict[str, Any], key: ProcessKey) -> TeardownRecord:
    def number(name: str, default: float = 0.0) -> float:
        value = record.get(name, default)
        return float(value) if isinstance(value, (int, float)) else default

    def optional_int(name: str) -> int | None:
        value = record.get(name)
        return int(value) if isinstance(value, (int, float)) else None

    def optional_bool(name: str) -> bool | None:
        value = record.get(name)
        return value if isinstance(value, bool) else None

    error = record.get("error")
    return TeardownRecord(
        key=key,
        worker_id=optional_int("worker_id"),
        cuda_initialized=bool(record.get("cuda_initialized", False)),
        streams_joined=int(number("streams_joined")),
        resources_released=int(number("resources_released")),
        freed_cache_bytes=int(number("freed_cache_bytes")),
        context_released=bool(record.get("context_released", False)),
        gpu_bytes_before=optional_int("gpu_bytes_before"),
        left_nvml=optional_bool("left_nvml"),
        duration_s=number("duration_s"),
        error=str(error) if error else None,
    )
