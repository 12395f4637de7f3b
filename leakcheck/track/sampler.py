"""The sampler under ``Tracker``: one background thread that reads the job, per epoch.

NOTE [tracker lifecycle]: ``Tracker.start()`` takes a baseline (devices, the root's GPU bytes,
the processes already there: pre-existing, never survivors), exports ``LEAKCHECK_SESSION`` and
``LEAKCHECK_MAILBOX`` for children, and starts one daemon thread. Each tick reads what
``Pacing`` allows: device memory, NVML's per-PID lists where memory moved, and every fourth
tick the mailbox (NOTE [worker mailbox] in mailbox.py) and a walk of the root's descendants (at
once where a list names a PID not placed yet). An epoch end is one full sample with the
costlier extras (``/dev/nvidia*`` descriptors, command lines, RSS, ``/dev/shm``); the thread's
next wake scans /proc for tagged processes reparented away and reads USS and PSS (NOTE [host
pacing]). Sampling goes on between epochs (survivors are judged by how long after its epoch
each was seen); ``close()`` waits at most ``grace`` for undecided ones, then reads everything
once more. Own failures are recorded, never raised into the loop (``strict``: at the next call).

NOTE [born epoch]: a process is placed when a walk or tag scan first sees it, maybe epochs
after its birth, so its epoch comes from its start ticks (NOTE [process identity] in procs.py);
the epoch it was placed in stands in where that falls between epochs or the clocks disagree.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter

from leakcheck.core.model import (
    Death,
    DeviceState,
    FinalState,
    GpuProcess,
    ProcessKey,
    RuleConfig,
    ShmFile,
    Stall,
)
from leakcheck.observe import hostmem, machine, mailbox, procs
from leakcheck.observe.torch_state import allocator_bytes
from leakcheck.track.book import EpochBook
from leakcheck.track.hang import HangWatch, gather_stall
from leakcheck.track.pacing import Pacing, TickPlan
from leakcheck.track.reads import CostMeter, Failures, HostReads, NvmlReads, RollupPlan
from leakcheck.track.shm import ShmWatch
from leakcheck.track.table import Proc, ProcessTable

__all__ = ["Sampler"]


class Sampler:
    """One tracker's thread and what it read (NOTE [tracker lifecycle]).

    A tick is due every ``interval_s`` times what the last said (NOTE [idle ticks]). A wake
    (host reads, a stop) is served at once without putting the tick off: short epochs would
    otherwise starve every tick, and the tag scans with them.
    """

    def __init__(
        self,
        *,
        root_pid: int,
        interval_s: float,
        devices: list[int] | None,
        config: RuleConfig,
        strict: bool,
        use_nvml: bool,
        rollup_share: float | None,
        hang_after_s: float,
    ) -> None:
        self._root_pid, self.interval_s, self.devices = root_pid, interval_s, devices
        self.meter = CostMeter()
        self.failures = Failures(strict=strict)
        self.nvml = NvmlReads(devices, self.meter, self.failures, use_nvml=use_nvml)
        self.lock = threading.RLock()
        # Held but while someone wakes the thread, which waits on it between ticks: a timed
        # acquire of a plain lock is the cheapest wake measured.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._thread: threading.Thread | None = None
        self._closed = self.stopping = self.tag_scan_due = self._sampling = False
        self.t0_s = self._boot_offset_s = 0.0
        self._mailbox_dir: str | None = None
        self._inbox: mailbox.Inbox | None = None
        self._tag_scan: procs.TagScan | None = None
        self.baseline_devices: tuple[DeviceState, ...] = ()
        self.baseline_gpu_bytes: dict[int, int] = {}
        self.table: ProcessTable | None = None
        self.book = EpochBook(
            grace_s=config.grace_s, copy_tolerance_bytes=config.copy_tolerance_bytes
        )
        self.pacing = Pacing(interval_s, has_nvml=False)
        self.host = HostReads(
            self.failures, rollup_share=rollup_share, warmup_epochs=config.warmup_epochs
        )
        self.shm = ShmWatch()
        self.shm_files: tuple[ShmFile, ...] = ()  # judged once the work is over: at close
        self.hang = HangWatch(hang_after_s)
        self.stalls: list[Stall] = []
        self.deaths: list[Death] = []
        self._oom_kills: int | None = None  # what the next death's OOM kills count from

    @property
    def root_pid(self) -> int:
        """The job's root process."""
        return self._root_pid

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    @property
    def mailbox_dir(self) -> str | None:
        """The folder the workers report to (NOTE [worker mailbox]); None before ``start()``."""
        return self._mailbox_dir

    @property
    def _own_process(self) -> bool:
        # Asked each time: a forked child is not the root.
        return self.root_pid == os.getpid()

    def now(self) -> float:
        """Seconds since the start, on the clock of every record."""
        return time.monotonic() - self.t0_s

    def _baseline(self, table: ProcessTable, mailbox_dir: str | None) -> None:
        """Take the baseline of ``table``'s job (lock held)."""
        self.t0_s = time.monotonic()
        self._boot_offset_s = procs.since_boot_s() - self.now()
        self._mailbox_dir = mailbox_dir
        self._oom_kills = self.failures.guard(machine.oom_kill_count, "cgroup")
        self.nvml.open()
        self.pacing.has_nvml = self.nvml.handle is not None
        self.failures.guard(self.shm.start, "shm")
        self.table = table
        lineage = self.failures.guard(lambda: procs.descendants(self.root_pid), "lineage")
        for info in lineage or []:
            table.add(info, now=0.0, born_epoch=None, pre_existing=True)
        self._tag_scan = procs.TagScan(table.tag[1], born_since=table.root, variable=table.tag[0])
        self._inbox = mailbox.Inbox(mailbox_dir) if mailbox_dir else None
        self._sample(epoch_end=False)
        self.baseline_devices = self.nvml.device_states()
        # The end state also counts as the job's the root's own bytes and what other
        # trackers' or ranks' processes held (NOTE [other ranks] in table.py).
        baseline = Counter(table.procs[table.root].gpu_bytes)
        baseline.update(table.others_gpu_bytes())
        self.baseline_gpu_bytes = dict(baseline)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leakcheck-sampler", daemon=True)
        self.meter.sampler_thread = self._thread
        self._thread.start()

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # released already: a wake is pending
            self._gate.release()

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 10 * self.interval_s))

    def _run(self) -> None:
        ticks = 1
        tick_due_s = time.monotonic() + self.interval_s
        try:
            while True:
                woken = self._gate.acquire(timeout=max(0.0, tick_due_s - time.monotonic()))
                if self.stopping:
                    return
                cpu_start_s = time.thread_time()
                if woken:
                    self.finish_reads()  # then wait for the tick still due
                    spent_s = time.thread_time() - cpu_start_s
                    self.meter.add(sampler_cpu_s=spent_s, host_read_cpu_s=spent_s)
                    continue
                ticks = self._tick(ticks)
                if not ticks:
                    return
                tick_due_s = time.monotonic() + ticks * self.interval_s
                self.meter.add(sampler_cpu_s=time.thread_time() - cpu_start_s)
        except Exception as error:  # the detector's own failure is reported, never lost
            with self.lock:  # reports read the failures under it
                self.failures.record(
                    f"the sampler thread stopped (samples at epoch ends only from then on): "
                    f"{type(error).__name__}: {error}",
                    error,
                )

    def _tick(self, ticks: int) -> int:
        """One tick; how many intervals until the next (0: closed)."""
        with self.lock:
            if self.closed:
                return 0
            scan_tags, self.tag_scan_due = self.tag_scan_due, False
            tick = self.pacing.plan(time.perf_counter(), ticks, walk_now=scan_tags)
            self._sample(epoch_end=False, scan_tags=scan_tags, quick=True, tick=tick)
            opened, table = self.book.open, self.table
            inside = stalled = None
            if table is not None and opened is not None:
                inside = self.host.plan_inside(table, opened.index, opened.start_s, self.now())
                waited_s = self.hang.due()
                if waited_s is not None:
                    self._sample(epoch_end=False)  # the mailbox: every worker's record
                    workers = [k for k in table.live_workers() if table.procs[k].dumps_stacks]
                    stalled = (workers, opened.index, waited_s)
            next_ticks = self.pacing.ticks_until_work(time.perf_counter())
        if inside is not None:
            self._read_inside(inside)
        if stalled is not None:  # NOTE [hang watch] in hang.py
            self._keep_stall(*stalled)
        return next_ticks

    def _keep_stall(
        self, workers: list[ProcessKey], epoch: int | None, waited_s: float, pid: int | None = None
    ) -> None:
        # Stacks are gathered off the lock: they wait for the workers.
        folder, at_s, loop = self.mailbox_dir, self.now(), self._own_process
        stall = self.failures.guard(
            lambda: gather_stall(
                workers, folder, epoch=epoch, waited_s=waited_s, at_s=at_s, pid=pid, loop=loop
            ),
            "hang watch",
            lock=self.lock,
        )
        if stall is not None:
            with self.lock:
                self.stalls.append(stall)

    def _death(self, proc: Proc, signal_number: int) -> Death:
        """``proc`` died of a signal: the evidence now."""
        counted, kills = self._oom_kills, machine.oom_kill_count()
        rise = None if kills is None or counted is None else kills - counted
        memory, folder = machine.machine_memory(), self.mailbox_dir
        self.shm.note_usage()
        death = Death(
            key=proc.key,
            signal_number=signal_number,
            at_s=self.now(),
            epoch=self.book.open_index,
            oom_kills=rise,
            memory_total_bytes=memory.total_bytes if memory else None,
            memory_available_bytes=memory.available_bytes if memory else None,
            shm_total_bytes=self.shm.total_bytes,
            shm_used_peak_bytes=self.shm.used_peak_bytes,
            rss_bytes_birth=proc.birth_host.rss_bytes if proc.birth_host else None,
            rss_bytes_last=proc.rss_bytes_last,
            stack=mailbox.read_stack(folder, proc.key, remove=True) if folder else None,
        )
        if rise and counted is not None:  # each death takes one kill of a rise: bursts share
            self._oom_kills = counted + 1
        elif kills is not None:
            self._oom_kills = kills
        return death

    def _read_inside(self, plan: RollupPlan) -> None:
        """An in-epoch read of the forked workers, off the lock (NOTE [host pacing])."""
        started_cpu_s = time.thread_time()
        found = self.failures.guard(lambda: self.host.rollup(plan.keys, count=False), "host memory")
        self.host.inside_reads += 1
        with self.lock:
            if found and self.table is not None and self.book.open_index == plan.epoch_index:
                self.book.apply_inside(self.table, found, plan.at_s)
        self.meter.add(host_read_cpu_s=time.thread_time() - started_cpu_s)

    def finish_reads(self) -> None:
        """Make (or wait for) the host reads the last epoch end planned; no lock held."""
        self.host.read_planned(self.lock, self.book.apply_rollup)

    def _register_worker(self, key: ProcessKey, persistent: bool | None) -> None:
        """Declare ``key`` a worker of this job (the caller holds the lock)."""
        if self.table is not None and not self.closed:
            self.table.register_worker(
                key, persistent, now=self.now(), born_epoch=self.book.open_index
            )
            if self.book.open is not None:  # counted in it, even known from its report alone
                self.book.open.row(key)

    def _sample(
        self,
        *,
        epoch_end: bool,
        scan_tags: bool = False,
        quick: bool = False,
        tick: TickPlan | None = None,
    ) -> None:
        """One sample, paced by ``tick`` where given; the caller holds the lock."""
        table = self.table
        if self.closed or table is None or self._sampling:
            # Re-entered from this thread (the lock is re-entrant): a loader iterator
            # collected mid-sample closes its epoch from inside this one, with this sample.
            return
        self._sampling = True
        started = time.perf_counter()
        try:
            now, nvml, pacing = self.now(), self.nvml, self.pacing
            walk = tick is None or tick.walk
            lists_paced_out = tick is not None and tick.lists_paced_out
            if self._inbox is not None and walk:
                inbox = self._inbox
                self.failures.guard(lambda: self._read_mailbox(inbox), "mailbox")
            device_used = nvml.memory(pacing) if tick is None or tick.read_memory else None
            gpu: tuple[GpuProcess, ...] | None = None
            new_on_gpu = False
            if not walk and not lists_paced_out and pacing.lists_due(quick=quick):
                gpu = nvml.lists(pacing, graphics=pacing.list_graphics(quick=quick))
                # A process new on the GPU is placed in the tree before it is attributed; this
                # list serves, as every PID in it existed before the walk began.
                new_on_gpu = gpu is not None and any(e.pid not in table.by_pid for e in gpu)
            if walk:
                self.failures.guard(self.shm.note_usage, "shm")
            if walk or new_on_gpu:
                if not self._walk(table, now, scan_tags=scan_tags, quick=quick):
                    return
                if not new_on_gpu and not lists_paced_out:
                    gpu = nvml.lists(pacing, graphics=True)
            if gpu is not None:
                missing = table.attribute_gpu(gpu, now=now)
                if missing and procs.pid_namespace_nested():
                    nvml.blind(
                        f"NVML reports PIDs {sorted(missing)[:5]} that do not exist in this PID"
                        " namespace (a container without --pid=host?): only device totals are"
                        " judged"
                    )
            if epoch_end:
                table.count_nvidia_fds()
                table.confirm_cmdlines()
            self.book.note_sample(table, device_used)
        except Exception as error:  # recorded, never raised; the next sample retries
            self.failures.record(f"sample: {type(error).__name__}: {error}", error)
        finally:
            self._sampling = False
            self.meter.add(samples=1, sample_wall_s=time.perf_counter() - started)

    def _walk(self, table: ProcessTable, now: float, *, scan_tags: bool, quick: bool) -> bool:
        self.pacing.walked()
        lineage = self.failures.guard(
            lambda: procs.descendants(self.root_pid, with_cmdline=False, quick=quick), "lineage"
        )
        if lineage is None:
            return False
        born = self.book.open_index
        added = table.apply_walk(lineage, now=now, quick=quick, born_epoch=born)
        if scan_tags and self._tag_scan is not None:
            scan = self._tag_scan
            found = self.failures.guard(lambda: scan.scan(table.procs), "tag scan")
            for info in found or []:  # reparented away
                added.append(table.add(info, now=now, born_epoch=born, in_lineage=False))
        ticks_per_s = procs.clock_ticks()
        for proc in added:  # NOTE [born epoch]
            born_s = proc.key.start_ticks / ticks_per_s - self._boot_offset_s
            proc.birth_epoch = (
                born if born_s > now + 1.0 else self.book.born_in(born_s, 1.0 / ticks_per_s)
            )
        # The workers' resident memory: what a worker the OOM killer takes held last.
        for key, memory in hostmem.read_host_memories(table.live_workers(), rollup=False).items():
            if memory.rss_bytes is not None:
                table.procs[key].rss_bytes_last = memory.rss_bytes
        return True

    def _read_mailbox(self, inbox: mailbox.Inbox) -> None:
        """Worker identities, births and teardowns (NOTE [worker mailbox] in mailbox.py)."""
        assert self.table is not None
        born = False
        for record in inbox.read():
            key = mailbox.record_key(record)
            if key is None:
                continue
            if record.get("kind") == "worker":
                persistent = record.get("persistent")
                self._register_worker(key, persistent if isinstance(persistent, bool) else None)
                self.table.note_birth(key, *mailbox.worker_birth(record))
                if record.get("stack_signal") == int(mailbox.STACK_SIGNAL):
                    self.table.procs[key].dumps_stacks = True
                born = True
            elif record.get("kind") == "teardown":
                self.book.apply_teardown(mailbox.teardown_record(record, key), self.t0_s)
        if born:
            mailbox.write_births(inbox.directory, self.table.births())

    def _current_state(self, *, closed: bool = False) -> FinalState:
        """A fresh, full read of who is alive now and what each holds (caller holds the lock)."""
        self._sample(epoch_end=True, scan_tags=True)
        table = self.table
        assert table is not None
        self.book.apply_accounting(table, self.nvml.accounting())
        status, rollup = self.host.final_reads(table, closed=closed)
        if closed:
            left = self.failures.guard(lambda: self.shm.files(table, closing=True), "shm")
            self.shm_files = left or ()
        pending = () if closed else tuple(p.key for p in self.book.pending_survivors(table)[0])
        allocated = allocator_bytes() if self._own_process else None
        return FinalState(
            time_s=self.now(),
            devices=self.nvml.device_states(),
            processes=self.book.final(table, status, rollup, self.now()),
            parent_allocated_gpu_bytes=sum(allocated[0].values()) if allocated else None,
            others_gpu_bytes=table.others_gpu_bytes(),
            closed=closed,
            pending_pids=tuple(sorted(key.pid for key in pending)),
            open_epoch=self.book.open_index,
        )
