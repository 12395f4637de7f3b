"""A per-session folder through which worker processes tell the tracker who they are.

NOTE [worker mailbox]: the tracker must know its workers exactly, not guess them from a diff
of children, and it must hear what the teardown policy freed in each worker. Workers may be
started by fork, spawn or forkserver, so no in-memory channel is shared by all of them. A
folder is: the tracker creates it and exports its path as ``LEAKCHECK_MAILBOX`` (spawned and
forked children alike inherit the variable); a worker writes one small JSON file per record,
atomically (write to a temporary name, then rename), and the tracker's sampler reads the
folder on each tick that walks the processes (NOTE [tracker lifecycle] in
track/sampler.py), and every epoch end. A reader never sees half a record; a worker that
cannot write (no variable, read-only folder) loses nothing but the record. The tracker
deletes each record once read (``consume``), so the folder stays small and a read's listing
costs the same in the hundredth epoch as in the first. Most reads skip the listing: an
unchanged folder time says no record came or went (``Inbox``).

The tracker also keeps its live workers' birth readings (NOTE [copy on read] in hostmem.py)
in the folder, as ``BIRTHS_FILE``: a name that is no record, so that ``leakcheck snapshot
--pid`` can tell from outside what each worker copied since its birth (``read_births``).

Each worker also points its faulthandler at a file of the folder, ``STACK_PREFIX`` with
its identity (no record: never read as one), which it removes as it exits normally: one
left behind holds, for a worker that crashed in native code, the Python stacks it
wrote (``read_stack``). A worker whose ``worker`` record says ``stack_signal`` writes its
stacks there too when sent that signal (``STACK_SIGNAL``), for a stalled loop
(``read_stack``); the file is opened for appending, so the reader empties it in place.

NOTE [stale mailboxes]: a tracker whose process is killed (SIGKILL, OOM killer, a crash)
never removes its folder. Each folder's name says who owns it,
``leakcheck-mailbox-<pid>-<start ticks>-<pid namespace>-<random>``, and every ``create``
first removes the folders whose owner is gone (``remove_stale``): by identity, so a live
owner never looks gone (NOTE [process identity] in procs.py). The PID namespace is in the
name because a temporary folder may be shared by containers: a PID from another namespace
names some other process here, or none, and says nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from leakcheck.core.model import ProcessKey, TeardownRecord
from leakcheck.observe import procs
from leakcheck.observe.hostmem import HostMemory

MAILBOX_ENV = "LEAKCHECK_MAILBOX"
MAILBOX_PREFIX = "leakcheck-mailbox-"
"""Every mailbox folder's name starts so, in the temporary folder."""
BIRTHS_FILE = ".births.json"
"""The live workers' birth readings, which the tracker rewrites as they change (a dot name:
never read as a record)."""

STACK_SIGNAL = signal.SIGUSR2
"""What a worker writes its stacks on: neither PyTorch nor its DataLoader uses it."""
STACK_PREFIX = "stack-"
"""A worker's faulthandler file: ``stack-<pid>-<start ticks>.txt`` (``stack_path``)."""

# <pid>-<start ticks>-<pid namespace>-<mkdtemp's random part: [a-z0-9_]>. Digit counts are
# bounded so that int() never meets a number too long to convert.
_OWNED_NAME = re.compile(
    r"^" + re.escape(MAILBOX_PREFIX) + r"(\d{1,10})-(\d{1,20})-(\d{1,20})-[a-z0-9_]+$"
)

# A folder's modification time moves in the kernel's coarse clock steps (a few ms), so a
# record added in the same step as a listing can leave the time unchanged. A time is trusted
# to mean "nothing new" only once it is this much older than the listing that saw it.
_CLOCK_STEP_MARGIN_NS = 100_000_000


def create() -> str:
    """Create a private mailbox folder named after its owner, and return its path.

    Stale mailboxes (NOTE [stale mailboxes]) are removed first; that never raises.
    """
    # Cleanup is a courtesy to earlier, crashed runs: it must never cost this one its
    # mailbox, whatever goes wrong in it.
    with contextlib.suppress(Exception):
        remove_stale()
    owner = _owner_tag(os.getpid())
    prefix = f"{MAILBOX_PREFIX}{owner}-" if owner is not None else MAILBOX_PREFIX
    return tempfile.mkdtemp(prefix=prefix)


def remove_stale(directory: str | None = None) -> list[str]:
    """Remove the mailbox folders whose owner process is gone, and only those.

    A folder is removed when its name is one ``create`` makes (with its owner's identity),
    it is a real folder (not a link) of this user, its owner was in this PID namespace, and
    no process with the owner's PID and start time exists. Anything else is left alone:
    folders of live owners (a zombie too), of other users, of other namespaces, of older
    leakcheck versions (no identity in the name), and other names. Costs one listing of
    the folder, and one /proc read per mailbox found. Never raises.

    Args:
        directory: Where to look (default: the temporary folder, where ``create`` makes
            them).

    Returns:
        The folders removed.

    """
    try:
        folder = directory if directory is not None else tempfile.gettempdir()
        names = os.listdir(folder)
    except OSError:
        return []
    removed: list[str] = []
    namespace: int | None = None
    for name in names:
        match = _OWNED_NAME.match(name)
        if match is None:
            continue
        pid, ticks, owner_namespace = (int(group) for group in match.groups())
        if namespace is None:
            namespace = _pid_namespace()
        if owner_namespace != namespace or _owner_alive(pid, ticks):
            continue
        path = os.path.join(folder, name)
        if _remove_own_folder(path):
            removed.append(path)
    return removed


def _owner_tag(pid: int) -> str | None:
    try:
        key = procs.process_key(pid)
    except (OSError, ValueError):
        key = None
    if key is None:
        return None  # an unnamed folder: never judged, never removed by remove_stale
    return f"{pid}-{key.start_ticks}-{_pid_namespace()}"


def _pid_namespace() -> int:
    """The inode of this process's PID namespace; 0 where it cannot be read."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return 0
    match = re.fullmatch(r"pid:\[(\d{1,20})\]", link)
    return int(match.group(1)) if match else 0


def _owner_alive(pid: int, ticks: int) -> bool:
    try:
        key = procs.process_key(pid)
    except (OSError, ValueError):
        return True  # cannot tell: keep the folder
    return key == ProcessKey(pid, ticks)


def _remove_own_folder(path: str) -> bool:
    """Delete a mailbox folder of this user through a descriptor that cannot follow links."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # a link, a file, gone, or unreadable
    try:
        info = os.fstat(handle)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        for entry in os.listdir(handle):
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=handle)
    except OSError:
        return False
    finally:
        os.close(handle)
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def post(kind: str, record: dict[str, Any], *, directory: str | None = None) -> bool:
    """Write one record atomically.

    Returns False (never raises) when no mailbox is set or the write fails: a worker must
    not die for leakcheck's sake.
    """
    folder = directory or os.environ.get(MAILBOX_ENV)
    if not folder:
        return False
    name = f"{kind}-{os.getpid()}-{record.get('start_ticks', 0)}.json"
    final_path = os.path.join(folder, name)
    temp_path = os.path.join(folder, f".{name}.tmp")
    try:
        with open(temp_path, "w", encoding="utf-8") as handle:
            json.dump({"kind": kind, **record}, handle)
        os.replace(temp_path, final_path)
    except OSError:
        return False
    return True


def read_new(directory: str, seen: set[str], *, consume: bool = False) -> Iterator[dict[str, Any]]:
    """Yield records not yet in ``seen`` (file names), adding them to it.

    Args:
        directory: The mailbox folder.
        seen: Names already read; a record posted again under a read name is skipped.
        consume: Delete each record file once read (the tracker, its only reader, does).

    """
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in sorted(names):
        if name.startswith(".") or not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        record: object = None
        if name not in seen:
            try:
                with open(path, encoding="utf-8") as handle:
                    record = json.load(handle)
            except (OSError, ValueError):
                continue  # not there any more, or not readable yet: the next call retries
            seen.add(name)
        if consume:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if isinstance(record, dict):
            yield record


class Inbox:
    """The tracker's side of a mailbox: new records, each once, deleted once read.

    ``read(quick=True)`` skips the listing while the folder's modification time is one
    already listed and known to be settled (see ``_CLOCK_STEP_MARGIN_NS``).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._seen: set[str] = set()
        self._settled_mtime_ns: int | None = None

    def read(self, *, quick: bool = False) -> list[dict[str, Any]]:
        """Return the records posted since the last read.

        Args:
            quick: Skip the listing when the folder is unchanged since a settled listing.

        """
        try:
            mtime_ns = os.stat(self.directory).st_mtime_ns
        except OSError:
            return []
        if quick and mtime_ns == self._settled_mtime_ns:
            return []
        listed_ns = time.time_ns()
        records = list(read_new(self.directory, self._seen, consume=True))
        # Deleting what was read changes the time again: reads list until that change is
        # older than the margin (two or three ticks), then settle. A time in whole seconds
        # says the filesystem keeps no finer one, and then a step is too coarse to trust.
        settled = (
            not records
            and listed_ns - mtime_ns > _CLOCK_STEP_MARGIN_NS
            and mtime_ns % 1_000_000_000 != 0
        )
        self._settled_mtime_ns = mtime_ns if settled else None
        return records


def stack_path(directory: str, key: ProcessKey) -> str:
    """The file worker ``key``'s faulthandler writes to (NOTE [worker mailbox])."""
    return os.path.join(directory, f"{STACK_PREFIX}{key.pid}-{key.start_ticks}.txt")


def read_stack(directory: str, key: ProcessKey, *, remove: bool = False) -> str | None:
    """What worker ``key``'s faulthandler wrote, and the file emptied (``remove``: deleted).

    Returns:
        The text; None when the file is empty or missing.

    """
    path = stack_path(directory, key)
    try:
        with open(path, "r+", encoding="utf-8", errors="replace") as handle:
            text = handle.read(262144).strip()
            if not remove:
                handle.truncate(0)  # the writer appends: its next stacks start the file
    except OSError:
        return None
    if remove:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return text or None


def remove(directory: str) -> None:
    """Delete the mailbox folder and its records; errors are ignored."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def record_key(record: Mapping[str, Any]) -> ProcessKey | None:
    """The identity a record is about; None when its ``pid``/``start_ticks`` are malformed.

    Start ticks, as the worker read them: the same number the tracker reads for the worker,
    whatever either process's wall clock said (NOTE [process identity] in procs.py).
    """
    pid, ticks = record.get("pid"), record.get("start_ticks")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    if not isinstance(ticks, int) or isinstance(ticks, bool):
        return None
    return ProcessKey(pid, ticks)


def _optional_int(record: Mapping[str, Any], name: str) -> int | None:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def worker_birth(record: Mapping[str, Any]) -> tuple[bool | None, HostMemory | None]:
    """A ``worker`` record's birth reading: forked or not, and its memory then.

    Returns:
        ``(forked, memory)``; None for what the record lacks or holds malformed (an older
        worker's record, a birth it could not read).

    """
    forked = record.get("forked")
    uss = _optional_int(record, "host_uss_bytes")
    shared = _optional_int(record, "host_shared_dirty_bytes")
    private = _optional_int(record, "host_private_dirty_bytes")
    memory = None
    if uss is not None and shared is not None and private is not None:
        memory = HostMemory(
            uss_bytes=uss,
            pss_bytes=None,
            rss_bytes=_optional_int(record, "host_rss_bytes"),
            swap_bytes=None,
            source="smaps_rollup",
            shared_dirty_bytes=shared,
            private_dirty_bytes=private,
        )
    return (forked if isinstance(forked, bool) else None), memory


Birth = tuple[bool | None, HostMemory | None]
"""``(forked, memory)`` of a worker's birth report (``worker_birth``)."""


def write_births(directory: str, births: Mapping[ProcessKey, Birth]) -> bool:
    """Replace the folder's ``BIRTHS_FILE`` with ``births`` atomically; False on failure."""
    entries = [
        {
            "pid": key.pid,
            "start_ticks": key.start_ticks,
            "forked": forked,
            "host_uss_bytes": memory.uss_bytes if memory else None,
            "host_rss_bytes": memory.rss_bytes if memory else None,
            "host_shared_dirty_bytes": memory.shared_dirty_bytes if memory else None,
            "host_private_dirty_bytes": memory.private_dirty_bytes if memory else None,
        }
        for key, (forked, memory) in sorted(births.items())
    ]
    temp_path = os.path.join(directory, BIRTHS_FILE + ".tmp")
    try:
        with open(temp_path, "w", encoding="utf-8") as handle:
            json.dump({"workers": entries}, handle)
        os.replace(temp_path, os.path.join(directory, BIRTHS_FILE))
    except OSError:
        return False
    return True


def read_births(root_pid: int, *, directory: str | None = None) -> dict[ProcessKey, Birth]:
    """The birth readings the trackers of process ``root_pid`` keep, from outside.

    Only the folders named after that very process (its PID, start time and PID namespace:
    NOTE [stale mailboxes]) are read. Never raises: what cannot be read is left out.

    Args:
        root_pid: The process whose trackers' mailboxes to read (a job's root).
        directory: Where the folders are (default: the temporary folder).

    """
    try:
        key = procs.process_key(root_pid)
        folder = directory if directory is not None else tempfile.gettempdir()
        names = os.listdir(folder)
    except (OSError, ValueError):
        return {}
    if key is None:
        return {}
    owner = (root_pid, key.start_ticks, _pid_namespace())
    found: dict[ProcessKey, Birth] = {}
    for name in names:
        match = _OWNED_NAME.match(name)
        if match is None or tuple(int(group) for group in match.groups()) != owner:
            continue
        try:
            with open(os.path.join(folder, name, BIRTHS_FILE), encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            continue
        entries = data.get("workers") if isinstance(data, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            worker = record_key(entry) if isinstance(entry, dict) else None
            if worker is not None:
                found[worker] = worker_birth(entry)
    return found


def teardown_record(record: Mapping[str, Any], key: ProcessKey) -> TeardownRecord:
    """Read a worker's ``teardown`` record; a malformed field reads as unknown."""

    def number(name: str, default: float = 0.0) -> float:
        value = record.get(name, default)
        return float(value) if isinstance(value, (int, float)) else default

    def optional_int(name: str) -> int | None:
        value = record.get(name)
        return int(value) if isinstance(value, (int, float)) else None

    def optional_float(name: str) -> float | None:
        value = record.get(name)
        return float(value) if isinstance(value, (int, float)) else None

    def optional_bool(name: str) -> bool | None:
        value = record.get(name)
        return value if isinstance(value, bool) else None

    by_device: dict[int, int] | None = None
    raw = record.get("gpu_bytes_by_device")
    if isinstance(raw, dict):
        try:
            by_device = {int(index): int(num) for index, num in raw.items()}
        except (TypeError, ValueError):
            by_device = None
    error = record.get("error")
    released = record.get("released")
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
        gpu_bytes_by_device=by_device,
        peak_reserved_bytes=optional_int("peak_reserved_bytes"),
        monotonic_s=optional_float("monotonic_s"),
        released=released if isinstance(released, bool) else True,
        host_uss_bytes=optional_int("host_uss_bytes"),
        host_pss_bytes=optional_int("host_pss_bytes"),
        host_rss_bytes=optional_int("host_rss_bytes"),
        host_rss_peak_bytes=optional_int("host_rss_peak_bytes"),
        host_shared_dirty_bytes=optional_int("host_shared_dirty_bytes"),
        host_private_dirty_bytes=optional_int("host_private_dirty_bytes"),
    )
