"""A per-session folder through which worker processes tell the tracker who they are.

NOTE [worker mailbox]: the tracker must know its workers exactly, not guess them from a diff
of children, and it must hear what the teardown policy freed in each worker. Workers may be
started by fork, spawn or forkserver, so no in-memory channel is shared by all of them. A
folder is: the tracker creates it and exports its path as ``LEAKCHECK_MAILBOX`` (spawned and
forked children alike inherit the variable); a worker writes one small JSON file per record,
atomically (write to a temporary name, then rename), and the tracker's sampler reads the
folder on each tick that walks the processes (NOTE [tracker lifecycle] in tracker.py), and
every epoch end. A reader never sees half a record; a worker that cannot write (no
variable, read-only folder) loses nothing but the record. The tracker deletes each record
once read (``consume``), so the folder stays small and a read's listing costs the same in
the hundredth epoch as in the first. Most reads skip the listing: an unchanged folder time
says no record came or went (``Inbox``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from leakcheck.model import ProcessKey, TeardownRecord

MAILBOX_ENV = "LEAKCHECK_MAILBOX"

# A folder's modification time moves in the kernel's coarse clock steps (a few ms), so a
# record added in the same step as a listing can leave the time unchanged. A time is trusted
# to mean "nothing new" only once it is this much older than the listing that saw it.
_CLOCK_STEP_MARGIN_NS = 100_000_000


def create() -> str:
    """Create a private mailbox folder and return its path."""
    return tempfile.mkdtemp(prefix="leakcheck-mailbox-")


def post(kind: str, record: dict[str, Any], *, directory: str | None = None) -> bool:
    """Write one record atomically.

    Returns False (never raises) when no mailbox is set or the write fails: a worker must
    not die for leakcheck's sake.
    """
    folder = directory or os.environ.get(MAILBOX_ENV)
    if not folder:
        return False
    name = f"{kind}-{os.getpid()}-{record.get('create_time', 0)}.json"
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


def remove(directory: str) -> None:
    """Delete the mailbox folder and its records; errors are ignored."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def record_key(record: Mapping[str, Any]) -> ProcessKey | None:
    """The identity a record is about; None when its ``pid``/``create_time`` are malformed."""
    pid, create_time = record.get("pid"), record.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    if not isinstance(create_time, (int, float)) or isinstance(create_time, bool):
        return None
    return ProcessKey(pid, float(create_time))


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
    )
