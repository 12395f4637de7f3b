"""Process facts from /proc: identities, lineage, session tags, descriptors, /dev/shm.

A process that exits or denies access while read is normal: single-process functions return
None (or False), scans skip it.

NOTE [session tag]: the tracker exports ``LEAKCHECK_SESSION=<id>`` so that the job's processes
are recognised even once reparented. ``/proc/PID/environ`` is the environment of the last
``exec``, so the tag reaches exec'd children (``subprocess``, ``spawn``, ``forkserver``) but
not children only forked, which are found by lineage (``descendants``) while their parent lives.

NOTE [process identity]: a process is ``ProcessKey(pid, start_ticks)``, its start in clock
ticks since boot (field 22 of /proc/PID/stat), compared as integers. Never its Unix create time:
``btime`` follows the wall clock, so two processes compute create times a second apart for one
process (psutil#2526). Births against epochs compare seconds since boot.

NOTE [children files]: ``/proc/PID/task/TID/children`` lists the children of one *thread*: a
child started from a pin-memory thread or a thread pool is only in that thread's file, so every
task is read. Without the file (``CONFIG_PROC_CHILDREN`` off) lineage scans every stat. The
file is no snapshot: a child that forks or exits during the read may be missed for one sample.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from leakcheck.core.errors import UsageError
from leakcheck.core.readings import ProcessKey, ProcInfo

SESSION_ENV = "LEAKCHECK_SESSION"  # NOTE [session tag]
CMDLINE_MAX_CHARS = 32768  # a bound on memory, far above any real command line

_PROC = "/proc"
# A process gone (ENOENT), exited between open and read (ESRCH), or not ours (EACCES/EPERM).
_GONE = (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError)
_TAG_PREFIX = SESSION_ENV.encode() + b"="
_PF_KTHREAD = 0x00200000  # the kernel-thread bit of a task's flags (include/linux/sched.h)
_DEAD_STATES = (b"Z", b"X", b"x")  # zombie, dead: exited, whatever the reaping state
_NVIDIA_PREFIX = "/dev/nvidia"
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_CHILD_RECORD_BYTES = 24  # the longest record of a children file: a PID and a space
_ANY_RECORD = _PAGE_BYTES  # a file whose records can be a page long (maps: a line ends in a path)

# Whether /proc/PID/task/TID/children exists; None until probed. Tests force the fallback.
_children_supported: bool | None = None


class _Stat(NamedTuple):
    name: bytes
    state: bytes
    ppid: int
    num_threads: int
    starttime_ticks: int
    image: tuple[int, bytes, bytes, bytes, bytes, bytes] | None  # NOTE [incremental tag scan]
    kernel: bool


class ShmSegment(NamedTuple):
    """One file in a shared-memory directory (the inode tells a file made again apart)."""

    size_bytes: int
    mtime: float
    inode: int
    name: str = ""
    allocated_bytes: int = -1  # blocks the file holds (-1: not read): 0 for a failed reservation
    uid: int = -1  # its owner's


def _read(
    path: str, size: int = 4096, *, whole: bool = False, record_bytes: int | None = None
) -> bytes | None:
    """One read of at most ``size`` bytes, or ``whole`` the file; None: gone or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except _GONE:
        return None
    try:
        return _pread_all(fd, size, record_bytes=record_bytes) if whole else os.read(fd, size)
    except _GONE:
        return None
    finally:
        os.close(fd)


def _pread_all(fd: int, chunk: int = 65536, *, record_bytes: int | None = None) -> bytes:
    """The whole file from offset 0.

    ``record_bytes``: a seq_file's longest record (children, maps). Such a file returns about a
    page per read, so a read is its end only when shorter than a page by more than one record.
    """
    data = os.pread(fd, chunk, 0)
    size = len(data)
    if size < chunk and (record_bytes is None or size <= _PAGE_BYTES - record_bytes):
        return data
    parts = [data]
    while data:
        data = os.pread(fd, chunk, size)
        size += len(data)
        parts.append(data)
    return b"".join(parts)


def _parse_stat(data: bytes) -> _Stat | None:
    # The name sits between the first '(' and the *last* ')': it may hold both.
    rpar = data.rfind(b")")
    if rpar < 0:
        return None
    fields = data[rpar + 2 :].split()
    if len(fields) < 20:
        return None
    # man 5 proc numbers fields from 1; after "pid (comm) " field N sits at index N - 3.
    starttime_ticks = int(fields[19])
    name = data[data.find(b"(") + 1 : rpar]
    image = None
    # arg_start .. env_end (fields 48-51): 0 where we may not ptrace it or it has no memory.
    if len(fields) >= 49 and fields[46] != b"0":
        image = (starttime_ticks, name, fields[45], fields[46], fields[47], fields[48])
    # A kernel thread by PF_KTHREAD in field 9, not by the zeroed memory layout a zombie shows.
    kernel = fields[6].isdigit() and int(fields[6]) & _PF_KTHREAD != 0
    return _Stat(name, fields[0], int(fields[1]), int(fields[17]), starttime_ticks, image, kernel)


def _fields_of(data: bytes, name: bytes) -> list[bytes] | None:
    """The fields after ``name`` on the first line that starts with it; None: no such line."""
    for line in data.splitlines():
        if line.startswith(name):
            return line[len(name) :].split()
    return None


def _stat(pid: int) -> _Stat | None:
    data = _read(f"{_PROC}/{pid}/stat")
    return None if not data else _parse_stat(data)


def _image_of(pid: int, name: str) -> bytes | None:
    return _read(f"{_PROC}/{pid}/{name}", 65536, whole=True)


def _environ_tag(pid: int, prefix: bytes = _TAG_PREFIX) -> bytes | None:
    """The value of the variable ``prefix`` (``NAME=``) names in a process's environ."""
    environ = b"\0" + (_image_of(pid, "environ") or b"")
    at = environ.find(b"\0" + prefix)  # unreadable or absent alike
    return None if at < 0 else environ[at + 1 + len(prefix) :].partition(b"\0")[0]


def _cmdline(pid: int) -> str:
    # Empty for a kernel thread, a zombie, or a process gone.
    data = _read(f"{_PROC}/{pid}/cmdline", CMDLINE_MAX_CHARS) or b""
    return data.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def _info(
    pid: int, stat: _Stat, tag: bytes | None, with_cmdline: bool, prefix: bytes = _TAG_PREFIX
) -> ProcInfo:
    return ProcInfo(
        key=ProcessKey(pid, stat.starttime_ticks),
        ppid=stat.ppid,
        name=stat.name.decode("utf-8", "replace"),
        cmdline=_cmdline(pid) if with_cmdline else "",
        tagged=tag is not None and _environ_tag(pid, prefix) == tag,
    )


# NOTE [descriptor cache]: opening a /proc file costs about 3x reading it, so ``descendants``
# and ``is_alive`` keep /proc/PID/stat and the per-task children files open and re-read them
# with ``pread``. An open /proc file is bound to its process: once it is reaped, reading its
# stat fails and the PID is opened afresh. A vanished thread's children file reads empty, so
# the task list is taken again whenever the thread count changes, and every ``_RELIST_EVERY``
# walks. Bounded: 256 descriptors and an eighth of RLIMIT_NOFILE; entries unused in the last
# two walks are closed; a forked child closes its inherited copies at once. What it saves a
# walk: benchmarks/results/mechanisms-cpu.md.
_MAX_CACHED_FDS = 256
_RELIST_EVERY = 16
_RECHECK_EVERY = 4


@dataclass(slots=True)
class _Handles:
    """Open descriptors of one process: its stat file and its tasks' children files."""

    stat_fd: int
    used: int
    task_fds: dict[str, int] = field(default_factory=dict)
    listed: int = -_RELIST_EVERY  # the walk that last took the task list
    # NOTE [quick walk]: its last full read (with its command line?), and its threads with
    # children then.
    last_read: tuple[ProcInfo, bool] | None = None
    parent_tids: tuple[str, ...] = ()


_fd_lock = threading.Lock()
_handles: dict[int, _Handles] = {}
_cached_fd_count = 0
_generation = 0


@functools.cache
def _cached_fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _MAX_CACHED_FDS if soft == resource.RLIM_INFINITY else min(_MAX_CACHED_FDS, soft // 8)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _drop(pid: int) -> None:
    global _cached_fd_count
    handles = _handles.pop(pid, None)
    if handles is not None:
        for fd in (handles.stat_fd, *handles.task_fds.values()):
            _close_quietly(fd)
        _cached_fd_count -= 1 + len(handles.task_fds)


def _evict(older_than: int) -> None:
    for pid in [pid for pid, handles in _handles.items() if handles.used < older_than]:
        _drop(pid)


def _reserve() -> bool:
    """Make room for one more cached descriptor, if the bound allows."""
    global _cached_fd_count
    if _cached_fd_count >= _cached_fd_limit():
        # Only what neither this walk nor the previous one used: else a job larger than the
        # budget would reopen everything on every walk. Past it, the newest go uncached.
        _evict(_generation - 1)
        if _cached_fd_count >= _cached_fd_limit():
            return False
    _cached_fd_count += 1
    return True


def _reread(fd: int, record_bytes: int | None = None) -> bytes | None:
    """A cached file again from its start; None: its process or thread is gone."""
    try:
        return _pread_all(fd, 4096, record_bytes=record_bytes)
    except OSError:
        return None


def _hot_stat(pid: int) -> _Stat | None:
    """Stat of ``pid`` through the descriptor cache; call with ``_fd_lock`` held."""
    handles = _handles.get(pid)
    if handles is not None:
        data = _reread(handles.stat_fd)
        if data:
            handles.used = _generation
            return _parse_stat(data)
        _drop(pid)  # that process is gone; the PID may name a new one now
    try:
        fd = os.open(f"{_PROC}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except _GONE:
        return None
    stat = _parse_stat(_reread(fd) or b"")
    if stat is not None and _reserve():
        _handles[pid] = _Handles(fd, _generation)
    else:
        os.close(fd)
    return stat


def _read_children(fd: int) -> list[int] | None:
    data = _reread(fd, _CHILD_RECORD_BYTES)
    return None if data is None else [int(child) for child in data.split()]


def _hot_children(pid: int, num_threads: int, *, relist: bool = False) -> list[int]:
    """Children of every thread of ``pid``; ``relist``: the task list afresh, whatever changed."""
    global _cached_fd_count
    handles = _handles.get(pid)
    task_fds = handles.task_fds if handles is not None else {}
    if num_threads == 1:
        # A single-threaded process's one task is its leader: no listdir.
        fd = task_fds.get(str(pid))
        if fd is not None and len(task_fds) == 1:
            return _read_children(fd) or []
        tids = [str(pid)]
    elif (
        handles is not None
        and not relist
        and len(task_fds) == num_threads
        and _generation - handles.listed < _RELIST_EVERY
    ):
        tids = list(task_fds)  # same thread count, listed lately
    else:
        try:
            tids = os.listdir(f"{_PROC}/{pid}/task")
        except _GONE:
            return []
        if handles is not None:
            handles.listed = _generation
    live = set(tids)
    for tid in [tid for tid in task_fds if tid not in live]:
        _close_quietly(task_fds.pop(tid))
        _cached_fd_count -= 1
    children: list[int] = []
    parent_tids = [str(pid)]
    for tid in tids:
        fd = task_fds.get(tid)
        keep = fd is not None
        if fd is None:
            try:
                fd = os.open(f"{_PROC}/{pid}/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
            except _GONE:
                continue  # the thread exited
            # Under a tight budget other threads' files go uncached (quick walks do not read
            # them), so that the budget covers each process's stat and main thread first.
            keep = (
                handles is not None
                and (tid == str(pid) or _cached_fd_limit() >= _MAX_CACHED_FDS)
                and _reserve()
            )
            if keep:
                task_fds[tid] = fd
        found = _read_children(fd)
        if not keep:
            os.close(fd)
        if found:
            children.extend(found)
            if keep and tid != str(pid):
                parent_tids.append(tid)
    if handles is not None:
        handles.parent_tids = tuple(parent_tids)
    return children


# NOTE [quick walk]: the tracker's periodic ticks pass ``quick=True``. A cached process still
# listed under the same parent as at its last full read is then served from that read, and
# only the children files of its main thread and of the threads that had children then are
# read again. Each process is read in full every ``_RECHECK_EVERY`` walks, spread by PID. So
# for at most that many walks a quick walk can miss a zombie still listed, the children of
# threads that had none (the tracker checks a missing known process by identity), and a PID
# reused under the same parent. Epoch ends, ``close()`` and snapshots never walk quickly.


def _quick_children(pid: int) -> list[int] | None:
    """Children from the cached files of a process's ``parent_tids``; None: read it in full."""
    handles = _handles.get(pid)
    if handles is None or not handles.parent_tids or (_generation + pid) % _RECHECK_EVERY == 0:
        return None
    children: list[int] = []
    for tid in handles.parent_tids:
        fd = handles.task_fds.get(tid)  # None past the budget
        found = None if fd is None else _read_children(fd)
        if found is None:
            return None
        children.extend(found)
    handles.used = _generation
    return children


def _quick_read(pid: int, parent: int, with_cmdline: bool) -> tuple[ProcInfo, list[int]] | None:
    """A known process and its children, without a stat read; None: read it in full."""
    handles = _handles.get(pid)
    last = None if handles is None else handles.last_read
    if last is None or last[1] != with_cmdline or last[0].ppid != parent:
        return None
    children = _quick_children(pid)
    return None if children is None else (last[0], children)


def _forget_handles_after_fork() -> None:
    # A forked child got copies of the cached descriptors, and maybe a lock another thread
    # held at fork time: drop both.
    global _fd_lock, _cached_fd_count
    _fd_lock = threading.Lock()
    for pid in list(_handles):
        _drop(pid)
    _cached_fd_count = 0


os.register_at_fork(after_in_child=_forget_handles_after_fork)


@functools.cache
def boot_time_s() -> float:
    """Boot time in Unix seconds, for people (NOTE [process identity]); 0.0 if unreadable."""
    btime = _fields_of(_read(f"{_PROC}/stat", 65536, whole=True) or b"", b"btime")
    return float(btime[0]) if btime else 0.0


def create_time_s(start_ticks: int, boot_unix_s: float | None = None) -> float:
    """A start in ticks as a Unix time, for people: never compare it (NOTE [process identity])."""
    boot = boot_time_s() if boot_unix_s is None else boot_unix_s
    return start_ticks / clock_ticks() + boot


def since_boot_s() -> float:
    """Seconds since boot on the clock of /proc's start times (``CLOCK_BOOTTIME``)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@functools.cache
def clock_ticks() -> int:
    """Clock ticks per second (``SC_CLK_TCK``), the unit of /proc start times."""
    return os.sysconf("SC_CLK_TCK")


def process_key(pid: int) -> ProcessKey | None:
    """The identity of a process, zombies included (NOTE [process identity]); None if gone."""
    stat = _stat(pid)
    return None if stat is None else ProcessKey(pid, stat.starttime_ticks)


def read_proc(
    pid: int,
    *,
    session_id: str | None = None,
    with_cmdline: bool = True,
    tag_variable: str = SESSION_ENV,
) -> ProcInfo | None:
    """Read one process: identity, parent, name and command line; None if gone or unreadable.

    ``tagged``: its initial environment has ``<tag_variable>=<session_id>`` (NOTE [session tag]).
    """
    stat = _stat(pid)
    if stat is None:
        return None
    tag = None if session_id is None else session_id.encode()
    return _info(pid, stat, tag, with_cmdline, tag_variable.encode() + b"=")


def descendants(root_pid: int, *, with_cmdline: bool = True, quick: bool = False) -> list[ProcInfo]:
    """Every live process below ``root_pid`` (not the root), parents before their children.

    Walks the children files (NOTE [children files]); a listed child whose stat names another
    parent (PID reused, reparented) is skipped, and so are zombies. ``quick``: NOTE [quick walk].
    """
    global _children_supported, _generation
    if _children_supported is None:
        _children_supported = os.path.exists(f"{_PROC}/self/task/{os.getpid()}/children")
    if not _children_supported:
        below = tree_below(root_pid, scan_all(with_cmdline=False))
        if with_cmdline:
            return [info._replace(cmdline=_cmdline(info.key.pid)) for info in below]
        return below
    found: list[ProcInfo] = []
    with _fd_lock:
        _generation += 1
        root = _hot_stat(root_pid)
        if root is None:
            return found
        seen = {root_pid}
        root_children = _quick_children(root_pid) if quick else None
        if root_children is None:
            root_children = _hot_children(root_pid, root.num_threads, relist=True)
        stack = [(root_pid, child) for child in reversed(root_children)]
        while stack:
            parent, pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            known = _quick_read(pid, parent, with_cmdline) if quick else None
            if known is not None:
                info, children = known
            else:
                stat = _hot_stat(pid)
                if stat is None or stat.ppid != parent or stat.state in _DEAD_STATES:
                    continue
                info = _info(pid, stat, None, with_cmdline)
                if pid in _handles:
                    _handles[pid].last_read = (info, with_cmdline)
                children = _hot_children(pid, stat.num_threads)
            found.append(info)
            stack.extend((pid, child) for child in reversed(children))
        _evict(_generation - 1)  # not used by this walk nor the previous one
    return found


def tree_below(root_pid: int, processes: Iterable[ProcInfo]) -> list[ProcInfo]:
    """The processes below ``root_pid`` among ``processes`` (one scan), parents first."""
    children: dict[int, list[ProcInfo]] = {}
    for info in processes:
        children.setdefault(info.ppid, []).append(info)
    found: list[ProcInfo] = []
    seen = {root_pid}
    stack = list(reversed(children.get(root_pid, [])))
    while stack:
        info = stack.pop()
        if info.key.pid not in seen:
            seen.add(info.key.pid)
            found.append(info)
            stack.extend(reversed(children.get(info.key.pid, [])))
    return found


def is_alive(key: ProcessKey) -> bool:
    """Whether this very process still runs: same PID and start ticks, and no zombie."""
    with _fd_lock:
        stat = _hot_stat(key.pid)
    if stat is None or stat.state in _DEAD_STATES:
        return False
    return stat.starttime_ticks == key.start_ticks


def scan_all(
    *, session_id: str | None = None, with_cmdline: bool = True, kernel_threads: bool = True
) -> list[ProcInfo]:
    """Every live process of this PID namespace, in PID order, from one pass over /proc."""
    tag = None if session_id is None else session_id.encode()
    found: list[ProcInfo] = []
    for pid in sorted(int(name) for name in os.listdir(_PROC) if name.isdigit()):
        stat = _stat(pid)
        if (
            stat is not None
            and stat.state not in _DEAD_STATES
            and (kernel_threads or not stat.kernel)
        ):
            found.append(_info(pid, stat, tag, with_cmdline))
    return found


# NOTE [incremental tag scan]: a tag scan reads the stat of every process in /proc (its cost, whole
# and incremental: benchmarks/results/mechanisms-cpu.md), yet a process judged once stays judged:
# born before the root, the root, known, or untagged (the tag is in the environment it started
# with). So ``TagScan`` remembers the entries it judged, a PID with the inode of its /proc directory
# (a reused PID gets a new one), and reads only the others. "Untagged" stands once a second scan
# finds the same exec image (start, name, argument and environment addresses, which an exec moves):
# a process between its fork and its exec shows its parent's environment, one inside its exec none
# yet.


class TagScan:
    """Repeated scans for the live processes of one session born since (not being) its root.

    ``variable``: NOTE [run tag] in launcher.py.
    """

    def __init__(
        self, session_id: str, *, born_since: ProcessKey, variable: str = SESSION_ENV
    ) -> None:
        self._tag = session_id.encode()
        self._prefix = variable.encode() + b"="
        self._born_since = born_since
        self._judged: set[tuple[int, int]] = set()
        self._untagged: dict[tuple[int, int], object] = {}  # found untagged once: its image

    def scan(self, known: Collection[ProcessKey] = ()) -> list[ProcInfo]:
        """Tagged processes not judged by an earlier scan nor ``known``, with command lines."""
        with os.scandir(_PROC) as listing:
            entries = sorted(
                (int(entry.name), entry.inode()) for entry in listing if entry.name.isdigit()
            )
        judged = self._judged.intersection(entries)
        untagged: dict[tuple[int, int], object] = {}
        found: list[ProcInfo] = []
        for entry in entries:
            if entry in judged:
                continue
            pid = entry[0]
            stat = _stat(pid)
            if stat is None:
                continue  # gone, or unreadable now: read again while listed
            judged.add(entry)
            key = ProcessKey(pid, stat.starttime_ticks)
            if (
                stat.state in _DEAD_STATES
                or key.start_ticks < self._born_since.start_ticks
                or key == self._born_since
                or key in known
            ):
                continue
            if stat.image is not None and self._untagged.get(entry) == stat.image:
                continue  # untagged twice in one image: for good
            if _environ_tag(pid, self._prefix) == self._tag:
                found.append(_info(pid, stat, None, True)._replace(tagged=True))
            elif self._untagged.get(entry, False) != stat.image:
                judged.discard(entry)  # maybe before or inside its exec: read once more
                untagged[entry] = stat.image
        self._judged = judged
        self._untagged = untagged
        return found


def environ_variables(pid: int, names: Collection[str]) -> dict[str, str] | None:
    """The variables ``names`` set in a process's initial environment; None: unreadable."""
    data = _image_of(pid, "environ")
    if data is None:
        return None
    wanted = {name.encode() for name in names}
    pairs = (entry.partition(b"=") for entry in data.split(b"\0"))
    return {
        key.decode(): value.decode("utf-8", "replace")
        for key, sep, value in pairs
        if sep and key in wanted
    }


def tagged_session(pid: int) -> str | None:
    """The ``LEAKCHECK_SESSION`` value in a process's initial environment; None if absent."""
    value = _environ_tag(pid)
    return None if value is None else value.decode("utf-8", "replace")


def new_session_id(root_pid: int | None = None) -> str:
    """A session tag, ``<pid>-<start ticks>-<random>``: an orphan can tell its root is gone."""
    pid = root_pid if root_pid is not None else os.getpid()
    key = process_key(pid)
    return f"{pid}-{key.start_ticks if key else 0}-{os.urandom(4).hex()}"


def session_root_pid(session_id: str) -> ProcessKey | None:
    """The root identity a session tag names (``new_session_id``); None if malformed."""
    parts = session_id.split("-")
    try:
        return ProcessKey(int(parts[0]), int(parts[1])) if len(parts) >= 3 else None
    except ValueError:
        return None


def is_ancestor(
    ancestor_pid: int, pid: int, *, max_depth: int = 64, born_since_ticks: int | None = None
) -> bool:
    """Whether ``ancestor_pid`` (born at ``born_since_ticks``) is on ``pid``'s parent chain now."""
    current = pid
    for _ in range(max_depth):
        stat = _stat(current)
        if stat is None:
            return False
        if born_since_ticks is not None and stat.starttime_ticks < born_since_ticks:
            return False
        if stat.ppid == ancestor_pid:
            return True
        if stat.ppid <= 0 or stat.ppid == current:
            return False  # above PID 1, or a parent outside this namespace
        current = stat.ppid
    return False


@functools.cache
def pid_namespace_nested() -> bool:
    """Whether this process runs in a child PID namespace, where NVML's host PIDs are not ours."""
    nspid = _fields_of(_read(f"{_PROC}/self/status", 65536, whole=True) or b"", b"NSpid:")
    return nspid is not None and len(nspid) > 1


def pid_exists_here(pid: int) -> bool:
    """Whether a process (not merely a thread) with this PID exists in this namespace."""
    if pid <= 0:
        return False
    # /proc/TID exists for threads too (hidden from listdir): a process is its own group.
    data = _read(f"{_PROC}/{pid}/status", 1024)
    tgid = _fields_of(data, b"Tgid:") if data else []
    return tgid is None or tgid[:1] == [b"%d" % pid]


def root_key(pid: int, source: str) -> ProcessKey:
    """The identity of process ``pid``, to root a tree at.

    Raises:
        UsageError: No process has that PID here, or it is a thread's (said as ``source``'s).

    """
    key = process_key(pid)
    if key is None:
        raise UsageError(f"{source}: no running process with PID {pid} here")
    if not pid_exists_here(pid):  # /proc/TID is there too: its tree would be empty
        raise UsageError(f"{source}: expected a process ID, got {pid}, a thread's")
    return key


def ignores_signal(pid: int, signal_number: int) -> bool:
    """Whether process ``pid`` ignores ``signal_number`` (its ``SigIgn`` mask); False if gone."""
    mask = _fields_of(_read(f"{_PROC}/{pid}/status", 4096) or b"", b"SigIgn:")
    return bool(mask and int(mask[0], 16) >> (signal_number - 1) & 1)


def is_nvidia_device_target(target: str) -> bool:
    """Whether a descriptor's link target (``readlink`` of /proc/PID/fd/N) is an NVIDIA node."""
    return target.startswith(_NVIDIA_PREFIX)


def _fd_targets(pid: int) -> dict[int, str] | None:
    """Descriptor number -> link target; None if the table is unreadable."""
    # Links read relative to the open directory: no path walk through procfs per link.
    try:
        dir_fd = os.open(f"{_PROC}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except _GONE:
        return None
    targets: dict[int, str] = {}
    try:
        for name in os.listdir(dir_fd):
            with contextlib.suppress(*_GONE):  # closed between listdir and readlink
                targets[int(name)] = os.readlink(name, dir_fd=dir_fd)
    except _GONE:
        return None
    finally:
        os.close(dir_fd)
    return targets


class Descriptors(NamedTuple):
    """A process's ``/dev/nvidia*`` descriptors, how many it has open, its soft limit."""

    nvidia: dict[int, str]
    open_count: int
    limit: int | None = None


def descriptors(pid: int, *, limit: bool = True) -> Descriptors | None:
    """One listing of ``/proc/PID/fd`` (and, with ``limit``, its limits); None: unreadable."""
    targets = _fd_targets(pid)
    if targets is None:
        return None
    count = len(targets)
    nvidia = {fd: target for fd, target in targets.items() if is_nvidia_device_target(target)}
    limits = _read(f"{_PROC}/{pid}/limits") if limit else None
    soft = _fields_of(limits or b"", b"Max open files")
    return Descriptors(nvidia, count, int(soft[0]) if soft and soft[0].isdigit() else None)


def nvidia_fds(pid: int) -> dict[int, str] | None:
    """Number -> target of each ``/dev/nvidia*`` descriptor of a process; None: unreadable."""
    found = descriptors(pid, limit=False)
    return None if found is None else found.nvidia


def nvidia_fd_count(pid: int) -> int | None:
    """How many ``/dev/nvidia*`` descriptors a process holds; None when unreadable."""
    found = nvidia_fds(pid)
    return None if found is None else len(found)


def shm_segments(directory: str = "/dev/shm") -> dict[str, ShmSegment]:
    """Name -> segment of each regular file in a shared-memory directory (empty if missing)."""
    segments: dict[str, ShmSegment] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return segments
    for entry in entries:
        with contextlib.suppress(OSError):  # removed during the scan
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                segments[entry.name] = ShmSegment(
                    st.st_size, st.st_mtime, st.st_ino, entry.name, st.st_blocks * 512, st.st_uid
                )
    return segments


def shm_open_by(pids: Iterable[int], directory: str = "/dev/shm") -> dict[int, list[str]]:
    """PID -> sorted names of the shared-memory files it holds open or mapped (none: left out).

    A file removed but still held keeps the `` (deleted)`` /proc shows after its name.
    """
    held: dict[int, list[str]] = {}
    prefix = directory.rstrip("/") + "/"
    needle = prefix.encode()
    for pid in pids:
        paths = list((_fd_targets(pid) or {}).values())
        maps = _read(f"{_PROC}/{pid}/maps", 65536, whole=True, record_bytes=_ANY_RECORD) or b""
        if needle in maps:
            for line in maps.splitlines():
                # address perms offset dev inode pathname (the path may contain spaces)
                fields = line.split(maxsplit=5)
                if needle in line and len(fields) == 6:
                    paths.append(fields[5].decode("utf-8", "replace"))
        names = {path[len(prefix) :] for path in paths if path.startswith(prefix)}
        names.discard("")  # a path naming no file in it
        if names:
            held[pid] = sorted(names)
    return held


# NOTE [cheap snapshots]: PIDs are handed out in increasing order, so the last PID handed out
# (one read of /proc/loadavg) marks a moment: when it did not move no process started, and
# when it moved one listdir('/proc') gives the PIDs in between, the only candidates. Where
# /proc/loadavg cannot be read, two listings are compared (the costs of both ways:
# benchmarks/results/mechanisms-cpu.md).
#
# NOTE [whose process]: a new process is a process's own when that process is its ancestor
# now, when its initial environment carries one of its ``LEAKCHECK_SESSION`` tags (inherited
# through exec, even reparented away), or when it has that process's initial environment and
# command line byte for byte (a fork whose parent exited: never exec'd, so untagged).


def last_pid() -> int | None:
    """The PID most recently handed out in this PID namespace (last field of /proc/loadavg)."""
    data = _read(f"{_PROC}/loadavg", 256)
    try:
        return int(data.split()[-1]) if data else None
    except (ValueError, IndexError):
        return None


def _proc_names() -> frozenset[str]:
    try:
        return frozenset(os.listdir(_PROC))
    except OSError:
        return frozenset()


class PidMark(NamedTuple):
    """Where PID allocation stood at one moment (NOTE [cheap snapshots]).

    ``names``: /proc's entries then, compared where ``last_pid`` is unknown (None).
    """

    last_pid: int | None
    names: frozenset[str]
    unix_s: float
    boot_s: float

    @classmethod
    def now(cls) -> PidMark:
        """The mark of this moment."""
        last = last_pid()
        return cls(
            last, _proc_names() if last is None else frozenset(), time.time(), since_boot_s()
        )

    def pids_since(self) -> list[int]:
        """PIDs that may have started since the mark (callers compare ticks), parents first."""
        now = last_pid()
        if self.last_pid is None or now is None:
            return sorted(int(name) for name in _proc_names() - self.names if name.isdigit())
        start = self.last_pid
        if now == start:
            return []
        found = [
            int(name)
            for name in _proc_names()
            if name.isdigit() and handed_out_since(self, int(name), now)
        ]
        return sorted(found, key=lambda pid: (pid <= start, pid))


def handed_out_since(mark: PidMark, pid: int, now: int | None) -> bool | None:
    """Whether ``pid`` came after ``mark`` up to ``now`` (wrapped: may have); None: unknown."""
    start = mark.last_pid
    if start is None or now is None:
        return None
    if now == start:
        return False
    return (start < pid <= now) if now > start else (pid > start or pid <= now)


# NOTE [fork ledger]: a gone child cannot be read in /proc, yet a file named after it (a
# DataLoader worker's ``torch_<pid>_...``) is still its maker's. Each process forked from Python
# below the one that opened the ledger writes its PID into a pipe that one drains: its
# descendants, gone ones too. Those started by exec (subprocess, the spawn start method) are
# not in it; a full pipe drops PIDs, never blocks; a descriptor number reused is not written.
class ForkLedger:
    """The PIDs forked below this process since the last ``drain`` (NOTE [fork ledger])."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._inode = os.fstat(self._write).st_ino
        os.register_at_fork(after_in_child=self._note)

    def _note(self) -> None:
        with contextlib.suppress(OSError):
            if os.fstat(self._write).st_ino == self._inode:
                os.write(self._write, os.getpid().to_bytes(4, "little"))

    def drain(self) -> set[int]:
        """The PIDs written since the last drain."""
        data = b""
        with contextlib.suppress(OSError):  # BlockingIOError: nothing more
            while chunk := os.read(self._read, 65536):
                data += chunk
        return {int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data) - 3, 4)}


_ledger: ForkLedger | None = None


def fork_ledger() -> ForkLedger:
    """The ``ForkLedger`` of this process, opened at the first call (a forked child: its own)."""
    global _ledger
    if _ledger is None or _ledger.owner != os.getpid():
        _ledger = ForkLedger()
    return _ledger


class Lineage:
    """Which new processes are one process's (``pid``) own (NOTE [whose process])."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        info = read_proc(pid)
        self.key = info.key if info is not None else ProcessKey(pid, 0)
        self.cmdline = info.cmdline if info is not None else ""
        self._image: tuple[bytes | None, bytes | None] | None = None

    def ours(self, pids: Iterable[int], tags: Collection[str], *, since: PidMark) -> list[ProcInfo]:
        """The processes among ``pids`` that are its own, born since ``since``."""
        # An older PID can fall in the new range after PID numbers wrapped around; start
        # ticks are truncated (the mark's too): one tick of slack keeps a twin.
        born_since = int(since.boot_s * clock_ticks()) - 1
        found: list[ProcInfo] = []
        for pid in pids:
            info = read_proc(pid)
            if info is None or info.key.start_ticks < born_since:
                continue
            if self.descends(info):
                found.append(info)
                continue
            tag = tagged_session(pid)
            if tag is not None and tag in tags:
                found.append(info._replace(tagged=True))
            elif tag is None and self._forked_here(info):
                found.append(info)
        return found

    def descends(self, info: ProcInfo) -> bool:
        """Whether the process is an ancestor of ``info`` now."""
        # Stops at the first ancestor older than it: a stranger's process (another job's, a
        # sibling xdist worker's) costs a read or two, not a walk to PID 1.
        return info.ppid == self.pid or is_ancestor(
            self.pid, info.ppid, born_since_ticks=self.key.start_ticks or None
        )

    def _looks_alike(self, pid: int) -> bool:
        """The same command line and initial environment as the process, byte for byte."""
        if self._image is None:
            self._image = (_image_of(self.pid, "environ"), _image_of(self.pid, "cmdline"))
        environ, cmdline = self._image
        return bool(environ and cmdline) and (
            _image_of(pid, "cmdline") == cmdline and _image_of(pid, "environ") == environ
        )

    def _forked_here(self, info: ProcInfo) -> bool:
        # A reparented fork has PID 1, a subreaper or us for parent; one whose live parent
        # looks alike too is a twin's (xdist workers start alike).
        parent = info.ppid
        return self._looks_alike(info.key.pid) and (
            parent <= 1 or parent == self.pid or not self._looks_alike(parent)
        )
