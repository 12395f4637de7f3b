"""The sampler: one background thread that reads the job's processes and devices, per epoch.

This module says when and keeps the results; ``Ticker`` (ticker.py) is the thread, and
``SampleReader`` (sample_reader.py) takes each sample.

NOTE [tracker lifecycle]: ``start()`` takes a baseline (devices, the root's own GPU bytes,
the processes already below the root: pre-existing, never judged as survivors), exports
``LEAKCHECK_SESSION`` and ``LEAKCHECK_MAILBOX`` so that every child inherits them, and starts
one daemon thread. Each tick reads what ``Pacing`` allows: the devices' used memory, NVML's
per-PID lists where memory moved, and on every fourth tick the mailbox (exact worker
identities, their own reports: NOTE [worker mailbox] in mailbox.py) and a quick walk of the
root's descendants in /proc; a tick whose lists show a PID not placed yet walks at once. An
epoch end is one synchronous, full sample with the costlier extras (``/dev/nvidia*``
descriptors, command lines, telemetry, each process's RSS from ``/proc/PID/status``, the
job's files in ``/dev/shm``); the costliest run on the sampler's next wake instead, off the
caller's thread: a scan of /proc for tagged processes reparented between walks
(``procs.TagScan``, also in every fresh read and ``close()``), and the USS and PSS of the
long-lived processes (smaps_rollup, paced: NOTE [host pacing] in pacing.py), stamped with the
epoch that ended; ``close()`` reads a pending one itself, and reads them once more for the
final state. Survivors are judged later, from how long after its epoch's end each process
was still seen: so the sampler keeps running between epochs, and ``close()`` waits, at most
``grace`` after the epoch each was born in, for every process whose survival is not decided
yet, whichever epoch it came from; then it reads everything once more. Every failure of
leakcheck's own is caught and recorded, never raised into the user's loop (``strict=True``
re-raises it at the next call instead).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping

from leakcheck.core.errors import UsageError
from leakcheck.core.model import (
    MIB,
    DeviceState,
    EndReason,
    FinalState,
    ProcessKey,
    ShmFile,
    Stall,
    TeardownRecord,
    Timeline,
)
from leakcheck.observe import machine, mailbox, procs
from leakcheck.observe.hostmem import HostMemory
from leakcheck.observe.torch_state import initialized_cuda
from leakcheck.track import claims, exports
from leakcheck.track.book import EpochBook, final_processes
from leakcheck.track.cost import CostMeter
from leakcheck.track.deaths import DeathLog
from leakcheck.track.hang import HangWatch
from leakcheck.track.host import HostReads, InsidePlan
from leakcheck.track.pacing import Pacing
from leakcheck.track.reads import Failures, NvmlReads
from leakcheck.track.sample_reader import SampleReader
from leakcheck.track.shm import ShmWatch
from leakcheck.track.table import ProcessTable
from leakcheck.track.ticker import Ticker

__all__ = ["Sampler", "end_reason_for"]


class Sampler:
    """Reads one job's processes and devices in the background; see NOTE [tracker lifecycle].

    Args:
        root_pid: The job's root process.
        interval_s: Seconds between ticks.
        devices: NVML device indices to read (None: all).
        grace_s: How long a process born in an epoch may outlive it.
        persistent_workers: Workers that do not say otherwise live across epochs.
        strict: Keep leakcheck's own failures to raise at the next call.
        use_nvml: Read NVML at all.
        session_tag: ``(NAME, VALUE)``: the environment variable, set by the caller for a
            root it started, by which reparented processes of the job are found, instead of
            this tracker's own ``LEAKCHECK_SESSION`` (NOTE [run tag] in launcher.py).
        rollup_share: Share of time for smaps_rollup reads (None: ``ROLLUP_SHARE``).
        scan_at_epoch_end: Scan for reparented processes in each epoch end's sample too
            (``Tracker``'s).
        copy_tolerance_bytes: The copy tolerance (``RuleConfig``'s): when a worker's copy
            was first read above it is kept.
        hang_after_s: Seconds an open epoch may wait for a batch before the job's stacks
            are taken (NOTE [hang watch] in hang.py); 0: never.

    """

    def __init__(
        self,
        *,
        root_pid: int,
        interval_s: float,
        devices: list[int] | None,
        grace_s: float,
        persistent_workers: bool,
        strict: bool,
        use_nvml: bool,
        session_tag: tuple[str, str] | None = None,
        rollup_share: float | None = None,
        warmup_epochs: int = 1,
        scan_at_epoch_end: bool = False,
        copy_tolerance_bytes: int = 64 * MIB,
        hang_after_s: float = 0.0,
    ) -> None:
        self.root_pid = root_pid
        self.scan_at_epoch_end = scan_at_epoch_end
        self.session_tag = session_tag
        self.rollup_share = rollup_share
        self.warmup_epochs = warmup_epochs
        self.interval_s = interval_s
        self.devices = devices
        self.grace_s = grace_s
        self.persistent_workers = persistent_workers
        self.use_nvml = use_nvml
        self.meter = CostMeter()
        self.failures = Failures(strict=strict)
        self.nvml = NvmlReads(devices=devices, meter=self.meter, failures=self.failures)
        self.lock = threading.RLock()
        self._ticker = Ticker(
            interval_s,
            on_tick=self._tick,
            on_wake=self.finish_reads,
            on_error=self._thread_failed,
            meter=self.meter,
        )
        self.started = self.closed = False
        self._t0 = 0.0
        self.started_unix_s = 0.0
        self.session_id = ""
        self.root_key = ProcessKey(root_pid, 0)
        self.boot_unix_s: float | None = None
        self._mailbox_dir: str | None = None
        self._export_token: int | None = None
        self._tag_scan_due = False
        self.baseline_devices: tuple[DeviceState, ...] = ()
        self.baseline_gpu_bytes: dict[int, int] = {}
        self.table: ProcessTable | None = None
        self.reader: SampleReader | None = None
        self.book = EpochBook(grace_s=grace_s, copy_tolerance_bytes=copy_tolerance_bytes)
        self.pacing = Pacing(interval_s, has_nvml=False, rollup_share=rollup_share)
        self.host = HostReads(self.pacing, self.failures, warmup_epochs=warmup_epochs)
        self.shm = ShmWatch()
        self.shm_files: tuple[ShmFile, ...] = ()
        self.final: FinalState | None = None
        self.hang = HangWatch(hang_after_s, own_process=root_pid == os.getpid())
        self.stalls: list[Stall] = []
        self.death_log = DeathLog()
        """The memory cgroup's OOM-kill counter at the start or the last death noted."""

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def mailbox_dir(self) -> str | None:
        """The workers' mailbox folder (None before ``start()`` or if it could not be made)."""
        return self._mailbox_dir

    def now(self) -> float:
        """Seconds since the start, on the clock of every record."""
        return time.monotonic() - self._t0

    def start(self) -> None:
        """Take the baseline and start the thread (NOTE [tracker lifecycle])."""
        with self.lock:
            if self.started:
                return
            root_key = procs.process_key(self.root_pid)
            if root_key is None:
                raise UsageError(f"root_pid: no running process with PID {self.root_pid}")
            self.started = True
            self._t0 = time.monotonic()
            boot_offset_s = procs.since_boot_s() - self.now()
            self.started_unix_s = time.time()
            self.boot_unix_s = procs.boot_time_s()
            self.root_key = root_key
            self.session_id = procs.new_session_id(self.root_pid)
            tag = self.session_tag or (procs.SESSION_ENV, self.session_id)
            self._mailbox_dir = self.failures.guard(mailbox.create, "mailbox")
            if self.root_pid == os.getpid():
                values = {procs.SESSION_ENV: self.session_id}
                if self._mailbox_dir:
                    values[mailbox.MAILBOX_ENV] = self._mailbox_dir
                self._export_token = exports.export(values)
            self.nvml.open(use_nvml=self.use_nvml)
            self.pacing = Pacing(
                self.interval_s,
                has_nvml=self.nvml.handle is not None,
                rollup_share=self.rollup_share,
            )
            self.host = HostReads(self.pacing, self.failures, warmup_epochs=self.warmup_epochs)
            self.failures.guard(self.shm.start, "shm")
            self.death_log.start(self.failures.guard(machine.oom_kill_count, "cgroup"))
            self.table = ProcessTable(
                root_key,
                procs.read_proc(self.root_pid),
                session=self.session_id,
                persistent_workers=self.persistent_workers,
                tag=tag,
            )
            lineage = self.failures.guard(lambda: procs.descendants(self.root_pid), "lineage")
            for info in lineage or []:
                self.table.add(info, now=0.0, born_epoch=None, pre_existing=True)
            self.reader = SampleReader(
                root_pid=self.root_pid,
                table=self.table,
                book=self.book,
                nvml=self.nvml,
                pacing=self.pacing,
                shm=self.shm,
                failures=self.failures,
                meter=self.meter,
                tag_scan=procs.TagScan(tag[1], born_since=root_key, variable=tag[0]),
                inbox=mailbox.Inbox(self._mailbox_dir) if self._mailbox_dir else None,
                start_s=self._t0,
                boot_offset_s=boot_offset_s,
                now=self.now,
            )
            self.sample(epoch_end=False)
            self.baseline_devices = self.nvml.device_states()
            # What the end state also counts as the job's: the root's own bytes and those of
            # other trackers' or ranks' processes (their rise is the job's, not what they
            # already held: NOTE [other ranks] in table.py).
            baseline = dict(self.table.procs[root_key].gpu_bytes)
            for device, used in self.table.others_gpu_bytes().items():
                baseline[device] = baseline.get(device, 0) + used
            self.baseline_gpu_bytes = baseline
        self._ticker.start()

    def close(self) -> None:
        """Close an open epoch, wait out pending survivors, stop, take the final state."""
        if not self.started or self.closed:
            self.closed = True
            return
        self.end_epoch("closed", None)
        self._wait_for_grace()
        self._ticker.stop()
        self.finish_reads()  # planned at the last epoch end, not read yet
        with self.lock:
            self.final = self.current_state(closed=True)
            self.closed = True
            if self._export_token is not None:
                exports.withdraw(self._export_token)
                self._export_token = None
            if self._mailbox_dir:
                mailbox.remove(self._mailbox_dir)
            claims.session_closed(self.session_id)

    def _thread_failed(self, error: Exception) -> None:
        with self.lock:  # reports read the failures under it
            self.failures.record(
                f"the sampler thread stopped (samples at epoch ends only from then on): "
                f"{type(error).__name__}: {error}",
                error,
            )

    def _tick(self, ticks: int) -> int | None:
        """One tick of the thread; how many intervals until the next (None: closed)."""
        with self.lock:
            if self.closed:
                return None
            scan_tags, self._tag_scan_due = self._tag_scan_due, False
            tick = self.pacing.plan(time.perf_counter(), ticks, walk_now=scan_tags)
            self.sample(
                epoch_end=False,
                scan_tags=scan_tags,
                walk=tick.walk,
                quick=True,
                read_memory=tick.read_memory,
                lists_paced_out=tick.lists_paced_out,
            )
            opened = self.book.open
            inside = None
            stalled: tuple[int, float, list[ProcessKey]] | None = None
            if self.table is not None and opened is not None:
                inside = self.host.plan_inside(
                    self.table, opened.index, opened.start_s, self.now()
                )
                waited_s = self.hang.due()
                if waited_s is not None:
                    self.sample(epoch_end=False)  # the mailbox: every worker's record
                    table = self.table
                    workers = [k for k in table.live_workers() if table.procs[k].dumps_stacks]
                    stalled = (opened.index, waited_s, workers)
            next_ticks = self.pacing.ticks_until_work(time.perf_counter())
        if inside is not None:
            self._read_inside(inside)
        if stalled is not None:
            self._dump_stacks(*stalled)
        return next_ticks

    def _dump_stacks(self, epoch: int, waited_s: float, workers: list[ProcessKey]) -> None:
        """A stalled epoch: the job's stacks, off the lock (NOTE [hang watch])."""
        folder = self._mailbox_dir
        stall = self.failures.guard(
            lambda: self.hang.dump(
                epoch=epoch, waited_s=waited_s, at_s=self.now(), workers=workers, folder=folder
            ),
            "hang watch",
            lock=self.lock,
        )
        if stall is not None:
            with self.lock:
                self.stalls.append(stall)

    def _read_inside(self, plan: InsidePlan) -> None:
        """An in-epoch read of the forked workers, off the lock (NOTE [host pacing])."""
        started_cpu_s = time.thread_time()
        found = self.host.read_inside(plan)
        with self.lock:
            if found and self.table is not None and self.book.open_index == plan.epoch_index:
                self.book.apply_inside(self.table, found, plan.at_s)
        self.meter.host_read(time.thread_time() - started_cpu_s)

    def finish_reads(self) -> None:
        """Make the host reads planned at the last epoch end now, or wait for those under way.

        Before the job's processes change (a loader dropped, its persistent workers shut
        down), so that the reads describe the epoch's end. No lock held by the caller.
        """

        def give(index: int, found: Mapping[ProcessKey, HostMemory]) -> None:
            with self.lock:
                self.book.apply_rollup(index, found)

        self.host.read_planned(self.lock, give)

    def _wait_for_grace(self) -> None:
        """Wait, at most until the grace of each one's epoch passed, for pending survivors."""
        assert self.table is not None
        with self.lock:
            pending, deadline = self.book.pending_survivors(self.table)
        while pending and self.now() < deadline and not self._ticker.stopping:
            time.sleep(min(self.interval_s, max(0.0, deadline - self.now())))
            with self.lock:
                pending = [proc for proc in pending if proc.exited_s is None]
        # One more sample at the deadline, so "alive after the grace" is an observation.
        with self.lock:
            self.sample(epoch_end=False)

    # -- epochs and workers --------------------------------------------------------------

    def begin_epoch(self, label: str | None) -> int:
        """Open an epoch (closing an open one as ``closed``)."""
        self.end_epoch("closed", None)
        # The host reads the last end planned, if the sampler's thread has not made them
        # yet: before this epoch's work changes what they would read (NOTE [host pacing]).
        self.finish_reads()
        with self.lock:
            index = self.book.begin(label, self.now())
            self.failures.guard(self.shm.begin_epoch, "shm")
            claims.epoch_opened(self.session_id)
            assert self.table is not None
            self.table.changed = True
            return index

    def end_epoch(
        self,
        reason: EndReason,
        error: str | None,
        batches: int | None = None,
        index: int | None = None,
    ) -> bool:
        """Close the open epoch with a full sample; True when one was closed.

        A no-op when none is open, or when ``index`` is given and the open epoch is another.
        """
        with self.lock:
            opened = self.book.open
            if opened is None or self.table is None:
                return False
            if index is not None and opened.index != index:
                return False
            self.sample(epoch_end=True, scan_tags=self.scan_at_epoch_end)
            self._apply_accounting()
            self._tag_scan_due = True
            table = self.table
            index = opened.index
            host = self.host.end_status(table)
            shm = self.failures.guard(lambda: self.shm.epoch_end(table), "shm")
            self.book.end(
                table,
                now=self.now(),
                reason=reason,
                error=error,
                devices=self.nvml.device_states(),
                batches=batches,
                host=host,
                shm=shm,
            )
            if self.host.plan(index, table):
                self._ticker.wake()  # read off this thread, right away (NOTE [host pacing])
            claims.epoch_closed(self.session_id)
            return True

    def register_worker(self, key: ProcessKey, persistent: bool | None) -> None:
        """Declare ``key`` a worker of this job (exact identity, not a guess)."""
        with self.lock:
            if self.reader is not None and not self.closed:
                self.reader.register_worker(key, persistent)

    def note_exit(self, pid: int, exit_code: int) -> None:
        """A process of the job exited with ``exit_code`` (negative: killed by that signal).

        A death by a signal is kept with what the machine says right now (NOTE at the top
        of machine.py) and what the process's faulthandler wrote; an exit with a status is
        not a death. Each identity dies once.
        """
        if exit_code >= 0:
            return
        with self.lock:
            if self.table is None or self.closed:
                return
            self.sample(epoch_end=False)  # the mailbox: a worker that died unregistered
            self.failures.guard(lambda: self._note_death(pid, -exit_code), "death")

    def _note_death(self, pid: int, signal_number: int) -> None:
        assert self.table is not None
        key = self.table.by_pid.get(pid)
        proc = self.table.procs.get(key) if key is not None else None
        if proc is not None:
            self.death_log.note(
                proc,
                signal_number,
                at_s=self.now(),
                epoch=self.book.open_index,
                shm=self.shm,
                mailbox_dir=self._mailbox_dir,
            )

    # -- one sample ----------------------------------------------------------------------

    def sample(
        self,
        *,
        epoch_end: bool,
        scan_tags: bool = False,
        walk: bool = True,
        quick: bool = False,
        read_memory: bool = True,
        lists_paced_out: bool = False,
    ) -> None:
        """One sample; the caller holds the lock. Unpaced unless the sampler's tick says so."""
        if self.closed or self.reader is None:
            return
        self.reader.sample(
            epoch_end=epoch_end,
            scan_tags=scan_tags,
            walk=walk,
            quick=quick,
            read_memory=read_memory,
            lists_paced_out=lists_paced_out,
        )

    @property
    def teardowns(self) -> tuple[TeardownRecord, ...]:
        """Worker teardowns reported through the mailbox, in arrival order."""
        return () if self.reader is None else tuple(self.reader.teardowns)

    def _apply_accounting(self) -> None:
        if self.reader is not None:
            self.reader.apply_accounting()

    # -- results -------------------------------------------------------------------------

    def current_state(self, *, closed: bool = False) -> FinalState:
        """A fresh, full read of who is alive now and what each holds (caller holds the lock)."""
        self.sample(epoch_end=True, scan_tags=True)
        self._apply_accounting()
        table = self.table
        assert table is not None
        last_end = next((e.end_s for e in reversed(self.book.epochs) if e.end_s), None)
        status, rollup = self.host.final_reads(table, closed=closed)
        if closed:
            self.shm_files = self.failures.guard(lambda: self.shm.left_behind(table), "shm") or ()
        processes = final_processes(table, last_end, status, rollup, self.book, self.now())
        pending = () if closed else tuple(p.key for p in self.book.pending_survivors(table)[0])
        return FinalState(
            time_s=self.now(),
            devices=self.nvml.device_states(),
            processes=processes,
            parent_allocated_gpu_bytes=(
                _torch_allocated_bytes() if self.root_pid == os.getpid() else None
            ),
            others_gpu_bytes=table.others_gpu_bytes(),
            closed=closed,
            pending_pids=tuple(sorted(key.pid for key in pending)),
            open_epoch=self.book.open_index,
        )

    def timeline(self, *, last_epochs: int | None, final: FinalState | None) -> Timeline:
        """All observations so far, frozen (the caller holds the lock)."""
        assert self.table is not None or not self.started
        records = (
            self.book.records(self.table, now=self.now(), last=last_epochs)
            if self.table is not None
            else ()
        )
        return Timeline(
            session_id=self.session_id,
            root=self.root_key,
            started_unix_s=self.started_unix_s,
            boot_unix_s=self.boot_unix_s,
            attribution=self.nvml.attribution,
            attribution_reason=self.nvml.attribution_reason,
            baseline_devices=self.baseline_devices,
            baseline_gpu_bytes=dict(self.baseline_gpu_bytes),
            epochs=records,
            final=final,
            failures=self.failures.lines(),
            teardowns=self.teardowns,
            # Files left in /dev/shm are judged once the work is over (at close): before,
            # the job's workers may still be using theirs.
            shm_files=self.shm_files if final is not None and final.closed else (),
            deaths=tuple(self.death_log.deaths),
            stalls=tuple(self.stalls),
        )

    # -- environment and NVML ------------------------------------------------------------


def _torch_allocated_bytes() -> int | None:
    """Bytes the torch allocator holds in this process, where CUDA is initialised already."""
    cuda = initialized_cuda()
    if cuda is None:
        return None
    try:
        return int(sum(cuda.memory_allocated(index) for index in range(cuda.device_count())))
    except Exception:
        return None


def end_reason_for(error: BaseException | None) -> tuple[EndReason, str | None]:
    """Map how an epoch ended (the exception, or None) to its end reason and error line."""
    if error is None:
        return "completed", None
    if isinstance(error, KeyboardInterrupt):
        return "interrupt", "KeyboardInterrupt"
    if isinstance(error, GeneratorExit):
        return "break", None
    return "exception", f"{type(error).__name__}: {error}".splitlines()[0]
