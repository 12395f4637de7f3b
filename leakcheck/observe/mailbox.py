"""A per-session folder through which worker processes tell the tracker who they are.

NOTE [worker mailbox]: workers start by fork, spawn or forkserver, so only a folder reaches
all of them. The tracker creates it and exports ``LEAKCHECK_MAILBOX``; a worker writes one
small JSON file per record, atomically, and loses only the record where it cannot write. The
sampler reads the folder on walking ticks and epoch ends, deleting each record once read. Not
records: ``BIRTHS_FILE``, the live workers' birth readings (NOTE [copy on read] in hostmem.py),
which ``leakcheck snapshot --pid`` reads from outside; and each worker's faulthandler file
(``stack_path``), removed as it exits normally: one left behind holds the stacks of a worker
that crashed in native code or, sent ``STACK_SIGNAL``, stalled.

NOTE [stale mailboxes]: a tracker killed never removes its folder. Each folder is named after
its owner, ``leakcheck-mailbox-<pid>-<start ticks>-<pid namespace>-<random>``, and every
``create`` first removes those whose owner is gone, by identity (NOTE [process identity] in
procs.py); the namespace because containers may share a temporary folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from leakcheck.core.model import ProcessKey, TeardownRecord
from leakcheck.observe import procs
from leakcheck.observe.hostmem import HostMemory

MAILBOX_ENV = "LEAKCHECK_MAILBOX"
MAILBOX_PREFIX = "leakcheck-mailbox-"
BIRTHS_FILE = ".births.json"
STACK_SIGNAL = signal.SIGUSR2
"""What a worker writes its stacks on: neither PyTorch nor its DataLoader uses it."""

# Bounded digit counts: int() never meets a number too long to convert.
_OWNED_NAME = re.compile(
    r"^" + re.escape(MAILBOX_PREFIX) + r"(\d{1,10})-(\d{1,20})-(\d{1,20})-[a-z0-9_]+$"
)
_BIRTH_FIELDS = ("host_uss_bytes", "host_rss_bytes", "host_shared_dirty_bytes",
                 "host_private_dirty_bytes")  # fmt: skip


def create() -> str:
    """Create a private mailbox folder named after its owner, removing stale ones first."""
    # A courtesy to earlier, crashed runs: it must never cost this one its mailbox.
    with contextlib.suppress(Exception):
        remove_stale()
    owner = _owner(os.getpid())
    named = "".join(f"{part}-" for part in owner) if owner else ""  # "<pid>-<ticks>-<ns>-"
    return tempfile.mkdtemp(prefix=MAILBOX_PREFIX + named)


def remove_stale(directory: str | None = None) -> list[str]:
    """Remove the mailbox folders whose owner (in this PID namespace) is gone; never raises.

    ``directory``: default, the temporary folder. The owner is judged by identity.
    """
    removed: list[str] = []
    for path, (pid, ticks, namespace) in _owned_folders(directory):
        if namespace != _pid_namespace():
            continue
        try:
            alive = procs.process_key(pid) == ProcessKey(pid, ticks)
        except (OSError, ValueError):
            alive = True  # cannot tell: keep the folder
        if not alive and remove(path):
            removed.append(path)
    return removed


def _owned_folders(directory: str | None) -> Iterator[tuple[str, tuple[int, int, int]]]:
    """Path and owner (pid, start ticks, PID namespace) of each mailbox folder named so."""
    with contextlib.suppress(OSError):
        folder = directory if directory is not None else tempfile.gettempdir()
        for name in os.listdir(folder):
            match = _OWNED_NAME.match(name)
            if match is not None:
                pid, ticks, namespace = (int(group) for group in match.groups())
                yield os.path.join(folder, name), (pid, ticks, namespace)


def _owner(pid: int) -> tuple[int, int, int] | None:
    # None: unreadable; its folder is unnamed, never judged nor removed by remove_stale.
    try:
        key = procs.process_key(pid)
    except (OSError, ValueError):
        return None
    return None if key is None else (pid, key.start_ticks, _pid_namespace())


def _pid_namespace() -> int:
    """The inode of this process's PID namespace; 0 where unreadable."""
    try:
        match = re.fullmatch(r"pid:\[(\d{1,20})\]", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def remove(directory: str) -> bool:
    """Delete a mailbox folder of this user and its files, never through a link; never raises.

    Returns:
        False where it was not removed (a link, a file, another user's, gone).

    """
    try:
        handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if os.fstat(handle).st_uid != os.geteuid():  # O_DIRECTORY: a folder
            return False
        for entry in os.listdir(handle):
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=handle)
        os.rmdir(directory)
    except OSError:
        return False
    finally:
        os.close(handle)
    return True


def _write_json(directory: str, name: str, data: object) -> bool:
    """Write ``name`` atomically (a temporary dot name, then rename); False on failure."""
    temp_path = os.path.join(directory, f".{name}.tmp")
    try:
        with open(temp_path, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(temp_path, os.path.join(directory, name))
    except OSError:
        return False
    return True


def post(kind: str, record: dict[str, Any], *, directory: str | None = None) -> bool:
    """Write one record atomically; False (never raises) without a mailbox or on failure."""
    folder = directory or os.environ.get(MAILBOX_ENV)
    if not folder:
        return False
    name = f"{kind}-{os.getpid()}-{record.get('start_ticks', 0)}.json"
    return _write_json(folder, name, {"kind": kind, **record})


class Inbox:
    """The tracker's side of a mailbox: new records, each once, deleted once read."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._seen: set[str] = set()

    def read(self) -> list[dict[str, Any]]:
        """The records posted since the last read."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            names = []
        records: list[dict[str, Any]] = []
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            path = os.path.join(self.directory, name)
            if name not in self._seen:  # a record posted again under a read name is skipped
                try:
                    with open(path, encoding="utf-8") as handle:
                        record = json.load(handle)
                except (OSError, ValueError):
                    continue  # gone, or not readable yet: the next read retries
                self._seen.add(name)
                if isinstance(record, dict):
                    records.append(record)
            with contextlib.suppress(OSError):
                os.unlink(path)
        return records


def stack_path(directory: str, key: ProcessKey) -> str:
    """The file worker ``key``'s faulthandler writes to (NOTE [worker mailbox])."""
    return os.path.join(directory, f"stack-{key.pid}-{key.start_ticks}.txt")


def read_stack(directory: str, key: ProcessKey, *, remove: bool = False) -> str | None:
    """What worker ``key``'s faulthandler wrote (None: nothing); the file emptied or removed."""
    path = stack_path(directory, key)
    try:
        with open(path, "r+", encoding="utf-8", errors="replace") as handle:
            text = handle.read(262144).strip()
            if not remove:
                handle.truncate(0)
    except OSError:
        return None
    if remove:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return text or None


def record_key(record: Mapping[str, Any]) -> ProcessKey | None:
    """The identity a record is about (NOTE [process identity]); None where malformed."""
    pid, ticks = record.get("pid"), record.get("start_ticks")
    if type(pid) is not int or type(ticks) is not int:  # a bool is no identity either
        return None
    return ProcessKey(pid, ticks)


def _int(value: object) -> int | None:
    """A number as int; None for anything else (a bool, NaN or infinity: no count)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


Birth = tuple[bool | None, HostMemory | None]
"""``(forked, memory)`` of a worker's birth report (``worker_birth``)."""


def worker_birth(record: Mapping[str, Any]) -> Birth:
    """A ``worker`` record's birth reading: forked or not, its memory then (None: unknown)."""
    forked = record.get("forked")
    uss, rss, shared, private = (_int(record.get(name)) for name in _BIRTH_FIELDS)
    memory = None
    if uss is not None and shared is not None and private is not None:
        memory = HostMemory(uss, None, rss, None, "smaps_rollup", None, None, shared, private)
    return (forked if isinstance(forked, bool) else None), memory


def host_fields(
    memory: HostMemory | None, names: Iterable[str] = _BIRTH_FIELDS
) -> dict[str, int | None]:
    """``memory``'s figures as records name them (default: a birth reading's); None: unknown."""
    return {name: getattr(memory, name.removeprefix("host_"), None) for name in names}


def write_births(directory: str, births: Mapping[ProcessKey, Birth]) -> bool:
    """Replace the folder's ``BIRTHS_FILE`` with ``births`` atomically; False on failure."""
    entries = [
        {"pid": key.pid, "start_ticks": key.start_ticks, "forked": forked, **host_fields(memory)}
        for key, (forked, memory) in sorted(births.items())
    ]
    return _write_json(directory, BIRTHS_FILE, {"workers": entries})


def read_births(root_pid: int, *, directory: str | None = None) -> dict[ProcessKey, Birth]:
    """The birth readings kept for process ``root_pid``'s trackers, read from outside.

    From the folders named after it (NOTE [stale mailboxes]); never raises.
    """
    owner = _owner(root_pid)
    found: dict[ProcessKey, Birth] = {}
    for path, who in _owned_folders(directory):
        if who != owner:  # an unreadable owner (None) names no folder
            continue
        try:
            with open(os.path.join(path, BIRTHS_FILE), encoding="utf-8") as handle:
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
    """Read a worker's ``teardown`` record; a malformed field reads as unknown or its default."""
    values: dict[str, Any] = {"key": key}
    for field in dataclasses.fields(TeardownRecord)[1:]:
        raw, kind = record.get(field.name), str(field.type)
        value: Any = None
        if kind.startswith("bool"):
            value = raw if isinstance(raw, bool) else None
        elif kind.startswith("int"):
            value = _int(raw)
        elif kind.startswith("float"):
            value = float(raw) if isinstance(raw, (int, float)) and _int(raw) is not None else None
        elif kind.startswith("str"):
            value = str(raw) if raw else None
        elif isinstance(raw, dict):  # gpu_bytes_by_device
            with contextlib.suppress(TypeError, ValueError):
                value = {int(index): int(num) for index, num in raw.items()}
        if value is None and field.default is not dataclasses.MISSING:
            value = field.default
        values[field.name] = False if value is None and kind == "bool" else value
    return TeardownRecord(**values)
