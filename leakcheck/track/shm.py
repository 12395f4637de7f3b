"""The job's files in ``/dev/shm`` and the filesystem's use, per epoch and at the end.

NOTE [job shm]: ``/dev/shm`` is shared by every process of the host, so a file that appeared
there while the job ran is the job's only on evidence: a process of the job holds it open or
mapped (read at an epoch end, or when the tracker closes), or held it at an earlier epoch end
(the same file: name and inode), or its name carries the PID of a process of the job (torch
names its segments after their creator, CUDA IPC files after their producer in hex). A new
file with none of these is reported at the end as not attributable, never blamed. Named
semaphores (``sem.*``) are left out, as the pytest plugin leaves them out
(``hostmem.is_named_semaphore``). The listing
(one ``scandir`` and a ``stat`` per file) is read at each epoch end; who holds a file costs a
pass over the job's descriptors and maps, paid only when the listing shows new files. How
full the filesystem is costs one ``statvfs``: read on every walking tick and at epoch ends,
so that an epoch's peak catches the batches in flight that fill a small ``/dev/shm`` (the
file-descriptor sharing strategy removes its files at once, but their memory counts until
the last descriptor is closed).
"""

from __future__ import annotations

from dataclasses import dataclass

from leakcheck.core.model import ProcessKey, Role, ShmFile
from leakcheck.observe import hostmem, procs
from leakcheck.observe.procs import ShmSegment
from leakcheck.track.table import ProcessTable

__all__ = ["ShmEpoch", "ShmWatch"]


@dataclass(frozen=True)
class ShmEpoch:
    """What an epoch end found in ``/dev/shm`` (the fields of ``EpochRecord``)."""

    files: tuple[ShmFile, ...]
    bytes: int | None
    total_bytes: int | None
    used_peak_bytes: int | None


class ShmWatch:
    """The job's files in one shared-memory directory (NOTE [job shm]).

    Args:
        directory: The shared-memory directory.

    """

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory
        self.before: dict[str, ShmSegment] = {}
        self.total_bytes: int | None = None
        self.used_peak_bytes: int | None = None
        self.held: dict[tuple[str, int], tuple[int, Role]] = {}
        """(name, inode) -> the first holder of the job seen: the file is the job's."""

    def start(self) -> None:
        """Take the baseline: the files already there are never the job's."""
        self.before = procs.shm_segments(self.directory)
        self.note_usage()

    def note_usage(self) -> None:
        """Raise the epoch's peak use of the filesystem to what it uses now."""
        capacity = hostmem.shm_capacity(self.directory)
        if capacity is None:
            return
        self.total_bytes = capacity.total_bytes
        if self.used_peak_bytes is None or capacity.used_bytes > self.used_peak_bytes:
            self.used_peak_bytes = capacity.used_bytes

    def begin_epoch(self) -> None:
        """An epoch begins: its peak starts from the use now."""
        self.used_peak_bytes = None
        self.note_usage()

    def epoch_end(self, table: ProcessTable) -> ShmEpoch:
        """The job's files now and the epoch's peak use; the next peak starts afresh."""
        self.note_usage()
        files = tuple(item for item in self._classify(table, closing=False) if item.attributable)
        result = ShmEpoch(
            files=files,
            bytes=sum(item.size_bytes for item in files),
            total_bytes=self.total_bytes,
            used_peak_bytes=self.used_peak_bytes,
        )
        self.used_peak_bytes = None
        return result

    def left_behind(self, table: ProcessTable) -> tuple[ShmFile, ...]:
        """The files that appeared since the start and are still there as the tracker closes.

        The job's files nobody holds are left behind; one a live process of the job holds
        is still in use as far as the tracker can tell (``in_use``); the others are not
        attributable (NOTE [job shm]).
        """
        return self._classify(table, closing=True)

    def _classify(self, table: ProcessTable, *, closing: bool) -> tuple[ShmFile, ...]:
        now = procs.shm_segments(self.directory)
        new = [
            item
            for item in hostmem.job_shm_files(self.before, now)
            if not hostmem.is_named_semaphore(item.name)
        ]
        if not new:
            return ()
        live: dict[int, ProcessKey] = {
            key.pid: key for key, proc in table.live.items() if proc.own and not proc.foreign
        }
        holders = procs.shm_open_by(live, self.directory)
        held_now: dict[str, int] = {}
        for holder, names in holders.items():
            for name in names:
                held_now.setdefault(name, holder)
        ever = {key.pid for key, proc in table.procs.items() if proc.own and not proc.foreign}
        found: list[ShmFile] = []
        for item in new:
            pid = held_now.get(item.name)
            role: Role | None = None
            if pid is not None:
                role = table.role(table.procs[live[pid]])
                self.held.setdefault((item.name, item.inode), (pid, role))
            ours = (
                pid is not None
                or (item.name, item.inode) in self.held
                or bool(hostmem.shm_name_pids(item.name) & ever)
            )
            found.append(
                ShmFile(
                    name=item.name,
                    size_bytes=item.size_bytes,
                    holder_pid=pid,
                    holder_role=role,
                    attributable=ours,
                    in_use=closing and pid is not None,
                )
            )
        return tuple(found)
