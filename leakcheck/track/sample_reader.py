"""One sample of a job: the mailbox, NVML, a walk of /proc, and where each process belongs.

The sampler decides when (its thread's ticks, the epoch ends, ``close()``); this reads what
is there then, into the process table and the epoch book, under the sampler's lock.

NOTE [born epoch]: a process is placed when a walk or a tag scan first sees it, which for a
helper that a short-lived worker started can be epochs after its birth (the scan for
reparented processes runs on the next wake, walks every fourth tick). So the epoch it was
born in comes from its start ticks (seconds since boot: NOTE [process identity] in procs.py),
on the tracker's clock through the boot clock's offset (``procs.since_boot_s``; both clocks
tick alike), not from the epoch open when it was found:
"started in epoch 2" means born in epoch 2 (``ProcessEpoch.born_epoch``), and the survivor
rule, ``close()``'s wait and the tables' `alive after` all count the grace from that epoch's
end. The epoch it was placed in (``Proc.born_epoch``) is the first whose records have it, and
stands in for its birth where the start falls between epochs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from leakcheck.core.model import GpuProcess, ProcessKey, TeardownRecord
from leakcheck.observe import hostmem, mailbox, procs
from leakcheck.track.book import EpochBook
from leakcheck.track.cost import CostMeter
from leakcheck.track.pacing import Pacing
from leakcheck.track.reads import Failures, NvmlReads
from leakcheck.track.shm import ShmWatch
from leakcheck.track.table import ProcessTable

__all__ = ["SampleReader"]


class SampleReader:
    """Takes one sample of a started job; every method runs under the sampler's lock.

    Args:
        root_pid: The job's root process.
        table: The job's processes.
        book: The job's epochs.
        nvml: NVML reads of the tracked devices.
        pacing: What a tick may read.
        shm: The job's /dev/shm files.
        failures: Where leakcheck's own failures are recorded.
        meter: Where each sample's time is counted.
        tag_scan: The scan for tagged processes reparented away.
        inbox: The workers' mailbox (None: none could be made).
        start_s: The tracker's start on the monotonic clock (the records' zero).
        boot_offset_s: The boot clock's reading less the tracker's (NOTE [born epoch]).
        now: Seconds since the start, on the clock of every record.

    """

    def __init__(
        self,
        *,
        root_pid: int,
        table: ProcessTable,
        book: EpochBook,
        nvml: NvmlReads,
        pacing: Pacing,
        shm: ShmWatch,
        failures: Failures,
        meter: CostMeter,
        tag_scan: procs.TagScan,
        inbox: mailbox.Inbox | None,
        start_s: float,
        boot_offset_s: float,
        now: Callable[[], float],
    ) -> None:
        self.root_pid = root_pid
        self.table = table
        self.book = book
        self.nvml = nvml
        self.pacing = pacing
        self.shm = shm
        self.failures = failures
        self.meter = meter
        self._tag_scan = tag_scan
        self._inbox = inbox
        self._start_s = start_s
        self._boot_offset_s = boot_offset_s
        self._now = now
        self._sampling = False
        self.teardowns: list[TeardownRecord] = []
        """Worker teardowns reported through the mailbox, in arrival order."""

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
        """One sample. Unpaced unless the sampler's tick says so."""
        if self._sampling:
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

    def register_worker(self, key: ProcessKey, persistent: bool | None) -> None:
        """Declare ``key`` a worker of this job (exact identity, not a guess)."""
        self.table.register_worker(
            key, persistent, now=self._now(), born_epoch=self.book.open_index
        )
        self.book.see(key)

    def apply_accounting(self) -> None:
        """The driver's maxima of exited PIDs, where its accounting mode is already on."""
        self.book.apply_accounting(self.table, self.nvml.accounting())

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
        now = self._now()
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
        self.pacing.walked()
        lineage = self.failures.guard(
            lambda: procs.descendants(self.root_pid, with_cmdline=False, quick=quick), "lineage"
        )
        if lineage is None:
            return False
        born = self.book.open_index
        added = table.apply_walk(lineage, now=now, quick=quick, born_epoch=born)
        if scan_tags:
            scan = self._tag_scan
            found = self.failures.guard(lambda: scan.scan(table.procs), "tag scan")
            added += table.add_reparented(found or [], now=now, born_epoch=born)
        for proc in added:
            proc.birth_epoch = self._born_epoch(proc.key, now, fallback=born)
        # The workers' resident memory, one /proc/PID/status each: what a worker the OOM
        # killer takes held at the last read before (``Sampler.note_exit``).
        for key, memory in hostmem.read_host_memories(table.live_workers(), rollup=False).items():
            if memory.rss_bytes is not None:
                table.procs[key].rss_bytes_last = memory.rss_bytes
        return True

    def _born_epoch(self, key: ProcessKey, now: float, *, fallback: int | None) -> int | None:
        """The epoch ``key`` was born in, from its start ticks (NOTE [born epoch])."""
        born_s = key.start_ticks / procs.clock_ticks() - self._boot_offset_s
        if born_s > now + 1.0:
            return fallback  # a clock that does not agree: the epoch it was found in
        return self.book.born_in(born_s, 1.0 / procs.clock_ticks())

    def _attribute(self, gpu: tuple[GpuProcess, ...], now: float) -> None:
        missing = self.table.attribute_gpu(gpu, now=now)
        if missing and procs.pid_namespace_nested():
            self.nvml.blind(
                f"NVML reports PIDs {sorted(missing)[:5]} that do not exist in this PID "
                "namespace (a container without --pid=host?): only device totals are judged"
            )

    def _read_mailbox(self, inbox: mailbox.Inbox, *, quick: bool) -> None:
        """Exact worker identities and the workers' own reports (NOTE [worker mailbox]).

        Births, as they come, go to the folder's births file too (``mailbox.read_births``).
        """
        born = False
        for record in inbox.read(quick=quick):
            key = mailbox.record_key(record)
            if key is None:
                continue
            if record.get("kind") == "worker":
                persistent = record.get("persistent")
                self.register_worker(key, persistent if isinstance(persistent, bool) else None)
                self.table.note_birth(key, *mailbox.worker_birth(record))
                if record.get("stack_signal") == int(mailbox.STACK_SIGNAL):
                    self.table.procs[key].dumps_stacks = True
                born = True
            elif record.get("kind") == "teardown":
                teardown = mailbox.teardown_record(record, key)
                self.teardowns.append(teardown)
                self.book.apply_teardown(teardown, self._start_s)
        if born:
            mailbox.write_births(inbox.directory, self.table.births())
