"""The sampler: one background thread that reads the job's processes and devices, per epoch.

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
final state. Survivors
are judged later, from how long after its epoch's end each process was still seen: so the
sampler keeps running between epochs, and ``close()`` waits, at most ``grace`` after the
epoch each was born in, for every process whose survival is not decided yet, whichever
epoch it came from; then it reads everything once more. Every failure of leakcheck's own is
caught and recorded, never raised into the user's loop (``strict=True`` re-raises it at the
next call instead).

NOTE [born epoch]: a process is placed when a walk or a tag scan first sees it, which for a
helper that a short-lived worker started can be epochs after its birth (the scan for
reparented processes runs on the next wake, walks every fourth tick). So the epoch it was
born in comes from its create time, on the tracker's clock through the boot clock's offset
(``procs.since_boot_s``; both clocks tick alike), not from the epoch open when it was found:
"started in epoch 2" means born in epoch 2 (``ProcessEpoch.born_epoch``), and the survivor
rule, ``close()``'s wait and the tables' `alive after` all count the grace from that epoch's
end. The epoch it was placed in (``Proc.born_epoch``) is the first whose records have it, and
stands in for its birth where the create time falls between epochs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping

from leakcheck import mailbox, procs
from leakcheck.errors import UsageError
from leakcheck.hostmem import HostMemory
from leakcheck.model import (
    DeviceState,
    EndReason,
    FinalState,
    GpuProcess,
    ProcessKey,
    ShmFile,
    TeardownRecord,
    Timeline,
)
from leakcheck.sampling import claims, exports
from leakcheck.sampling.book import EpochBook, final_processes
from leakcheck.sampling.cost import CostMeter
from leakcheck.sampling.host import HostReads
from leakcheck.sampling.pacing import Pacing
from leakcheck.sampling.reads import Failures, NvmlReads
from leakcheck.sampling.shm import ShmWatch
from leakcheck.sampling.table import ProcessTable
from leakcheck.torch_state import initialized_cuda

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
        # Held but while someone wakes the sampler: it waits on it between ticks, so a close
        # (or an epoch end with host reads to make) wakes it at once; a timed acquire of a
        # plain lock is the cheapest wake measured.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._thread: threading.Thread | None = None
        self.started = self.closed = self._stopping = self._sampling = False
        self._t0 = 0.0
        self._boot_offset_s = 0.0
        """The boot clock's reading less the tracker's (NOTE [born epoch])."""
        self.started_unix_s = 0.0
        self.session_id = ""
        self.root_key = ProcessKey(root_pid, 0.0)
        self._mailbox_dir: str | None = None
        self._inbox: mailbox.Inbox | None = None
        self._export_token: int | None = None
        self._tag_scan: procs.TagScan | None = None
        self._tag_scan_due = False
        self.baseline_devices: tuple[DeviceState, ...] = ()
        self.baseline_gpu_bytes: dict[int, int] = {}
        self.table: ProcessTable | None = None
        self.book = EpochBook(grace_s=grace_s)
        self.pacing = Pacing(interval_s, has_nvml=False, rollup_share=rollup_share)
        self.host = HostReads(self.pacing, self.failures, warmup_epochs=warmup_epochs)
        self.shm = ShmWatch()
        self.shm_files: tuple[ShmFile, ...] = ()
        self.teardowns: list[TeardownRecord] = []
        self.final: FinalState | None = None

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
            self._boot_offset_s = procs.since_boot_s() - self.now()
            self.started_unix_s = time.time()
            self.root_key = root_key
            self.session_id = procs.new_session_id(self.root_pid)
            tag = self.session_tag or (procs.SESSION_ENV, self.session_id)
            self._tag_scan = procs.TagScan(tag[1], born_since=root_key, variable=tag[0])
            self._mailbox_dir = self.failures.guard(mailbox.create, "mailbox")
            if self._mailbox_dir:
                self._inbox = mailbox.Inbox(self._mailbox_dir)
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
            self.sample(epoch_end=False)
            self.baseline_devices = self.nvml.device_states()
            # What the end state also counts as the job's: the root's own bytes and those of
            # other trackers' or ranks' processes (their rise is the job's, not what they
            # already held: NOTE [other ranks] in table.py).
            baseline = dict(self.table.procs[root_key].gpu_bytes)
            for device, used in self.table.others_gpu_bytes().items():
                baseline[device] = baseline.get(device, 0) + used
            self.baseline_gpu_bytes = baseline
        self._thread = threading.Thread(target=self._run, name="leakcheck-sampler", daemon=True)
        self.meter.sampler_thread = self._thread
        self._thread.start()

    def close(self) -> None:
        """Close an open epoch, wait out pending survivors, stop, take the final state."""
        if not self.started or self.closed:
            self.closed = True
            return
        self.end_epoch("closed", None)
        self._wait_for_grace()
        if not self._stopping:
            self._stopping = True
            self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 10 * self.interval_s))
        self.finish_reads()  # planned at the last epoch end, not read yet
        with self.lock:
            self.final = self.current_state(closed=True)
            self.closed = True
            if self._export_token is not None:
                exports.withdraw(self._export_token)
                self._export_token = None
            if self._mailbox_dir:
                mailbox.remove(self._mailbox_dir)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as error:  # the detector's own failure is reported, never lost
            with self.lock:  # reports read the failures under it
                self.failures.record(
                    f"the sampler thread stopped (samples at epoch ends only from then on): "
                    f"{type(error).__name__}: {error}",
                    error,
                )

    def _loop(self) -> None:
        # When the next tick is due; the wait spans the ticks that would be empty (NOTE
        # [idle ticks]).
        ticks = 1
        tick_due_s = time.monotonic() + self.interval_s
        while True:
            woken = self._gate.acquire(timeout=max(0.0, tick_due_s - time.monotonic()))
            if self._stopping:
                return
            cpu_start_s = time.thread_time()
            if woken:
                # An epoch end planned host reads: read them now, close to the end they
                # belong to, then wait for the tick still due. A wake must not put the tick
                # off: epochs shorter than the wait would starve every tick, and with them
                # the scans for processes reparented away.
                self.finish_reads()
                spent_s = time.thread_time() - cpu_start_s
                self.meter.sampler_ran(spent_s)
                self.meter.host_read(spent_s)
                continue
            with self.lock:
                if self.closed:
                    return
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
                ticks = self.pacing.ticks_until_work(time.perf_counter())
            tick_due_s = time.monotonic() + ticks * self.interval_s
            self.meter.sampler_ran(time.thread_time() - cpu_start_s)

    def _wake(self) -> None:
        """Wake the sampler thread now (it checks ``_stopping`` first)."""
        with contextlib.suppress(RuntimeError):  # released already: a wake is pending
            self._gate.release()

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
        while pending and self.now() < deadline and not self._stopping:
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
                self._wake()  # read off this thread, right away (NOTE [host pacing])
            claims.epoch_closed(self.session_id)
            return True

    def register_worker(self, key: ProcessKey, persistent: bool | None) -> None:
        """Declare ``key`` a worker of this job (exact identity, not a guess)."""
        with self.lock:
            if self.table is None or self.closed:
                return
            self.table.register_worker(
                key, persistent, now=self.now(), born_epoch=self.book.open_index
            )
            self.book.see(key)

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
        if self.closed or self._sampling or self.table is None:
            # Re-entered from the same thread (the lock is re-entrant): a loader iterator
            # collected by the garbage collector mid-sample closes its epoch from inside
            # this one. That epoch end uses the sample in progress.
            return
        self._sampling = True
        started = time.perf_counter()
        try:
            self._sample(epoch_end, scan_tags, walk, quick, read_memory, lists_paced_out)
        except Exception as error:
            # Anything unforeseen is recorded, never raised into the caller's loop (and a
            # dead sampler thread would silently stop tracking); the next sample retries.
            self.failures.record(f"sample: {type(error).__name__}: {error}", error)
        finally:
            self._sampling = False
            self.meter.sample_taken(time.perf_counter() - started)

    def _sample(
        self,
        epoch_end: bool,
        scan_tags: bool,
        walk: bool,
        quick: bool,
        read_memory: bool,
        lists_paced_out: bool,
    ) -> None:
        table = self.table
        assert table is not None
        now = self.now()
        if self._inbox is not None and walk:
            inbox = self._inbox
            self.failures.guard(lambda: self._read_mailbox(inbox, quick=quick), "mailbox")
        device_used: dict[int, int] | None = None
        if read_memory:
            device_used = self.nvml.memory(self.pacing)
        gpu: tuple[GpuProcess, ...] | None = None
        new_on_gpu = False
        if not walk and not lists_paced_out and self.pacing.lists_due(quick=quick):
            gpu = self.nvml.lists(self.pacing, graphics=self.pacing.list_graphics(quick=quick))
            # A process new on the GPU: place it in the tree before attributing it. The list
            # read before the walk serves: every PID in it existed before the walk began.
            new_on_gpu = gpu is not None and any(e.pid not in table.by_pid for e in gpu)
        if walk:
            self.failures.guard(self.shm.note_usage, "shm")
        if walk or new_on_gpu:
            if not self._walk(now, scan_tags=scan_tags, quick=quick):
                return
            if not new_on_gpu and not lists_paced_out:
                gpu = self.nvml.lists(self.pacing, graphics=True)
        if gpu is not None:
            self._attribute(gpu, now)
        if epoch_end:
            table.count_nvidia_fds()
            table.confirm_cmdlines()
        self.book.note_sample(table, device_used)

    def _walk(self, now: float, *, scan_tags: bool, quick: bool) -> bool:
        table = self.table
        assert table is not None
        self.pacing.walked()
        lineage = self.failures.guard(
            lambda: procs.descendants(self.root_pid, with_cmdline=False, quick=quick), "lineage"
        )
        if lineage is None:
            return False
        born = self.book.open_index
        added = table.apply_walk(lineage, now=now, quick=quick, born_epoch=born)
        scan = self._tag_scan
        if scan_tags and scan is not None:
            found = self.failures.guard(lambda: scan.scan(table.procs), "tag scan")
            added += table.add_reparented(found or [], now=now, born_epoch=born)
        for proc in added:
            proc.birth_epoch = self._born_epoch(proc.key, now, fallback=born)
        return True

    def _born_epoch(self, key: ProcessKey, now: float, *, fallback: int | None) -> int | None:
        """The epoch ``key`` was born in, from its create time (NOTE [born epoch])."""
        born_s = key.create_time - procs.boot_time_s() - self._boot_offset_s
        if born_s > now + 1.0:
            return fallback  # a clock that does not agree: the epoch it was found in
        return self.book.born_in(born_s, 1.0 / procs.clock_ticks())

    def _attribute(self, gpu: tuple[GpuProcess, ...], now: float) -> None:
        assert self.table is not None
        missing = self.table.attribute_gpu(gpu, now=now)
        if missing and procs.pid_namespace_nested():
            self.nvml.blind(
                f"NVML reports PIDs {sorted(missing)[:5]} that do not exist in this PID "
                "namespace (a container without --pid=host?): only device totals are judged"
            )

    # -- the mailbox: exact identities and the workers' own reports ----------------------

    def _read_mailbox(self, inbox: mailbox.Inbox, *, quick: bool) -> None:
        for record in inbox.read(quick=quick):
            key = mailbox.record_key(record)
            if key is None:
                continue
            if record.get("kind") == "worker":
                persistent = record.get("persistent")
                self.register_worker(key, persistent if isinstance(persistent, bool) else None)
            elif record.get("kind") == "teardown":
                teardown = mailbox.teardown_record(record, key)
                self.teardowns.append(teardown)
                self.book.apply_teardown(teardown, self._t0)

    def _apply_accounting(self) -> None:
        """The driver's maxima of exited PIDs, where its accounting mode is already on."""
        assert self.table is not None
        self.book.apply_accounting(self.table, self.nvml.accounting())

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
        processes = final_processes(table, last_end, status, rollup)
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
            attribution=self.nvml.attribution,
            attribution_reason=self.nvml.attribution_reason,
            baseline_devices=self.baseline_devices,
            baseline_gpu_bytes=dict(self.baseline_gpu_bytes),
            epochs=records,
            final=final,
            failures=self.failures.lines(),
            teardowns=tuple(self.teardowns),
            # Files left in /dev/shm are judged once the work is over (at close): before,
            # the job's workers may still be using theirs.
            shm_files=self.shm_files if final is not None and final.closed else (),
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
