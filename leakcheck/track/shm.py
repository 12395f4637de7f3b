"""The job's files in ``/dev/shm`` and the filesystem's use, per epoch and at the end.

A file is the job's on evidence (NOTE [job shm] in hostmem.py), or where a process of the job
held it at an earlier epoch end (same name and inode); others are reported at the end as not
attributable, never blamed; named semaphores are left out. The filesystem's use (one
``statvfs``) is read on every walking tick and epoch end, so an epoch's peak catches batches
in flight that fill a small ``/dev/shm``.
"""

from __future__ import annotations

from typing import Any

from leakcheck.core.model import ShmFile
from leakcheck.observe import hostmem, procs
from leakcheck.observe.procs import ShmSegment
from leakcheck.track.table import ProcessTable

__all__ = ["ShmWatch"]


class ShmWatch:
    """The job's files in one shared-memory directory (NOTE [job shm] in hostmem.py)."""

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory
        self.before: dict[str, ShmSegment] = {}
        self.total_bytes: int | None = None
        self.used_peak_bytes: int | None = None
        self.held: set[tuple[str, int]] = set()  # (name, inode) a process of the job held

    def start(self) -> None:
        """Take the baseline: the files already there are never the job's."""
        hostmem.note_shm_made(self.directory)
        self.before = procs.shm_segments(self.directory)
        self.note_usage()

    def note_usage(self) -> None:
        """Raise the epoch's peak use of the filesystem to what it uses now."""
        capacity = hostmem.shm_capacity(self.directory)
        if capacity is None:
            return
        self.total_bytes = capacity.total_bytes
        self.used_peak_bytes = max(capacity.used_bytes, self.used_peak_bytes or 0)

    def begin_epoch(self) -> None:
        """An epoch begins: its peak starts from the use now."""
        self.used_peak_bytes = None
        self.note_usage()

    def epoch_end(self, table: ProcessTable) -> dict[str, Any]:
        """The ``EpochRecord`` fields of the job's files now and the epoch's peak use."""
        self.note_usage()
        files = tuple(item for item in self.files(table) if item.attributable)
        fields = {
            "shm_files": files,
            "shm_bytes": sum(item.size_bytes for item in files),
            "shm_total_bytes": self.total_bytes,
            "shm_used_peak_bytes": self.used_peak_bytes,
        }
        self.used_peak_bytes = None  # the next peak starts afresh
        return fields

    def files(self, table: ProcessTable, *, closing: bool = False) -> tuple[ShmFile, ...]:
        """The files new since the start (at the ``closing``: left behind)."""
        now = procs.shm_segments(self.directory)
        new = [
            item
            for item in hostmem.job_shm_files(self.before, now)
            if not hostmem.is_named_semaphore(item.name)
        ]
        if not new:
            return ()
        live = {key.pid: key for key in table.job_live()}
        ever = {key.pid for key, proc in table.procs.items() if proc.own and not proc.foreign}
        tied = hostmem.job_shm((item.name for item in new), live, ever, self.directory)
        found: list[ShmFile] = []
        for item in new:
            pid = tied.get(item.name)
            if pid is not None:
                self.held.add((item.name, item.inode))
            found.append(
                ShmFile(
                    name=item.name,
                    size_bytes=item.size_bytes,
                    allocated_bytes=item.allocated_bytes if item.allocated_bytes >= 0 else None,
                    holder_pid=pid,
                    holder_role=table.role(table.procs[live[pid]]) if pid is not None else None,
                    attributable=item.name in tied or (item.name, item.inode) in self.held,
                    in_use=closing and pid is not None,
                )
            )
        return tuple(found)
