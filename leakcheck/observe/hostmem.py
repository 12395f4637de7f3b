"""Host memory per process (USS, PSS, RSS) and the job's files in ``/dev/shm``.

Why: the DataLoader "memory leak" users report most is host memory. A dataset that holds
Python objects is shared with forked workers page by page, and every access writes a
reference count, so the pages a worker touches become its own (copy-on-read): each worker's
*private* memory (USS) grows epoch after epoch, while its RSS, which also counts the pages
still shared with the parent, looks the same from the start. Next come ``/dev/shm`` files: a
full tmpfs (Docker's 64 MB default) kills workers with a bus error, and files left there
outlive the job.

What: ``read_host_memory`` reads ``/proc/PID/smaps_rollup`` (USS, PSS, RSS, swap) and falls
back to ``/proc/PID/status`` (RSS only) where the first cannot be read, saying which in
``HostMemory.source``; ``read_job_shm`` finds the files the job created in ``/dev/shm`` since
a baseline (``procs.shm_segments``), the job's processes that hold each (``procs.shm_open_by``)
and the filesystem's capacity. Like ``procs``, a process that vanishes or denies access while
it is read is a normal event here: None, never an exception. Off Linux, psutil answers.

NOTE [rollup cost]: the kernel builds smaps_rollup by walking the page tables of every mapping
of the process, so one read costs time in proportion to the process's resident memory (a
worker forked from a parent that holds a big dataset maps all of it, shared or not);
/proc/PID/status reads counters the kernel keeps, at a small constant cost, but cannot tell
private pages from shared ones. So USS and PSS are epoch-end reads, not per-tick ones. The RSS
peak needs no ticks either: status's ``VmHWM`` is kept by the kernel (``rss_peak_bytes``).
A sampler that wants RSS per tick reads status alone (``rollup=False``).
``benchmarks/bench_hostmem.py`` measures both (figures in benchmarks/results/README.md).

NOTE [copy on read]: a forked worker starts with its parent's memory shared page by page,
and a page it writes (a Python object's reference count, as it reads the object) is copied
into it. In ``smaps_rollup`` the page moves from ``Shared_Dirty`` (anonymous pages mapped by
more than one process: the heap inherited at fork) to ``Private_Dirty``. New memory the
worker allocates raises ``Private_Dirty`` and lowers nothing; pages of files it maps (a
library paged in, an mmap'd dataset) are clean, and move ``Shared_Clean``/``Private_Clean``
only. So, between a reading at the worker's birth (``b``) and one later (``n``)::

    lost = max(0, b.Shared_Dirty - n.Shared_Dirty)
    gained = max(0, n.Private_Dirty - b.Private_Dirty)
    copied = min(lost, gained)

the shared pages it lost, bounded by what it gained privately (a shared page swapped out,
or one whose other sharers all exited, is lost without a copy). ``Shared_Clean`` is left out
on purpose: the pages of a file that two workers read rise there and would hide copies made
at the same time (measured: 200k dicts read by 2 workers copy 39 MiB each; counting clean
pages too said 30). A page counts as copied by the worker even when its parent wrote it
first and the worker is its last holder: that copy exists because the worker was forked.
A worker born by spawn or forkserver shares nothing with the training process at birth:
its memory is its own from the start (an unpickled dataset included), and copy-on-read
cannot be told there: no copy is computed for it, only its private memory is reported.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from leakcheck.core.readings import ProcessKey
from leakcheck.observe import procs
from leakcheck.observe.procs import ShmSegment

__all__ = [
    "HostMemory",
    "JobShm",
    "JobShmFile",
    "MemorySource",
    "ShmCapacity",
    "copied_bytes",
    "job_shm_files",
    "read_host_memories",
    "read_host_memory",
    "read_job_shm",
    "shm_capacity",
    "shm_creator_pid",
    "shm_name_pids",
]

MemorySource = Literal["smaps_rollup", "status", "psutil", "unknown"]
"""Where a ``HostMemory`` came from (see ``HostMemory.source``)."""

_PROC = "/proc"
_HAS_PROC = sys.platform.startswith("linux") and os.path.exists(f"{_PROC}/self/stat")

# The file names read under /proc/PID; module-level so tests can make the first unreadable.
_ROLLUP_FILE = "smaps_rollup"
_STATUS_FILE = "status"

# smaps_rollup is about 1 KiB; status about 1.5 KiB, and its memory lines come before the long
# CPU and capability masks, so one read of this size holds every line parsed here.
_READ_SIZE = 8192

_KIB = 1024
_DELETED = " (deleted)"

_Target = TypeVar("_Target", int, ProcessKey)


@dataclass(frozen=True)
class HostMemory:
    """Host memory of one process at one moment, in bytes.

    USS (unique set size) is what the process alone holds: the memory it would give back by
    exiting, and the figure that grows under copy-on-read. PSS shares each page among the
    processes that map it, so the PSS of a job's processes adds up to the job's share. RSS
    counts every resident page, shared or not: a forked worker's RSS includes its parent's
    pages from the start.

    Attributes:
        uss_bytes: Private pages (``Private_Clean`` + ``Private_Dirty`` + ``Private_Hugetlb``,
            as psutil counts them); None unless ``source`` is ``smaps_rollup`` or ``psutil``.
        pss_bytes: Proportional set size; None unless ``source`` is ``smaps_rollup`` (or
            ``psutil`` on Linux).
        rss_bytes: Resident set size; None when ``source`` is ``unknown``.
        swap_bytes: Swapped-out bytes (not part of the figures above); None where unknown.
        source: ``smaps_rollup`` (every figure), ``status`` (smaps_rollup was unreadable: an
            older kernel, another user's process; RSS and its split only), ``psutil`` (no
            /proc: what psutil gives on this platform) or ``unknown`` (the process exists
            but has no memory to read: a zombie, a kernel thread, or nothing was readable).
        anon_bytes: Resident anonymous memory (smaps_rollup ``Anonymous``, status
            ``RssAnon``): the heap, where Python objects live; pages shared with a parent
            after fork count here too.
        file_bytes: Resident file-backed pages (status ``RssFile``).
        shmem_bytes: Resident shared memory, ``/dev/shm`` mappings included (status
            ``RssShmem``).
        rss_peak_bytes: Highest RSS over the process's life (status ``VmHWM``; never below
            ``rss_bytes``): for a worker that lives one epoch, that epoch's peak, without a
            read per tick. USS has no such counter: its peak is the largest value read.

        The last three come from /proc/PID/status, read with smaps_rollup too (it costs little
        next to the page walk); None where status was unreadable.
        shared_dirty_bytes: smaps_rollup ``Shared_Dirty``: written (anonymous, heap) pages
            that other processes map too, a forked worker's inherited heap among them
            (NOTE [copy on read]); None unless ``source`` is ``smaps_rollup``.
        private_dirty_bytes: smaps_rollup ``Private_Dirty``: written pages only this process
            maps (copies and new allocations); None unless ``source`` is ``smaps_rollup``.

    """

    uss_bytes: int | None
    pss_bytes: int | None
    rss_bytes: int | None
    swap_bytes: int | None
    source: MemorySource
    anon_bytes: int | None = None
    file_bytes: int | None = None
    shmem_bytes: int | None = None
    rss_peak_bytes: int | None = None
    shared_dirty_bytes: int | None = None
    private_dirty_bytes: int | None = None

    @property
    def private_or_rss_bytes(self) -> int | None:
        """USS where it is known, else RSS (which over-counts pages shared with others)."""
        return self.uss_bytes if self.uss_bytes is not None else self.rss_bytes


_UNKNOWN = HostMemory(None, None, None, None, "unknown")


# --- /proc reads ----------------------------------------------------------------------------


def _read_at(name: str, base: str, dir_fd: int | None) -> bytes:
    """One read of ``base/name`` (or ``name`` relative to ``dir_fd``); raises OSError."""
    path = name if dir_fd is not None else f"{base}/{name}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, _READ_SIZE)
    finally:
        os.close(fd)


def _kib_fields(data: bytes, wanted: frozenset[bytes]) -> dict[bytes, int]:
    """``Name:   123 kB`` lines -> {name: bytes}, for the wanted names only."""
    found: dict[bytes, int] = {}
    for line in data.split(b"\n"):
        name, sep, rest = line.partition(b":")
        if sep and name in wanted:
            value = rest.split()
            if value and value[0].isdigit():
                found[name] = int(value[0]) * _KIB
    return found


_ROLLUP_FIELDS = frozenset(
    (b"Rss", b"Pss", b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb", b"Swap",
     b"Anonymous", b"Shared_Dirty")
)  # fmt: skip
_STATUS_FIELDS = frozenset((b"VmRSS", b"VmHWM", b"RssAnon", b"RssFile", b"RssShmem", b"VmSwap"))


def _parse_rollup(data: bytes) -> HostMemory | None:
    """Parse smaps_rollup; None when it holds no figures (nothing to trust)."""
    found = _kib_fields(data, _ROLLUP_FIELDS)
    if b"Rss" not in found or b"Pss" not in found:
        return None
    uss = (
        found.get(b"Private_Clean", 0)
        + found.get(b"Private_Dirty", 0)
        + found.get(b"Private_Hugetlb", 0)
    )
    return HostMemory(
        uss_bytes=uss,
        pss_bytes=found[b"Pss"],
        rss_bytes=found[b"Rss"],
        swap_bytes=found.get(b"Swap"),
        source="smaps_rollup",
        anon_bytes=found.get(b"Anonymous"),
        shared_dirty_bytes=found.get(b"Shared_Dirty", 0),
        private_dirty_bytes=found.get(b"Private_Dirty", 0),
    )


def copied_bytes(birth: HostMemory, now: HostMemory) -> int | None:
    """Bytes of its parent's pages a forked worker copied since ``birth`` (NOTE [copy on read]).

    Args:
        birth: The worker's reading at its start (smaps_rollup).
        now: A later reading of the same worker (smaps_rollup).

    Returns:
        The copied bytes; None where either reading lacks the dirty figures (status only).

    """
    shared = (birth.shared_dirty_bytes, now.shared_dirty_bytes)
    private = (birth.private_dirty_bytes, now.private_dirty_bytes)
    if None in shared or None in private:
        return None
    lost = max(0, (shared[0] or 0) - (shared[1] or 0))
    gained = max(0, (private[1] or 0) - (private[0] or 0))
    return min(lost, gained)


def _parse_status(data: bytes) -> HostMemory:
    """Parse /proc/PID/status; ``unknown`` when it has no memory lines (zombie, kernel thread)."""
    found = _kib_fields(data, _STATUS_FIELDS)
    if b"VmRSS" not in found:
        return _UNKNOWN
    return HostMemory(
        uss_bytes=None,
        pss_bytes=None,
        rss_bytes=found[b"VmRSS"],
        swap_bytes=found.get(b"VmSwap"),
        source="status",
        anon_bytes=found.get(b"RssAnon"),
        file_bytes=found.get(b"RssFile"),
        shmem_bytes=found.get(b"RssShmem"),
        rss_peak_bytes=found.get(b"VmHWM"),
    )


def _read_proc_memory(base: str, dir_fd: int | None, rollup: bool) -> HostMemory | None:
    parsed = None
    if rollup:
        try:
            parsed = _parse_rollup(_read_at(_ROLLUP_FILE, base, dir_fd))
        except OSError:
            # Missing (a kernel before 4.14, or the process is gone), denied (another user's
            # process: smaps needs ptrace access, status does not), or ESRCH (a zombie has no
            # memory left to walk). status tells these apart.
            parsed = None
    try:
        status = _parse_status(_read_at(_STATUS_FILE, base, dir_fd))
    except OSError:
        return parsed  # gone: None, or what smaps_rollup showed just before it went
    if parsed is None:
        return status
    if status.source == "unknown":
        return parsed  # it exited between the two reads
    # The walk's Rss and the kernel's counters can differ by a few pages: a peak below the
    # end would read as nonsense.
    peak = max(status.rss_peak_bytes or 0, parsed.rss_bytes or 0)
    return replace(
        parsed,
        file_bytes=status.file_bytes,
        shmem_bytes=status.shmem_bytes,
        rss_peak_bytes=peak,
    )


def _read_key(key: ProcessKey, rollup: bool) -> HostMemory | None:
    # A descriptor on /proc/PID is bound to the process it was opened for: if the PID is
    # reused afterwards, reads through it fail instead of reading the newcomer. So open it
    # first, then check that the PID still names the key's process: if it does, every read
    # below is of that process.
    try:
        dir_fd = os.open(f"{_PROC}/{key.pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if procs.process_key(key.pid) != key:
            return None
        return _read_proc_memory("", dir_fd, rollup)
    finally:
        os.close(dir_fd)


def _ps_read(target: int | ProcessKey, rollup: bool) -> HostMemory | None:
    """The answer of psutil where there is no /proc (macOS, Windows, BSD)."""
    import psutil  # only here: importing it is slow, and Linux never needs it

    pid = target.pid if isinstance(target, ProcessKey) else target
    try:
        proc = psutil.Process(pid)
        # Identities come from /proc alone (NOTE [process identity] in procs.py): a key is
        # checked there, once psutil holds the process, or reads as gone.
        if isinstance(target, ProcessKey) and procs.process_key(pid) != target:
            return None
        with proc.oneshot():
            if rollup:
                try:
                    full = proc.memory_full_info()
                except psutil.AccessDenied:
                    pass
                else:
                    return HostMemory(
                        uss_bytes=getattr(full, "uss", None),
                        pss_bytes=getattr(full, "pss", None),
                        rss_bytes=full.rss,
                        swap_bytes=getattr(full, "swap", None),
                        source="psutil",
                    )
            try:
                basic = proc.memory_info()
            except psutil.AccessDenied:
                return _UNKNOWN
            return HostMemory(None, None, basic.rss, None, "psutil")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:
        return _UNKNOWN


# --- public API: memory ---------------------------------------------------------------------


def read_host_memory(target: int | ProcessKey, *, rollup: bool = True) -> HostMemory | None:
    """Read one process's host memory.

    Args:
        target: A PID, or a ``ProcessKey``: then a PID that now names another process (PID
            reuse) reads as gone.
        rollup: Read ``/proc/PID/smaps_rollup`` (USS, PSS), falling back to status where it
            is unreadable. False reads ``/proc/PID/status`` only: RSS and its split, at a
            cost that does not grow with the process's memory (NOTE [rollup cost]).

    Returns:
        The figures, with ``source`` saying where they came from; None when the process is
        gone (or is not the key's process). Never raises for a vanished process.

    """
    if not _HAS_PROC:
        return _ps_read(target, rollup)
    if isinstance(target, ProcessKey):
        return _read_key(target, rollup)
    return _read_proc_memory(f"{_PROC}/{target}", None, rollup)


def read_host_memories(
    targets: Iterable[_Target], *, rollup: bool = True
) -> dict[_Target, HostMemory]:
    """Read the host memory of several processes (``read_host_memory`` for each).

    Args:
        targets: PIDs, or ``ProcessKey`` identities.
        rollup: As in ``read_host_memory``.

    Returns:
        Target -> figures, keyed as given; processes that are gone are left out.

    """
    found: dict[_Target, HostMemory] = {}
    for target in targets:
        memory = read_host_memory(target, rollup=rollup)
        if memory is not None:
            found[target] = memory
    return found


# --- public API: /dev/shm -------------------------------------------------------------------


@dataclass(frozen=True)
class ShmCapacity:
    """Size and use of the filesystem behind a shared-memory directory (``statvfs``).

    Attributes:
        directory: The directory asked about.
        total_bytes: Size of the filesystem; None when it reports no limit (a tmpfs mounted
            with ``size=0``).
        used_bytes: Bytes in use, by every process of the host (the job's files, other jobs'
            files, and files already removed but still held open or mapped).
        free_bytes: Bytes an unprivileged process can still allocate there.

    """

    directory: str
    total_bytes: int | None
    used_bytes: int
    free_bytes: int

    @property
    def used_fraction(self) -> float | None:
        """``used_bytes / total_bytes``; None without a limit."""
        return None if not self.total_bytes else self.used_bytes / self.total_bytes


def shm_capacity(directory: str = "/dev/shm") -> ShmCapacity | None:
    """Size, use and free space of the filesystem behind ``directory``.

    Returns:
        The capacity; None when the directory cannot be queried (missing, no ``statvfs``).

    """
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # AttributeError: no statvfs on this platform
        return None
    block = st.f_frsize or st.f_bsize
    total = st.f_blocks * block
    return ShmCapacity(
        directory=directory,
        total_bytes=total or None,
        used_bytes=(st.f_blocks - st.f_bfree) * block,
        free_bytes=st.f_bavail * block,
    )


_NUMBER_TOKEN = re.compile(r"^[0-9]{2,9}$")
_TOKEN_SPLIT = re.compile(r"[^0-9A-Za-z]+")
_TORCH_CREATOR = re.compile(r"^torch_([0-9]+)_")
_CUDA_IPC = re.compile(r"^cuda\.shm\.[0-9A-Za-z]+\.([0-9a-fA-F]+)\.[0-9A-Za-z]+$")


def shm_creator_pid(name: str) -> int | None:
    """The PID of the process that made a shared-memory file, where its naming scheme says.

    torch's file_system sharing names its segments ``torch_<pid>_...``; torch's CUDA IPC
    reference-count files are ``cuda.shm.<id>.<pid in hex>.<n>``, made by the process that
    sent CUDA tensors (a DataLoader worker that returned them). None for other names.
    """
    match = _TORCH_CREATOR.match(name)
    if match:
        return int(match.group(1))
    match = _CUDA_IPC.match(name)
    if match:
        return int(match.group(1), 16)
    return None


def shm_name_pids(name: str) -> set[int]:
    """PIDs a shared-memory file's name may carry: its creator's, and whole numbers in it.

    ``x_1234_y`` -> {1234}: many schemes put a PID in the name, so a number that is the PID
    of a process of the job ties the file to the job (a guess, where no holder says more).
    """
    found = {int(token) for token in _TOKEN_SPLIT.split(name) if _NUMBER_TOKEN.match(token)}
    creator = shm_creator_pid(name)
    if creator is not None:
        found.add(creator)
    return found


@dataclass(frozen=True)
class JobShmFile:
    """A file that appeared in a shared-memory directory since a baseline.

    Attributes:
        name: File name inside the directory.
        size_bytes: Apparent size (a sparse file may use less of the filesystem).
        inode: Inode number (a file removed and created again under the same name is a new
            file: it gets a new one).
        holder_pids: The given processes that hold it open or mapped, ascending; empty when
            none does (it was left behind, or is held by a process that was not asked about).

    """

    name: str
    size_bytes: int
    inode: int
    holder_pids: tuple[int, ...] = ()


def is_named_semaphore(name: str) -> bool:
    """A POSIX named semaphore's file (``sem.NAME``), which no shm rule judges.

    Its users map it under a temporary name, so "nobody holds it" means nothing there, and
    any process using multiprocessing locks or queues (another job, another test run) makes
    them by the dozen.
    """
    return name.startswith("sem.")


def job_shm_files(
    before: Mapping[str, ShmSegment],
    now: Mapping[str, ShmSegment],
    holders: Mapping[int, Iterable[str]] | None = None,
) -> list[JobShmFile]:
    """The files of ``now`` that are new since ``before``, with the processes holding each.

    A pure function of its arguments: ``before`` and ``now`` come from
    ``procs.shm_segments``, ``holders`` from ``procs.shm_open_by`` (``read_job_shm`` calls all
    three).

    Args:
        before: The directory at the baseline (the job's start).
        now: The directory now.
        holders: PID -> names of the files it holds open or mapped. Names ending in
            ``" (deleted)"`` are files no longer in the directory: they match nothing here
            (``read_job_shm`` reports them apart).

    Returns:
        One entry per file absent from ``before``, or present there with another inode,
        sorted by name.

    """
    held_by: dict[str, list[int]] = {}
    for pid, names in (holders or {}).items():
        for name in names:
            held_by.setdefault(name, []).append(pid)
    files: list[JobShmFile] = []
    for name in sorted(now):
        segment = now[name]
        old = before.get(name)
        if old is not None and old.inode == segment.inode:
            continue
        pids = tuple(sorted(held_by.get(name, ())))
        files.append(JobShmFile(name, segment.size_bytes, segment.inode, pids))
    return files


@dataclass(frozen=True)
class JobShm:
    """The job's shared-memory files at one moment (an epoch end).

    Attributes:
        files: Files created since the baseline (``job_shm_files``).
        capacity: The filesystem's size and use; None when unknown.
        deleted_held: PID -> names of files already removed from the directory that the
            process still holds open or mapped: their memory stays in use (``capacity``
            counts it) until the holder lets go or exits. Only the given processes.

    """

    files: tuple[JobShmFile, ...]
    capacity: ShmCapacity | None
    deleted_held: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Apparent size of ``files``, summed."""
        return sum(item.size_bytes for item in self.files)


def read_job_shm(
    before: Mapping[str, ShmSegment], pids: Iterable[int], directory: str = "/dev/shm"
) -> JobShm:
    """Read the job's files in a shared-memory directory now.

    Args:
        before: The directory at the baseline, from ``procs.shm_segments(directory)``.
        pids: The job's live processes, whose descriptors and mappings name the holders.
        directory: The shared-memory directory.

    Returns:
        The new files with their holders, the filesystem's capacity, and the removed files
        the processes still hold.

    """
    now = procs.shm_segments(directory)
    holders = procs.shm_open_by(pids, directory)
    deleted = {
        pid: tuple(name[: -len(_DELETED)] for name in names if name.endswith(_DELETED))
        for pid, names in holders.items()
    }
    return JobShm(
        files=tuple(job_shm_files(before, now, holders)),
        capacity=shm_capacity(directory),
        deleted_held={pid: names for pid, names in deleted.items() if names},
    )
