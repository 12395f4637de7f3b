"""Process facts from /proc: identities, lineage, session tags, descriptors, /dev/shm.

Linux is the fast path: every function reads a few small /proc files in binary with plain
``os.open``/``os.read`` and parses the minimum it needs; the tracker's per-sample calls
(``descendants``, ``is_alive``) also reuse open descriptors and per-exec facts (NOTE
[descriptor cache], NOTE [exec image cache]). Identities come from /proc alone (NOTE
[process identity]): without it no process has one, and the Linux-only facts (session tags,
namespaces, mapped files) are unknown.

A process that exits, is reaped, or denies access while it is being read is a normal event
here, not an error: single-process functions return None (or False, or an empty list) and
scans skip it. Nothing in this module raises for a vanished process.

NOTE [session tag]: the tracker exports ``LEAKCHECK_SESSION=<id>`` so that every process
of the job can be recognised even after it was reparented away (to PID 1 or a subreaper).
``/proc/PID/environ`` shows a process's *initial* environment, the block it got at its
last ``exec``; a variable set later with ``os.environ`` lives only in that process's heap.
So a variable the tracker sets after its own start is visible in children that exec
(``subprocess``, multiprocessing ``spawn``/``forkserver``), but *not* in children that were
only forked (multiprocessing ``fork``): their environ is a copy of the parent's initial
block. The tracker therefore records forked children by lineage (``descendants``) while
their parent lives, and the tag is a second, independent way to find exec'd ones.

NOTE [process identity]: a process is ``ProcessKey(pid, start_ticks)``, its PID and when it
started in clock ticks since boot (field 22 of /proc/PID/stat), compared as integers wherever
two identities meet, within a process and across processes. Not its Unix create time,
``start_ticks / CLK_TCK + btime``: the kernel derives /proc/stat's ``btime`` from the wall
clock, so it moves when the clock is stepped or slews across a second, and two processes
that read it at different times (a spawn worker reads it afresh, a fork worker inherits its
parent's) compute create times a second apart for one process; the tracker then took a
worker's own record for a process that never ran, and the worker for a survivor (psutil
dropped create times as identities for this reason, psutil#2526). Create times are shown to
people only, derived where shown (``create_time_s``; a report from the boot time its tracker
read, ``Timeline.boot_unix_s``), and never read back. A birth against the clock needs no boot
time either: ``start_ticks / clock_ticks()`` is seconds since boot on ``CLOCK_BOOTTIME``
(``since_boot_s``), truncated to a tick. The comparisons across processes, all of start ticks:
- worker records (worker/teardown.py posts them, mailbox.py ``record_key`` reads them), and
  the owner a mailbox folder's name gives (``remove_stale``);
- ``leakcheck run``'s loader records (commands/instrument.py), which the launcher checks
  before removing a mailbox (commands/launcher.py ``_remove_mailboxes``);
- session tags, ``<pid>-<start ticks>-<random>`` (``new_session_id``): whether a tagged
  process lost its root (observe/snapshot.py ``_is_orphaned``);
- reports, in JSON and read back (``ProcessKey``, ``Finding.start_ticks``): a job's findings
  counted once across its ranks (judge/job.py ``finding_identity``), and so are ``watch()``'s
  announcements (adapters/watching.py) and an orphan also judged a survivor (judge/verdict.py
  ``judge``);
- the sweep's cleanup checks a leftover's ticks again before signalling it
  (commands/sweep.py ``cleanup_orphans``).
Within a process: ``is_alive``, reads of host memory by key (observe/hostmem.py), the claims
between one process's trackers (track/claims.py). Births against epochs compare seconds since
boot: claims' rule 3 (``_epoch_at``), the epoch a process was born in (track/sampler.py
``_born_epoch``), the pytest plugin's "born since the mark" (adapters/plugin_observe.py); and
tag scans keep processes born since the root by ticks (``TagScan``, snapshot.py).

NOTE [children files]: ``/proc/PID/task/TID/children`` lists the children of one *thread*,
the one that forked them. A child started from a non-main thread (a DataLoader pin-memory
thread, a thread pool) appears only in that thread's file, so every task is read. When the
kernel lacks the file (``CONFIG_PROC_CHILDREN`` off), lineage falls back to one scan of
every ``/proc/PID/stat``. The file is not a snapshot: a child that forks or exits during
the read may be missed for one sample, which the 50 ms sampler tolerates.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Collection, Iterable
from stat import S_ISCHR
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from leakcheck.core.readings import ProcessKey, ProcInfo

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "CMDLINE_MAX_CHARS",
    "SESSION_ENV",
    "ShmSegment",
    "TagScan",
    "boot_time_s",
    "child_pids",
    "clock_ticks",
    "create_time_s",
    "descendants",
    "environ_variables",
    "is_alive",
    "is_ancestor",
    "is_nvidia_device_target",
    "is_zombie",
    "new_session_id",
    "nvidia_fd_count",
    "parse_session_tag",
    "pid_exists_here",
    "pid_namespace_nested",
    "process_key",
    "read_proc",
    "scan_all",
    "session_root_pid",
    "shm_name_from_path",
    "shm_open_by",
    "shm_segments",
    "since_boot_s",
    "tagged_session",
]

SESSION_ENV = "LEAKCHECK_SESSION"
"""Environment variable that carries a tracker's session id to every exec'd child."""

CMDLINE_MAX_CHARS = 32768
"""Command lines are kept whole up to this many characters: a bound on memory only, far above
any real one, since decisions read them whole (a runtime helper's module comes after its
interpreter's path, which can be long); reports name a process through ``names``."""

_PROC = "/proc"
_HAS_PROC = sys.platform.startswith("linux") and os.path.exists(f"{_PROC}/self/stat")

# What a vanished or foreign process looks like while reading its /proc files: the
# directory is gone (ENOENT), it exited between open and read (ESRCH), or it is not ours
# to read (EACCES/EPERM).
_GONE = (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError)

_TAG_PREFIX = SESSION_ENV.encode() + b"="
_PF_KTHREAD = 0x00200000  # the kernel-thread bit of a task's flags (include/linux/sched.h)
_DEAD_STATES = (b"Z", b"X", b"x")  # zombie, dead: exited, whatever the reaping state
_NVIDIA_PREFIX = "/dev/nvidia"

_Image = tuple[int, bytes, bytes, bytes, bytes, bytes]
_ImageKey = tuple[int, _Image]
_K = TypeVar("_K")
_T = TypeVar("_T")

# NOTE [exec image cache]: the command line and the initial environment of a process change only
# when it execs (setproctitle aside, which only rewrites what is shown). Re-reading them on
# every tick would cost more than all the rest of a sample, so they are cached per *exec image*:
# the PID, its start time, its name (comm), and the addresses of its argument and environment
# blocks, which /proc/PID/stat shows (fields 48-51) and which a new exec moves (fresh stack,
# ASLR) or resizes. A forked child that has not exec'd yet shares its parent's addresses but has
# its own PID. Where the kernel hides the addresses (a process we may not ptrace), nothing is
# cached. The whole ``ProcInfo`` is kept too (it is immutable) and served again while the image
# and the parent are unchanged. Bounded: cleared when full.
_CACHE_MAX_ENTRIES = 4096
_cmdline_cache: dict[_ImageKey, str] = {}
_tag_cache: dict[tuple[_ImageKey, bytes], bytes | None] = {}
_info_cache: dict[tuple[int, _Image, bytes | None, bool, bytes], ProcInfo] = {}

# Whether /proc/PID/task/TID/children exists (CONFIG_PROC_CHILDREN); None until probed.
# Module-level so tests can force the full-scan fallback.
_children_supported: bool | None = None


class _Stat(NamedTuple):
    """The few fields of /proc/PID/stat this module uses."""

    name: bytes
    state: bytes
    ppid: int
    num_threads: int
    starttime_ticks: int
    image: _Image | None
    """Identity of the current exec image (see NOTE [exec image cache]); None if hidden."""


class ShmSegment(NamedTuple):
    """One file in a shared-memory directory (``/dev/shm``).

    Attributes:
        size_bytes: Apparent file size in bytes.
        mtime: Last modification, seconds since the Unix epoch.
        inode: Inode number: a segment removed and created again under the same name
            gets a new one.

    """

    size_bytes: int
    mtime: float
    inode: int


# --- low-level reads ----------------------------------------------------------------------


def _read(path: str, size: int = 4096) -> bytes | None:
    """One read of at most ``size`` bytes; None when the file is gone or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except _GONE:
        return None
    try:
        return os.read(fd, size)
    except _GONE:
        return None
    finally:
        os.close(fd)


def _read_all(path: str, chunk: int = 65536, *, record_bytes: int | None = None) -> bytes | None:
    """Read the whole file (``_pread_all`` says what ``record_bytes`` means)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except _GONE:
        return None
    try:
        return _pread_all(fd, chunk, record_bytes=record_bytes)
    except _GONE:
        return None
    finally:
        os.close(fd)


def _parse_stat(data: bytes) -> _Stat | None:
    """Parse /proc/PID/stat.

    The name (comm) sits between the first '(' and the *last* ')': it may itself contain
    spaces and parentheses.
    """
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
    # arg_start, arg_end, env_start, env_end (fields 48-51, Linux 3.5+); all 0 when the
    # reader may not ptrace the process or it has no memory (zombie, kernel thread).
    if len(fields) >= 49 and fields[46] != b"0":
        image = (starttime_ticks, name, fields[45], fields[46], fields[47], fields[48])
    # Positional: this runs for every process of every sample.
    return _Stat(name, fields[0], int(fields[1]), int(fields[17]), starttime_ticks, image)


def _is_kernel_thread(stat_line: bytes) -> bool:
    """Whether a /proc/PID/stat line is a kernel thread's: ``PF_KTHREAD`` in its flags.

    A kernel thread has no descriptor table, environment or command line of its own: it can
    hold no ``/dev/nvidia*`` descriptor and carry no session tag, so a scan of the machine
    need not read those for it (many of a host's processes). The flags (field 9) are
    shown to every reader; the memory-layout fields (startcode, endcode, startstack) are 0 for
    a kernel thread but also for a zombie and for any process the reader may not ptrace, so
    they are no test.
    """
    end = stat_line.rfind(b")")
    fields = stat_line[end + 2 :].split(maxsplit=7) if end >= 0 else []
    return len(fields) > 6 and fields[6].isdigit() and int(fields[6]) & _PF_KTHREAD != 0


def _stat(pid: int) -> _Stat | None:
    data = _read(f"{_PROC}/{pid}/stat")
    return None if not data else _parse_stat(data)


def _shorten(text: str, limit: int = CMDLINE_MAX_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cmdline(pid: int) -> str:
    data = _read(f"{_PROC}/{pid}/cmdline", CMDLINE_MAX_CHARS)
    if not data:
        return ""  # kernel thread, zombie, or gone
    return _shorten(data.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace"))


def _environ_tag(pid: int, prefix: bytes = _TAG_PREFIX) -> bytes | None:
    data = _read_all(f"{_PROC}/{pid}/environ")
    return None if data is None else _tag_bytes(data, prefix)


def _image_tag(pid: int, image: _Image | None, prefix: bytes = _TAG_PREFIX) -> bytes | None:
    """The session tag of one exec image, read once (NOTE [exec image cache]).

    ``prefix`` (``NAME=``) names the variable that carries the tag: ``LEAKCHECK_SESSION``
    unless a tracker was given another (``session_tag``, NOTE [run tag] in launcher.py).
    """
    if image is None:  # cannot tell one exec image from the next: read, do not cache
        return _environ_tag(pid, prefix)
    key = ((pid, image), prefix)
    if key in _tag_cache:
        return _tag_cache[key]
    tag = _environ_tag(pid, prefix)
    _remember(_tag_cache, key, tag)
    return tag


def _tag_bytes(environ: bytes, prefix: bytes = _TAG_PREFIX) -> bytes | None:
    if environ.startswith(prefix):
        start = len(prefix)
    else:
        at = environ.find(b"\0" + prefix)
        if at < 0:
            return None
        start = at + 1 + len(prefix)
    end = environ.find(b"\0", start)
    return environ[start:] if end < 0 else environ[start:end]


def _tag_prefix(variable: str) -> bytes:
    """``NAME=`` of the environment variable that carries a tag."""
    if not variable or "=" in variable or "\0" in variable:
        raise ValueError(f"not an environment variable name: {variable!r}")
    return variable.encode() + b"="


def _info(
    pid: int,
    stat: _Stat,
    session_tag: bytes | None,
    with_cmdline: bool,
    prefix: bytes = _TAG_PREFIX,
) -> ProcInfo:
    cmdline = ""
    tagged = False
    image = stat.image
    if image is None:  # cannot tell one exec image from the next: read, do not cache
        if with_cmdline:
            cmdline = _cmdline(pid)
        if session_tag is not None:
            tagged = _image_tag(pid, None, prefix) == session_tag
    else:
        info_key = (pid, image, session_tag, with_cmdline, prefix)
        info = _info_cache.get(info_key)
        if info is not None and info.ppid == stat.ppid:
            return info
        cache_key = (pid, image)
        if with_cmdline:
            cached_cmdline = _cmdline_cache.get(cache_key)
            if cached_cmdline is None:
                cached_cmdline = _cmdline(pid)
                _remember(_cmdline_cache, cache_key, cached_cmdline)
            cmdline = cached_cmdline
        if session_tag is not None:
            tagged = _image_tag(pid, image, prefix) == session_tag
    info = ProcInfo(
        key=ProcessKey(pid, stat.starttime_ticks),
        ppid=stat.ppid,
        name=stat.name.decode("utf-8", "replace"),
        cmdline=cmdline,
        tagged=tagged,
    )
    if image is not None:
        _remember(_info_cache, info_key, info)
    return info


def _remember(cache: dict[_K, _T], key: _K, value: _T) -> None:
    if len(cache) >= _CACHE_MAX_ENTRIES:
        cache.clear()  # entries of exited processes are never looked up again
    cache[key] = value


def _all_pids() -> list[int]:
    try:
        names = os.listdir(_PROC)
    except OSError:
        return []
    return [int(name) for name in names if name.isdigit()]


def _children_file_supported() -> bool:
    global _children_supported
    if _children_supported is None:
        pid = os.getpid()
        _children_supported = os.path.exists(f"{_PROC}/{pid}/task/{pid}/children")
    return _children_supported


def _children_from_tasks(pid: int, num_threads: int | None = None) -> list[int]:
    """Children of every thread of ``pid`` from the per-task children files."""
    if num_threads == 1:
        # Single-threaded (most workers): its only task is the leader, skip the listdir.
        data = _read_all(
            f"{_PROC}/{pid}/task/{pid}/children", 4096, record_bytes=_CHILD_RECORD_BYTES
        )
        if data is not None:
            return [int(child) for child in data.split()]
    try:
        tids = os.listdir(f"{_PROC}/{pid}/task")
    except _GONE:
        return []
    children: list[int] = []
    for tid in tids:
        data = _read_all(
            f"{_PROC}/{pid}/task/{tid}/children", 4096, record_bytes=_CHILD_RECORD_BYTES
        )
        if data:
            children.extend(int(child) for child in data.split())
    return children


def _stats_by_scan() -> dict[int, _Stat]:
    stats: dict[int, _Stat] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            stats[pid] = stat
    return stats


def _child_pids_by_scan(pid: int) -> list[int]:
    """Direct children of ``pid`` from one scan of every /proc/PID/stat (the slow path)."""
    return sorted(child for child, stat in _stats_by_scan().items() if stat.ppid == pid)


# --- descriptor cache (the per-sample hot path) ---------------------------------------------

# NOTE [descriptor cache]: opening a /proc file (a path walk through procfs) costs several
# times more than reading it, and the tracker reads the same few files of the same processes
# on every walk. ``descendants`` and ``is_alive`` therefore keep /proc/PID/stat and the
# per-task children files open and re-read them with ``pread``. That is safe against PID
# reuse: an open /proc file is bound to the process it was opened for, not to the number;
# once that process is gone and reaped, reading the stat file fails (ESRCH), the cached
# descriptors are closed and the PID is opened afresh, maybe finding a new process. A
# children file of a vanished thread reads as empty, so the task list of a process with
# more than one thread is taken again (listdir) whenever its thread count changes, and at
# least every ``_RELIST_EVERY`` walks: a thread that replaced another between two walks (same
# count) is seen within that many walks (seconds at the tracker's default interval),
# and the epoch-end tag scan finds a tagged child it forked meanwhile. The root's task list
# is taken at each of its full reads: its threads come and go (pin-memory threads, thread
# pools), and a full walk must find a child that a new one started. Bounded: at most 256
# descriptors and an eighth of RLIMIT_NOFILE (data loaders need descriptors too); entries
# not used in the last two ``descendants`` calls are closed; forked children close their
# inherited copies at once (``os.register_at_fork``). Other functions read afresh.

_MAX_CACHED_FDS = 256
_RELIST_EVERY = 16
_RECHECK_EVERY = 4


class _Handles:
    """Open descriptors of one process: its stat file and its tasks' children files."""

    __slots__ = ("listed", "parent_tids", "stat_fd", "task_fds", "used")

    def __init__(self, stat_fd: int, used: int) -> None:
        self.stat_fd = stat_fd
        self.task_fds: dict[str, int] = {}
        self.used = used
        self.listed = -_RELIST_EVERY  # the walk that last took the task list
        # The main thread and the threads whose children files listed children at the
        # last full read: what a quick walk reads of the root (NOTE [quick walk]).
        self.parent_tids: tuple[str, ...] = ()


_fd_lock = threading.Lock()
_handles: dict[int, _Handles] = {}
# Per PID: what its last full read found, the tag and with_cmdline it was read for, and the
# walk that last saw it; served again by a quick walk (NOTE [quick walk]). No descriptor
# is held for it, so it covers processes past the descriptor budget too.
_last_read: dict[int, tuple[ProcInfo, bytes | None, bool, int]] = {}
_cached_fd_count = 0
_generation = 0
_fd_limit: int | None = None


def _cached_fd_limit() -> int:
    global _fd_limit
    if _fd_limit is None:
        import resource  # POSIX only; this path runs only where /proc exists

        try:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (OSError, ValueError):
            soft = resource.RLIM_INFINITY
        limit = _MAX_CACHED_FDS if soft == resource.RLIM_INFINITY else soft // 8
        _fd_limit = max(0, min(_MAX_CACHED_FDS, limit))
    return _fd_limit


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _drop(pid: int) -> None:
    global _cached_fd_count
    handles = _handles.pop(pid, None)
    if handles is None:
        return
    _close_quietly(handles.stat_fd)
    for fd in handles.task_fds.values():
        _close_quietly(fd)
    _cached_fd_count -= 1 + len(handles.task_fds)


def _evict(older_than: int) -> None:
    for pid in [pid for pid, handles in _handles.items() if handles.used < older_than]:
        _drop(pid)


def _reserve(count: int) -> bool:
    """Make room for ``count`` more cached descriptors, if the bound allows."""
    global _cached_fd_count
    limit = _cached_fd_limit()
    if _cached_fd_count + count > limit:
        # Only what neither this walk nor the previous one used: evicting what the previous
        # walk used would close descriptors this walk is about to read, and a job larger
        # than the budget would reopen all of them on every walk. Past the budget, the
        # newest processes are read without caching instead.
        _evict(_generation - 1)
        if _cached_fd_count + count > limit:
            return False
    _cached_fd_count += count
    return True


def _page_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 4096


_PAGE_BYTES = _page_bytes()
_CHILD_RECORD_BYTES = 24
"""The longest record of a ``children`` file: a PID and a space."""
_ANY_RECORD = _PAGE_BYTES
"""For a file whose records can be as long as a page (``maps``: a line ends in a path)."""


def _pread_all(fd: int, chunk: int = 65536, *, record_bytes: int | None = None) -> bytes:
    """The whole file from offset 0 (environ, children, maps can exceed one read).

    Args:
        fd: An open /proc file.
        chunk: Bytes asked for per read.
        record_bytes: None for a file that fills any buffer it is given (environ,
            cmdline, stat): a short read is its end. For a seq_file (children, maps), the
            longest record it writes: such a file returns about a page per read, stopping
            before a record that does not fit, so a read is its end only when shorter than
            a page by more than one record; otherwise it is read until it returns nothing.

    """
    data = os.pread(fd, chunk, 0)
    size = len(data)
    if size < chunk and (record_bytes is None or size <= _PAGE_BYTES - record_bytes):
        return data
    parts = [data]
    offset = size
    while data:
        data = os.pread(fd, chunk, offset)
        offset += len(data)
        parts.append(data)
    return b"".join(parts)


def _hot_stat(pid: int) -> _Stat | None:
    """Stat of ``pid`` through the descriptor cache. Call with ``_fd_lock`` held."""
    handles = _handles.get(pid)
    if handles is not None:
        try:
            data = os.pread(handles.stat_fd, 4096, 0)
        except OSError:
            data = b""
        if data:
            handles.used = _generation
            return _parse_stat(data)
        _drop(pid)  # that process is gone; the PID may belong to a new one now
    try:
        fd = os.open(f"{_PROC}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except _GONE:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        data = b""
    stat = _parse_stat(data) if data else None
    if stat is not None and _reserve(1):
        _handles[pid] = _Handles(fd, _generation)
    else:
        os.close(fd)
    return stat


def _hot_children(pid: int, num_threads: int, *, relist: bool = False) -> list[int]:
    """Children of every thread of ``pid`` through the descriptor cache (after _hot_stat).

    ``relist`` takes the task list afresh whatever the thread count (the root's full reads,
    NOTE [descriptor cache]).
    """
    global _cached_fd_count
    handles = _handles.get(pid)
    if handles is None:
        return _children_from_tasks(pid, num_threads)
    task_fds = handles.task_fds
    if num_threads == 1:
        # The one task of a single-threaded process is its leader: no listdir. Fast path
        # for the common case, a worker whose children file is already open.
        if len(task_fds) == 1:
            fd = task_fds.get(str(pid))
            if fd is not None:
                try:
                    data = _pread_all(fd, record_bytes=_CHILD_RECORD_BYTES)
                except OSError:
                    data = b""
                return [int(child) for child in data.split()] if data else []
        tids = [str(pid)]
    elif (
        not relist and len(task_fds) == num_threads and _generation - handles.listed < _RELIST_EVERY
    ):
        tids = list(task_fds)  # same thread count, listed lately (NOTE [descriptor cache])
    else:
        try:
            tids = os.listdir(f"{_PROC}/{pid}/task")
        except _GONE:
            return []
        handles.listed = _generation
    if len(task_fds) != len(tids) or any(tid not in task_fds for tid in tids):
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
            # Other threads' files are read at full reads only (NOTE [quick walk]): under a
            # tight descriptor budget they go uncached, so that the budget covers each
            # process's stat and main-thread files first.
            keep = (tid == str(pid) or _cached_fd_limit() >= _MAX_CACHED_FDS) and _reserve(1)
            if keep:
                task_fds[tid] = fd
        try:
            data = _pread_all(fd, record_bytes=_CHILD_RECORD_BYTES)
        except OSError:
            data = b""
        if not keep:
            os.close(fd)
        if data:
            children.extend(int(child) for child in data.split())
            if keep and tid != str(pid):
                parent_tids.append(tid)
    handles.parent_tids = tuple(parent_tids)
    return children


def _full_read_due(pid: int) -> bool:
    """Whether a quick walk reads ``pid`` in full this time (NOTE [quick walk]).

    Once every ``_RECHECK_EVERY`` walks, spread by PID so that no walk pays for all at once.
    """
    return (_generation + pid) % _RECHECK_EVERY == 0


def _quick_root_children(pid: int) -> list[int] | None:
    """The root's children, for a quick walk; None: read them in full (NOTE [quick walk])."""
    handles = _handles.get(pid)
    if handles is None or not handles.parent_tids or _full_read_due(pid):
        return None
    children: list[int] = []
    for tid in handles.parent_tids:
        fd = handles.task_fds.get(tid)
        if fd is None:
            return None
        try:
            data = _pread_all(fd, record_bytes=_CHILD_RECORD_BYTES)
        except OSError:
            return None
        children.extend(int(child) for child in data.split())
    return children


# NOTE [quick walk]: the tracker's periodic ticks pass ``quick=True``. A process still
# listed under the same parent as at its last full read is then served from that read, with
# no stat read, and only its main thread's children file is read again (a CUDA process has
# a dozen threads or more, and processes are nearly always started from the main thread).
# The root, read afresh, has its stat read and the children files of its main thread and of
# the threads that had children at its last full read (a training process has dozens of
# threads, a DataLoader starts its workers from one). Once every ``_RECHECK_EVERY`` walks
# (spread by PID, so no walk pays for all at once) each is read in full again: stat, and
# every thread's children file. What a quick walk can miss, for at most that many walks: a
# zombie still listed under its parent (it counts as alive a little longer), the children
# of threads that had none at the last full read (a known one is not walked through, so the
# tracker checks it by its identity and does not take its absence for a reparenting), and
# the reuse of a PID under the same parent (that takes the whole PID space to wrap). The
# tracker's epoch ends, ``close()`` and snapshots never walk quickly.


def _quick_children(
    pid: int, parent: int, tag: bytes | None, with_cmdline: bool
) -> tuple[ProcInfo, list[int]] | None:
    """A known process and its children, without a stat read; None: read it in full."""
    last = _last_read.get(pid)
    if last is None or _full_read_due(pid):
        return None
    info, info_tag, info_with_cmdline, _seen = last
    if info.ppid != parent or info_tag != tag or info_with_cmdline != with_cmdline:
        return None
    handles = _handles.get(pid)
    fd = handles.task_fds.get(str(pid)) if handles is not None else None
    try:
        if fd is not None:
            data = _pread_all(fd, record_bytes=_CHILD_RECORD_BYTES)
        else:  # past the descriptor budget: read the one file afresh
            data = (
                _read_all(
                    f"{_PROC}/{pid}/task/{pid}/children", 4096, record_bytes=_CHILD_RECORD_BYTES
                )
                or b""
            )
    except OSError:
        return None
    if handles is not None:
        handles.used = _generation
    _last_read[pid] = (info, tag, with_cmdline, _generation)
    return info, [int(child) for child in data.split()] if data else []


def _forget_handles_after_fork() -> None:
    # The child got copies of the parent's descriptors (fork does not close them) and a
    # lock that another thread may have held at fork time: drop both.
    global _fd_lock, _cached_fd_count
    _fd_lock = threading.Lock()
    for handles in _handles.values():
        _close_quietly(handles.stat_fd)
        for fd in handles.task_fds.values():
            _close_quietly(fd)
    _handles.clear()
    _last_read.clear()
    _cached_fd_count = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_handles_after_fork)


@functools.cache
def _psutil() -> ModuleType:
    # Only the non-Linux fallbacks need it, and importing it is slow: not at module import.
    import psutil

    return psutil


# --- public API ---------------------------------------------------------------------------


@functools.cache
def boot_time_s() -> float:
    """System boot time in seconds since the Unix epoch: ``btime`` of /proc/stat.

    Only to show start ticks as Unix times (``create_time_s``), never for identity: the
    kernel derives it from the wall clock, so it moves when the clock does (NOTE [process
    identity]). Cached, so that one process shows one process's start alike every time.

    Returns:
        The boot time; 0.0 where /proc/stat cannot be read.

    """
    data = _read_all(f"{_PROC}/stat") if _HAS_PROC else None
    for line in (data or b"").splitlines():
        if line.startswith(b"btime"):
            return float(line.split()[1])
    return 0.0


def create_time_s(start_ticks: int, boot_unix_s: float | None = None) -> float:
    """A start time as a Unix time, for people (NOTE [process identity]): never compare it.

    Args:
        start_ticks: The process's start in clock ticks since boot (``ProcessKey``).
        boot_unix_s: The boot time to add (default: this process's ``boot_time_s()``).

    """
    boot = boot_time_s() if boot_unix_s is None else boot_unix_s
    return start_ticks / clock_ticks() + boot


def since_boot_s() -> float:
    """Seconds since boot on the clock of /proc's start times (``CLOCK_BOOTTIME``).

    A process's birth on this clock is ``start_ticks / clock_ticks()``, truncated to a tick:
    no boot time in it (NOTE [process identity]).
    """
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux: the Unix clock against the boot time
        return time.time() - boot_time_s()


@functools.cache
def clock_ticks() -> int:
    """Clock ticks per second (``SC_CLK_TCK``), the unit of /proc start times. Cached."""
    return os.sysconf("SC_CLK_TCK")


def process_key(pid: int) -> ProcessKey | None:
    """Return the identity ``(pid, start_ticks)`` of a process (NOTE [process identity]).

    Zombies still have a key.

    Args:
        pid: Process ID in this PID namespace.

    Returns:
        The key, or None when no such process exists (or it cannot be read, or there is
        no /proc).

    """
    stat = _stat(pid) if _HAS_PROC else None
    return None if stat is None else ProcessKey(pid, stat.starttime_ticks)


def read_proc(
    pid: int,
    *,
    session_id: str | None = None,
    with_cmdline: bool = True,
    tag_variable: str = SESSION_ENV,
) -> ProcInfo | None:
    """Read one process: identity, parent, name and (shortened) command line.

    Args:
        pid: Process ID.
        session_id: When given, ``tagged`` tells whether the process's initial environment
            carries ``LEAKCHECK_SESSION=<session_id>`` (see NOTE [session tag]); an
            environment we may not read counts as untagged.
        with_cmdline: Read the command line (joined by spaces, whole up to
            ``CMDLINE_MAX_CHARS``); False leaves it empty and saves one read.
        tag_variable: The variable that carries the tag (default ``LEAKCHECK_SESSION``).

    Returns:
        The process, zombies included; None when it does not exist or cannot be read (or
        there is no /proc).

    """
    stat = _stat(pid) if _HAS_PROC else None
    if stat is None:
        return None
    tag = None if session_id is None else session_id.encode()
    return _info(pid, stat, tag, with_cmdline, _tag_prefix(tag_variable))


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, started from any of its threads.

    Args:
        pid: Parent process ID.

    Returns:
        Child PIDs (empty when the process is gone). Uses the per-thread children files,
        or one full /proc scan where the kernel lacks them (NOTE [children files]).

    """
    if not _HAS_PROC:
        ps = _psutil()
        try:
            return [child.pid for child in ps.Process(pid).children()]
        except ps.Error:
            return []
    if not _children_file_supported():
        return _child_pids_by_scan(pid)
    return _children_from_tasks(pid)


def descendants(
    root_pid: int,
    *,
    session_id: str | None = None,
    with_cmdline: bool = True,
    quick: bool = False,
) -> list[ProcInfo]:
    """Every live process below ``root_pid``, parents before their children.

    Walks the children files from the root down, reading each process once; this is the
    tracker's per-sample path and does not scan all of /proc. A PID listed as a child whose
    stat names another parent (it exited and the PID was reused, or it was reparented during
    the walk) is skipped. Zombies are left out (they hold nothing and ``is_alive`` is False
    for them), and so is the root.

    Args:
        root_pid: Root of the tree (not included in the result).
        session_id: Also check each process's session tag (see ``read_proc``).
        with_cmdline: Read command lines (see ``read_proc``).
        quick: Re-read each known process's stat and its other threads' children only
            every few walks (NOTE [quick walk]): the tracker's periodic ticks.

    Returns:
        One ``ProcInfo`` per live descendant (none without /proc).

    """
    if not _HAS_PROC:
        return []
    tag = None if session_id is None else session_id.encode()
    if not _children_file_supported():
        return _descendants_by_scan(root_pid, tag, with_cmdline)
    global _generation
    found: list[ProcInfo] = []
    with _fd_lock:
        _generation += 1
        root = _hot_stat(root_pid)
        if root is None:
            return found
        seen = {root_pid}
        root_children = _quick_root_children(root_pid) if quick else None
        if root_children is None:
            root_children = _hot_children(root_pid, root.num_threads, relist=True)
        stack = [(root_pid, child) for child in reversed(root_children)]
        while stack:
            parent, pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            if quick:
                children_of_known = _quick_children(pid, parent, tag, with_cmdline)
                if children_of_known is not None:
                    info, children = children_of_known
                    found.append(info)
                    stack.extend((pid, child) for child in reversed(children))
                    continue
            stat = _hot_stat(pid)
            if stat is None or stat.ppid != parent or stat.state in _DEAD_STATES:
                continue
            info = _info(pid, stat, tag, with_cmdline)
            found.append(info)
            _last_read[pid] = (info, tag, with_cmdline, _generation)
            children = _hot_children(pid, stat.num_threads)
            stack.extend((pid, child) for child in reversed(children))
        _evict(_generation - 1)  # not used by this walk nor since the previous one
        for pid in [pid for pid, last in _last_read.items() if last[3] < _generation - 1]:
            del _last_read[pid]
    return found


def _descendants_by_scan(root_pid: int, tag: bytes | None, with_cmdline: bool) -> list[ProcInfo]:
    """``descendants`` from one scan of every /proc/PID/stat (no children files)."""
    stats = _stats_by_scan()
    tree: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        tree.setdefault(stat.ppid, []).append(pid)
    found: list[ProcInfo] = []
    seen = {root_pid}
    stack = list(reversed(tree.get(root_pid, [])))
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stat = stats[pid]
        if stat.state in _DEAD_STATES:
            continue
        found.append(_info(pid, stat, tag, with_cmdline))
        stack.extend(reversed(tree.get(pid, [])))
    return found


def is_alive(key: ProcessKey) -> bool:
    """Whether this very process still runs: same PID *and* same start ticks.

    Args:
        key: Identity recorded earlier.

    Returns:
        False when the PID is gone, is a zombie, or now belongs to another process.

    """
    if not _HAS_PROC:
        return False
    with _fd_lock:
        stat = _hot_stat(key.pid)
    if stat is None or stat.state in _DEAD_STATES:
        return False
    return stat.starttime_ticks == key.start_ticks


def scan_all(
    *, session_id: str | None = None, with_cmdline: bool = True, kernel_threads: bool = True
) -> list[ProcInfo]:
    """Every live process of this PID namespace, in one pass over /proc.

    Used at epoch ends and by ``leakcheck snapshot`` to find tagged processes that were
    reparented out of the lineage. Zombies and processes that vanish mid-scan are skipped.

    Args:
        session_id: Check each process's session tag (see ``read_proc``).
        with_cmdline: Read command lines (see ``read_proc``).
        kernel_threads: False leaves kernel threads out, told from the stat line read
            anyway (see ``_is_kernel_thread``): callers then read no descriptors or
            environments of theirs. Linux only; elsewhere every process is listed.

    Returns:
        One ``ProcInfo`` per process, in PID order (none without /proc).

    """
    if not _HAS_PROC:
        return []
    tag = None if session_id is None else session_id.encode()
    found: list[ProcInfo] = []
    for pid in sorted(_all_pids()):
        data = _read(f"{_PROC}/{pid}/stat")
        if not data or (not kernel_threads and _is_kernel_thread(data)):
            continue
        stat = _parse_stat(data)
        if stat is None or stat.state in _DEAD_STATES:
            continue
        found.append(_info(pid, stat, tag, with_cmdline))
    return found


# NOTE [incremental tag scan]: a tag scan reads the stat line of every process in /proc, so its
# cost grows with the machine's processes, not the job's; yet a process that was there at the
# previous scan was judged then, and that judgement stands: born before the root, the root,
# known, not tagged (the tag is in the environment it was started with). So ``TagScan``
# remembers the /proc entries it judged and reads only the others. An entry is a PID with the
# inode number of its /proc directory: a new process that took the number of an exited one gets
# a new inode (checked on Linux 6.18), so it is read though its PID was judged before. An entry
# is forgotten once it leaves /proc, and one whose stat could not be read is read again.
# "Not tagged" stands only once a second scan finds the same exec image: a process caught
# between its fork and its exec shows its parent's environment, and one caught inside its exec
# none yet (its parent already saw the exec begin, by a close-on-exec pipe, and went on). Its
# own environment, with the tag, comes with the exec; the first scan's "no" was about another
# image. So a process born since the root and found untagged is read once more, at the next
# scan (its stat line; its environment again only if it exec'd in between).


class TagScan:
    """Repeated scans for the live processes of one session born since its root.

    A job's processes are all younger than its root, so the processes born before it (most
    of a machine's) are left out from their stat line alone, and so are known ones: their
    environments and command lines, the costly reads (they wait on a process's memory map
    while it starts or exits), are read only for what is left. Each scan reads only what is
    new in /proc since the last (NOTE [incremental tag scan]). Not thread-safe: one owner
    (the tracker, under its lock).
    """

    def __init__(
        self, session_id: str, *, born_since: ProcessKey, variable: str = SESSION_ENV
    ) -> None:
        """Prepare scans for ``session_id``'s tag among processes born since ``born_since``.

        Args:
            session_id: The session whose tag to look for (NOTE [session tag]).
            born_since: The root's identity; the root itself is left out.
            variable: The environment variable that carries the tag: ``LEAKCHECK_SESSION``,
                or one the caller set for a root it started (NOTE [run tag] in
                launcher.py).

        """
        self._session_id = session_id
        self._tag = session_id.encode()
        self._variable = variable
        self._prefix = _tag_prefix(variable)
        self._born_since = born_since
        self._judged: set[tuple[int, int]] = set()
        self._untagged: dict[tuple[int, int], _Image | None] = {}
        """Entries found untagged once, with the exec image then (NOTE [incremental tag
        scan]): judged for good when the next scan finds that image again."""

    def scan(self, known: Collection[ProcessKey] = ()) -> list[ProcInfo]:
        """Tagged processes in /proc not judged by an earlier scan and not ``known``.

        Args:
            known: Identities not to read (the tracker placed them already).

        Returns:
            The tagged processes, with command lines, in PID order.

        """
        born_since = self._born_since
        if not _HAS_PROC:
            return []
        try:
            with os.scandir(_PROC) as listing:
                entries = sorted(
                    (int(entry.name), entry.inode()) for entry in listing if entry.name.isdigit()
                )
        except OSError:
            return []
        judged = self._judged.intersection(entries)
        untagged: dict[tuple[int, int], _Image | None] = {}
        found: list[ProcInfo] = []
        for entry in entries:
            if entry in judged:
                continue
            pid = entry[0]
            stat = _stat(pid)
            if stat is None:
                continue  # gone, or not readable now: read again next time if still listed
            judged.add(entry)
            if stat.state in _DEAD_STATES:
                continue
            key = ProcessKey(pid, stat.starttime_ticks)
            if key.start_ticks < born_since.start_ticks or key == born_since or key in known:
                continue
            if _image_tag(pid, stat.image, self._prefix) == self._tag:
                found.append(_info(pid, stat, self._tag, True, self._prefix))
            elif self._untagged.get(entry, False) != stat.image:
                judged.discard(entry)  # not yet for good: maybe before or inside its exec
                untagged[entry] = stat.image
        self._judged = judged
        self._untagged = untagged
        return found


def environ_variables(pid: int, names: Collection[str]) -> dict[str, str] | None:
    """Return the variables ``names`` of a process's initial environment that are set.

    One read of ``/proc/PID/environ`` (NOTE [session tag]: the block it got at its last
    exec, or its parent's when only forked). None when it cannot be read (gone, not ours,
    no /proc): unknown, not empty.
    """
    data = _read_all(f"{_PROC}/{pid}/environ")
    if data is None:
        return None
    wanted = {name.encode() for name in names}
    found: dict[str, str] = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name in wanted:
            found[name.decode()] = value.decode("utf-8", "replace")
    return found


def tagged_session(pid: int) -> str | None:
    """Return the ``LEAKCHECK_SESSION`` value in a process's initial environment.

    Args:
        pid: Process ID.

    Returns:
        The session id, or None when absent, unreadable, or the process is gone.

    """
    if not _HAS_PROC:
        return None
    value = _environ_tag(pid)
    return None if value is None else value.decode("utf-8", "replace")


def new_session_id(root_pid: int | None = None) -> str:
    """Make a session tag that encodes the root's identity (NOTE [session tag]).

    The form ``<pid>-<start ticks>-<random>`` lets an orphan tell that its root is gone
    (NOTE [process identity]); the ticks are 0 where the root cannot be read.
    """
    pid = root_pid if root_pid is not None else os.getpid()
    key = process_key(pid)
    return f"{pid}-{key.start_ticks if key else 0}-{os.urandom(4).hex()}"


def session_root_pid(session_id: str) -> ProcessKey | None:
    """The root identity encoded in a session tag (``<pid>-<start ticks>-<random>``)."""
    parts = session_id.split("-")
    if len(parts) < 3:
        return None
    try:
        return ProcessKey(int(parts[0]), int(parts[1]))
    except ValueError:
        return None


def parse_session_tag(environ: bytes) -> str | None:
    """Return the ``LEAKCHECK_SESSION`` value in a NUL-separated environment block.

    Args:
        environ: Contents of ``/proc/PID/environ``.

    Returns:
        The value of the first ``LEAKCHECK_SESSION=`` entry, or None.

    """
    value = _tag_bytes(environ)
    return None if value is None else value.decode("utf-8", "replace")


def is_nvidia_device_target(target: str) -> bool:
    """Whether a descriptor's link target is an NVIDIA device node.

    Args:
        target: ``readlink`` of ``/proc/PID/fd/N`` (``/dev/nvidia0``, ``/dev/nvidiactl``,
            ``/dev/nvidia-uvm``, ``pipe:[123]`` ...).

    """
    return target.startswith(_NVIDIA_PREFIX)


def _fd_targets(pid: int) -> dict[int, str] | None:
    """Descriptor number -> link target of every open descriptor; None if unreadable."""
    # Links are read relative to the open directory, which spares a path walk through procfs
    # per link.
    try:
        dir_fd = os.open(f"{_PROC}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except _GONE:
        return None
    targets: dict[int, str] = {}
    try:
        for name in os.listdir(dir_fd):
            try:
                targets[int(name)] = os.readlink(name, dir_fd=dir_fd)
            except _GONE:
                continue  # closed between listdir and readlink
    except _GONE:
        return None
    finally:
        os.close(dir_fd)
    return targets


def descriptor_use(pid: int) -> tuple[int, int | None] | None:
    """A process's open descriptors and their limit (the soft ``RLIMIT_NOFILE``).

    One listing of ``/proc/PID/fd`` (no link is read) and one read of ``/proc/PID/limits``.

    Returns:
        ``(open, limit)``, the limit None where unlimited or unreadable; None when the
        descriptor table cannot be read (gone, or another user's process).

    """
    if not _HAS_PROC:
        return None
    try:
        count = len(os.listdir(f"{_PROC}/{pid}/fd"))
    except _GONE:
        return None
    limit: int | None = None
    for line in (_read(f"{_PROC}/{pid}/limits") or b"").splitlines():
        if line.startswith(b"Max open files"):
            soft = line[len(b"Max open files") :].split()[:1]
            limit = int(soft[0]) if soft and soft[0].isdigit() else None
    return count, limit


def nvidia_fds(pid: int) -> dict[int, str] | None:
    """Descriptor number -> target of every ``/dev/nvidia*`` descriptor of a process.

    This process's own descriptors are told apart by their device numbers (NOTE [own
    descriptors]); another's by their link targets.

    Returns:
        The mapping (empty when none), or None when the table cannot be read.

    """
    if not _HAS_PROC:
        return None
    if pid == os.getpid():
        return _own_nvidia_fds()
    targets = _fd_targets(pid)
    if targets is None:
        return None
    return {fd: target for fd, target in targets.items() if is_nvidia_device_target(target)}


# NOTE [own descriptors]: a CUDA process holds hundreds of descriptors, a few dozen of them
# /dev/nvidia*, and reading each one's link through procfs is most of what counting a job's
# descriptors costs at an epoch end, and the training process, where leakcheck runs, holds the
# most. In this process ``fstat`` is a far cheaper call: a descriptor that is not a character
# device is not an NVIDIA device node, and a character device is one if its link, read once per
# device number and remembered, names one. So a link is read only for a device number not met
# before. One device reached through two paths (a node bind-mounted elsewhere) counts under the
# path met first.
_device_targets: dict[int, str] = {}


def _own_nvidia_fds() -> dict[int, str] | None:
    """``nvidia_fds`` of this process (NOTE [own descriptors])."""
    fd_dir = f"{_PROC}/self/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    found: dict[int, str] = {}
    for name in names:
        fd = int(name)
        try:
            device = os.fstat(fd)
        except OSError:
            continue  # closed since the listing (the listing's own descriptor is)
        if not S_ISCHR(device.st_mode):
            continue
        target = _device_targets.get(device.st_rdev)
        if target is None:
            try:
                target = os.readlink(f"{fd_dir}/{name}")
            except OSError:
                continue
            _remember(_device_targets, device.st_rdev, target)
        if is_nvidia_device_target(target):
            found[fd] = target
    return found


def nvidia_fd_count(pid: int) -> int | None:
    """Open descriptors of a process that point at ``/dev/nvidia*``.

    A forked child of a CUDA parent inherits them and pins the parent's context even when
    NVML does not list the child.

    Args:
        pid: Process ID.

    Returns:
        The count, or None when the descriptor table cannot be read (gone, not ours, or no
        /proc).

    """
    found = nvidia_fds(pid)
    return None if found is None else len(found)


def is_ancestor(ancestor_pid: int, pid: int, *, max_depth: int = 64) -> bool:
    """Whether ``ancestor_pid`` is on the parent chain of ``pid`` *now*.

    Args:
        ancestor_pid: Candidate ancestor.
        pid: Process whose parent chain is walked (a process is not its own ancestor).
        max_depth: Give up (False) after this many parent steps.

    Returns:
        True when the chain reaches ``ancestor_pid`` within ``max_depth`` steps.

    """
    current = pid
    for _ in range(max_depth):
        if _HAS_PROC:
            stat = _stat(current)
            if stat is None:
                return False
            parent = stat.ppid
        else:
            ps = _psutil()
            try:
                parent = ps.Process(current).ppid()
            except ps.Error:
                return False
        if parent == ancestor_pid:
            return True
        if parent <= 0 or parent == current:
            return False  # above PID 1, or a parent outside this namespace
        current = parent
    return False


@functools.cache
def pid_namespace_nested() -> bool:
    """Whether this process runs in a child PID namespace (a container without host PIDs).

    NVML reports host PIDs, which then do not match the PIDs seen here.

    Returns:
        True when the ``NSpid`` line of /proc/self/status has more than one entry; False
        when it has one, or the kernel (or platform) does not say.

    """
    data = _read_all(f"{_PROC}/self/status") if _HAS_PROC else None
    if not data:
        return False
    for line in data.splitlines():
        if line.startswith(b"NSpid:"):
            return len(line.split()) > 2
    return False


def pid_exists_here(pid: int) -> bool:
    """Whether a process (not merely a thread) with this PID exists in this namespace.

    Args:
        pid: Process ID, e.g. one reported by NVML.

    """
    if pid <= 0:
        return False
    if not _HAS_PROC:
        return bool(_psutil().pid_exists(pid))
    # /proc/TID exists for threads too (hidden from listdir only): a PID is a process when
    # its thread group id is itself.
    data = _read(f"{_PROC}/{pid}/status", 1024)
    if not data:
        return False
    at = data.find(b"\nTgid:")
    if at < 0:
        return True
    fields = data[at + 6 :].split(maxsplit=1)
    return bool(fields) and int(fields[0]) == pid


def is_zombie(pid: int) -> bool:
    """Whether the process has exited but was not reaped by its parent yet.

    Args:
        pid: Process ID.

    Returns:
        False for live processes and for PIDs that do not exist.

    """
    if not _HAS_PROC:
        ps = _psutil()
        try:
            return bool(ps.Process(pid).status() == ps.STATUS_ZOMBIE)
        except ps.Error:
            return False
    stat = _stat(pid)
    return stat is not None and stat.state == b"Z"


def shm_segments(directory: str = "/dev/shm") -> dict[str, ShmSegment]:
    """Files in a shared-memory directory, by name.

    Args:
        directory: Where POSIX shared memory lives.

    Returns:
        Name -> segment for every regular file; empty when the directory is missing.
        Files removed during the scan are skipped.

    """
    segments: dict[str, ShmSegment] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return segments
    for entry in entries:
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        segments[entry.name] = ShmSegment(st.st_size, st.st_mtime, st.st_ino)
    return segments


def shm_name_from_path(path: str, directory: str = "/dev/shm") -> str | None:
    """Return the segment name of a /dev/shm path, as seen in /proc/PID/fd or /proc/PID/maps.

    Args:
        path: Link target or mapped path, e.g. ``/dev/shm/torch_1_2`` or
            ``/dev/shm/x (deleted)``.
        directory: The shared-memory directory.

    Returns:
        The name relative to ``directory``, keeping a ``" (deleted)"`` suffix (memory that
        is still held but no longer visible in the directory); None for other paths.

    """
    prefix = directory.rstrip("/") + "/"
    if not path.startswith(prefix) or len(path) == len(prefix):
        return None
    return path[len(prefix) :]


def shm_open_by(pids: Iterable[int], directory: str = "/dev/shm") -> dict[int, list[str]]:
    """Which of the given processes hold shared-memory files open or mapped.

    Reads /proc/PID/fd and /proc/PID/maps of these PIDs only (maps can be large).

    Args:
        pids: Processes to inspect.
        directory: The shared-memory directory.

    Returns:
        PID -> sorted segment names (see ``shm_name_from_path``), for PIDs holding at least
        one; unreadable or vanished PIDs are left out.

    """
    held: dict[int, list[str]] = {}
    if not _HAS_PROC:
        return held
    needle = (directory.rstrip("/") + "/").encode()
    for pid in pids:
        names: set[str] = set()
        for target in (_fd_targets(pid) or {}).values():
            name = shm_name_from_path(target, directory)
            if name is not None:
                names.add(name)
        maps = _read_all(f"{_PROC}/{pid}/maps", record_bytes=_ANY_RECORD)
        if maps and needle in maps:
            for line in maps.splitlines():
                if needle not in line:
                    continue
                # address perms offset dev inode pathname (the path may contain spaces)
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    name = shm_name_from_path(fields[5].decode("utf-8", "replace"), directory)
                    if name is not None:
                        names.add(name)
        if names:
            held[pid] = sorted(names)
    return held
