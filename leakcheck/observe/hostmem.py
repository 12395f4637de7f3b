"""Host memory per process (USS, PSS, RSS), and the job's files in ``/dev/shm``.

The DataLoader "leak" users report most is host memory copied on read; next, ``/dev/shm``
files (a full tmpfs kills workers with a bus error). A process gone or denied reads as None.

NOTE [rollup cost]: the kernel builds /proc/PID/smaps_rollup by walking the page tables, so a
read costs with the process's resident memory; /proc/PID/status reads kept counters (a small
cost at any size) but cannot tell private pages from shared ones. So USS and PSS are epoch-end
reads, not per-tick ones (figures: benchmarks/results/hostmem-cpu.md).

NOTE [copy on read]: a forked worker starts with its parent's memory shared, and a page it
writes (a reference count, as it reads an object) is copied: in ``smaps_rollup`` it moves from
``Shared_Dirty`` to ``Private_Dirty``. New allocations raise ``Private_Dirty`` only; file
pages move ``*_Clean`` only. Between a reading at birth ``b`` and a later one ``n``::

    lost = max(0, b.Shared_Dirty - n.Shared_Dirty)
    copied = min(lost, max(0, n.Private_Dirty - b.Private_Dirty))

the shared pages it lost, bounded by what it gained privately (a page swapped out, or whose
other sharers exited, is lost without a copy). ``Shared_Clean`` is left out: pages of a file
two workers read rise there and would hide copies made meanwhile. A worker born by spawn or
forkserver shares nothing at birth: only its private memory is reported.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from leakcheck.core.readings import ProcessKey
from leakcheck.observe import procs
from leakcheck.observe.procs import ShmSegment

MemorySource = Literal["smaps_rollup", "status", "unknown"]

_Target = TypeVar("_Target", int, ProcessKey)


@dataclass(frozen=True)
class HostMemory:
    """Host memory of one process at one moment, in bytes.

    USS: what the process alone holds (what copy-on-read grows); PSS shares each page among
    its mappers; RSS counts every resident page. ``source`` ``status`` (rollup unreadable) has
    no USS, PSS nor dirty figures; ``unknown`` (a zombie, a kernel thread) nothing.
    """

    uss_bytes: int | None  # Private_Clean + Private_Dirty + Private_Hugetlb
    pss_bytes: int | None
    rss_bytes: int | None
    swap_bytes: int | None  # not in the other figures
    source: MemorySource
    anon_bytes: int | None = None  # resident anonymous memory (the heap)
    rss_peak_bytes: int | None = None  # VmHWM, never below rss_bytes
    shared_dirty_bytes: int | None = None  # NOTE [copy on read]
    private_dirty_bytes: int | None = None


_UNKNOWN = HostMemory(None, None, None, None, "unknown")
_ROLLUP_FIELDS = frozenset(
    (b"Rss", b"Pss", b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb", b"Swap",
     b"Anonymous", b"Shared_Dirty")
)  # fmt: skip
_STATUS_FIELDS = frozenset((b"VmRSS", b"VmHWM", b"RssAnon", b"VmSwap"))


def _read_at(name: str, dir_fd: int) -> bytes | None:
    # None: denied (smaps needs ptrace access), gone, or ESRCH (a zombie). 8 KiB holds both
    # files' memory lines.
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 8192)
    except OSError:
        return None
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
                found[name] = int(value[0]) * 1024
    return found


def _parse_rollup(data: bytes) -> HostMemory | None:
    found = _kib_fields(data, _ROLLUP_FIELDS)
    if b"Rss" not in found or b"Pss" not in found:
        return None
    private = (b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb")
    return HostMemory(
        uss_bytes=sum(found.get(name, 0) for name in private),
        pss_bytes=found[b"Pss"],
        rss_bytes=found[b"Rss"],
        swap_bytes=found.get(b"Swap"),
        source="smaps_rollup",
        anon_bytes=found.get(b"Anonymous"),
        shared_dirty_bytes=found.get(b"Shared_Dirty", 0),
        private_dirty_bytes=found.get(b"Private_Dirty", 0),
    )


def _parse_status(data: bytes) -> HostMemory:
    found = _kib_fields(data, _STATUS_FIELDS)
    if b"VmRSS" not in found:
        return _UNKNOWN  # a zombie or kernel thread has no memory lines
    return HostMemory(
        uss_bytes=None,
        pss_bytes=None,
        rss_bytes=found[b"VmRSS"],
        swap_bytes=found.get(b"VmSwap"),
        source="status",
        anon_bytes=found.get(b"RssAnon"),
        rss_peak_bytes=found.get(b"VmHWM"),
    )


def copied_bytes(birth: HostMemory, now: HostMemory) -> int | None:
    """Bytes of its parent's pages a forked worker copied since ``birth`` (NOTE [copy on read]).

    None where either reading lacks the dirty figures.
    """
    shared_then, private_then = birth.shared_dirty_bytes, birth.private_dirty_bytes
    shared_now, private_now = now.shared_dirty_bytes, now.private_dirty_bytes
    if shared_then is None or shared_now is None or private_then is None or private_now is None:
        return None
    return min(max(0, shared_then - shared_now), max(0, private_now - private_then))


def read_host_memory(target: int | ProcessKey, *, rollup: bool = True) -> HostMemory | None:
    """Read one process's host memory; None when it is gone.

    ``target``: a PID, or a ``ProcessKey`` (naming another process now: gone). ``rollup``
    False: status only (NOTE [rollup cost]).
    """
    # A descriptor on /proc/PID is bound to its process: opened first, then the PID checked
    # to still name the key's process, every read through it is of that process.
    pid = target.pid if isinstance(target, ProcessKey) else target
    try:
        dir_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if isinstance(target, ProcessKey) and procs.process_key(pid) != target:
            return None
        rollup_data = _read_at("smaps_rollup", dir_fd) if rollup else None
        status_data = _read_at("status", dir_fd)
    finally:
        os.close(dir_fd)
    parsed = _parse_rollup(rollup_data) if rollup_data else None
    if status_data is None:
        return parsed  # gone: None, or what smaps_rollup showed just before it went
    status = _parse_status(status_data)
    if parsed is None or status.source == "unknown":
        return parsed or status  # status tells a zombie from the living; or it exited between
    # The walk's Rss and the kernel's counters can differ by a few pages: a peak below the
    # end would read as nonsense.
    return replace(parsed, rss_peak_bytes=max(status.rss_peak_bytes or 0, parsed.rss_bytes or 0))


def read_host_memories(
    targets: Iterable[_Target], *, rollup: bool = True
) -> dict[_Target, HostMemory]:
    """``read_host_memory`` of each target still there, keyed as given."""
    read = {target: read_host_memory(target, rollup=rollup) for target in targets}
    return {target: memory for target, memory in read.items() if memory is not None}


# --- /dev/shm -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShmCapacity:
    """Size and use of a shared-memory directory's filesystem (``statvfs``).

    ``total_bytes`` None: no limit; ``used_bytes``: the whole host's, removed files held too;
    ``free_bytes``: what an unprivileged process can still allocate.
    """

    directory: str
    total_bytes: int | None
    used_bytes: int
    free_bytes: int


def shm_capacity(directory: str = "/dev/shm") -> ShmCapacity | None:
    """The ``ShmCapacity`` of ``directory``; None if missing."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    block = st.f_frsize or st.f_bsize
    used = (st.f_blocks - st.f_bfree) * block
    return ShmCapacity(directory, st.f_blocks * block or None, used, st.f_bavail * block)


_NUMBER_TOKEN = re.compile(r"^[0-9]{2,9}$")
_TOKEN_SPLIT = re.compile(r"[^0-9A-Za-z]+")
_TORCH_CREATOR = re.compile(r"^torch_([0-9]+)_")
_CUDA_IPC = re.compile(r"^cuda\.shm\.[0-9A-Za-z]+\.([0-9a-fA-F]+)\.[0-9A-Za-z]+$")


def shm_creator_pid(name: str) -> int | None:
    """The maker's PID where a name says (``torch_<pid>_...``, ``cuda.shm.<id>.<hex pid>.<n>``)."""
    match = _TORCH_CREATOR.match(name)
    if match:
        return int(match.group(1))
    match = _CUDA_IPC.match(name)
    return int(match.group(1), 16) if match else None


def shm_name_pids(name: str) -> set[int]:
    """PIDs a shared-memory file's name may carry: its maker's, and whole numbers in it."""
    found = {int(token) for token in _TOKEN_SPLIT.split(name) if _NUMBER_TOKEN.match(token)}
    creator = shm_creator_pid(name)
    return found if creator is None else found | {creator}


def is_named_semaphore(name: str) -> bool:
    """A POSIX named semaphore's file (``sem.NAME``), which no shm rule judges."""
    return name.startswith("sem.")


# NOTE [job shm]: ``/dev/shm`` is the whole host's and /proc says who holds a file, never who
# made it. So a file that appeared while the job ran is the job's only on evidence: a live
# process of the job holds it open or mapped, its name carries the PID of a process of the job
# (torch's ``torch_<pid>_...``, CUDA IPC's hex PID; gone makers too), or this process made it
# (NOTE [made here]). Other files are said as "nothing ties it to the work", never blamed: a
# time window proves nothing where other jobs share the directory. A file made by a process
# of the job that is gone and named none of them cannot be told from another job's.
def job_shm(
    names: Iterable[str], live: Iterable[int], job: Collection[int], directory: str = "/dev/shm"
) -> dict[str, int | None]:
    """Those of ``names`` that are the job's, each with its first holder among ``live``.

    ``live``: the job's processes alive now; ``job``: all of them, gone ones too (NOTE [job
    shm]). None: held by none of ``live`` (named after the job, or made here).
    """
    holders: dict[str, int] = {}
    for pid, held in procs.shm_open_by(live, directory).items():
        for name in held:
            holders.setdefault(name, pid)
    made = shm_made_here(directory)
    return {
        name: holders.get(name)
        for name in names
        if name in holders or name in made or not shm_name_pids(name).isdisjoint(job)
    }


# NOTE [made here]: a process can say which files it made itself. An audit hook (PEP 578) notes
# each file this process creates in a watched directory from Python: ``open`` with O_CREAT of a
# name not there yet (builtin ``open``, ``os.open``, numpy's memmap), and the ``ftruncate`` that
# sizes a ``SharedMemory`` (its ``shm_open`` is not audited). Files made in C (torch's carry their
# maker's PID instead) or by other processes are not seen. A hook cannot be removed: it stays for
# the process's life, costs a call per audited event, and never raises into the program.
_made_dirs: dict[str, str] = {}  # a watched directory, as given and resolved -> resolved
_made: set[str] = set()  # paths this process created there, resolved


def note_shm_made(directory: str = "/dev/shm") -> None:
    """From now on, note the files this process creates in ``directory`` (NOTE [made here])."""
    if not _made_dirs:
        sys.addaudithook(_on_audit)
    real = os.path.realpath(directory)  # a descriptor's link names the resolved path
    _made_dirs.update({os.path.abspath(directory): real, real: real})


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" and event != "os.truncate":
        return
    try:
        target = args[0]  # open: (path, mode, flags); os.truncate: (path or fd, length)
        if isinstance(target, int):
            if event == "open":
                return  # opening a descriptor makes nothing
            target = os.readlink(f"/proc/self/fd/{target}")
        elif event == "open" and not (isinstance(args[2], int) and args[2] & os.O_CREAT):
            return
        folder, name = os.path.split(os.path.abspath(os.fsdecode(target)))
        if folder not in _made_dirs:
            return
        path = os.path.join(_made_dirs[folder], name)
        if event == "open" and os.path.lexists(path):
            return  # another's file, opened (or an O_EXCL open that fails)
        _made.add(path)
    except Exception:
        return  # NOTE [made here]: never into the program


def shm_made_here(directory: str = "/dev/shm") -> set[str]:
    """Names of the files in ``directory`` this process made that are still there."""
    folder = os.path.realpath(directory)
    found: set[str] = set()
    for path in list(_made):  # the hook may add meanwhile, from another thread
        if not os.path.lexists(path):
            _made.discard(path)  # removed: a later file of that name is not known to be ours
        elif os.path.dirname(path) == folder:
            found.add(os.path.basename(path))
    return found


def job_shm_files(
    before: Mapping[str, ShmSegment], now: Mapping[str, ShmSegment]
) -> list[ShmSegment]:
    """The files of ``procs.shm_segments`` ``now`` absent from ``before`` or made again."""
    return [
        segment
        for name, segment in sorted(now.items())
        if name not in before or before[name].inode != segment.inode
    ]
