"""The process table of one tracker: one mutable ``Proc`` per identity it placed.

Filled by the sampler's walks, NVML's lists and the mailbox; answers roles and persistence.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from leakcheck.core import ranks
from leakcheck.core.model import GpuProcess, ProcessKey, ProcInfo, RankInfo, Role
from leakcheck.core.roles import direct_child_role, is_runtime_helper
from leakcheck.observe import nvml, procs
from leakcheck.observe.hostmem import HostMemory
from leakcheck.track import claims

__all__ = ["Proc", "ProcessTable"]


@dataclass
class Proc:
    """One identity (NOTE [process identity] in procs.py), under the sampler's lock."""

    key: ProcessKey
    ppid: int
    cmdline: str
    last_seen_s: float
    born_epoch: int | None = None  # open when it was placed: the first to list it
    pre_existing: bool = False
    birth_epoch: int | None = None  # its start's (NOTE [born epoch] in sampler.py)
    exited_s: float | None = None
    in_lineage: bool = True
    foreign: bool = False
    own: bool = True  # this tracker's (NOTE [claims]): another's is counted, not judged
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    gpu_unknown: bool = False
    nvidia_fds: int | None = None
    open_fds: int | None = None
    fd_limit: int | None = None  # soft RLIMIT_NOFILE at the last end (None: unlimited)
    cmdline_confirmed: bool = False  # read after it exec'd (differs from its parent's)
    rank: RankInfo | None = None
    rank_until_s: float | None = None  # maybe between fork and exec (NOTE [rank read])
    forked: bool | None = None  # a worker started by fork, as its birth report says
    birth_host: HostMemory | None = None  # at its birth (NOTE [copy on read] in hostmem.py)
    end_read: bool = False  # an epoch end's smaps_rollup read has seen it
    dumps_stacks: bool = False  # writes its stacks on mailbox.STACK_SIGNAL
    rss_bytes_last: int | None = None  # a worker's at the last walk (what a death reports)
    other_rank: bool = False  # another rank's (NOTE [other ranks]): counted, not judged


def _rank_of(pid: int) -> RankInfo | None:
    # This process's: os.environ (NOTE [exported rank]).
    if pid == os.getpid():
        return ranks.rank_from_environ(os.environ)
    environ = procs.environ_variables(pid, ranks.RANK_VARIABLES)
    return None if environ is None else ranks.rank_from_environ(environ)


# NOTE [rank read]: a process's rank is read from its environment when first placed. One
# torchrun's agent caught between fork and exec shows the agent's environment (no RANK) and
# command line, so it is read again on the walks of a short window, until it names a rank
# (then its command line too). A worker (the mailbox names it) never becomes a rank.
_RANK_EXEC_WINDOW_S = 1.0


# NOTE [other ranks]: a torchrun job's ranks are siblings under the elastic agent, so rank 0's
# tracker finds rank 1 and its workers on the GPU outside its lineage; as foreign, their memory
# would be the residual rule's unexplained rise. A GPU process whose environment names the
# same elastic run (TORCHELASTIC_RUN_ID; "none" names none) and restart, another rank, and
# that is still below the agent (the root's parent) is another rank's: its memory is the
# job's, judged by its own rank's tracker. A dead rank's or an earlier restart's leftovers
# stay foreign: no live tracker would judge them otherwise. A process below this rank that
# names another rank (Lightning's ddp launcher starts ranks 1.. from rank 0) is that rank's.


def _same_job(ours: RankInfo | None, ours_ppid: int, other: RankInfo | None, pid: int) -> bool:
    if ours is None or other is None or other.rank == ours.rank or ours_ppid <= 1:
        return False
    runs = {None if i.run_id in (None, "", "none") else i.run_id for i in (ours, other)}
    same_run = len(runs) == 1 and other.restart_count == ours.restart_count
    return same_run and procs.is_ancestor(ours_ppid, pid)


class ProcessTable:
    """Every process one tracker placed: its lineage, orphans, foreign GPU holders.

    ``session``: the tracker's (its claims); ``tag``: ``(NAME, VALUE)`` of the variable that
    marks the job's processes (default ``LEAKCHECK_SESSION`` = ``session``).
    """

    def __init__(
        self,
        root: ProcessKey,
        root_info: ProcInfo | None,
        *,
        session: str,
        persistent_workers: bool,
        tag: tuple[str, str] | None = None,
    ) -> None:
        self.root = root
        self.session = session
        self.tag = tag or (procs.SESSION_ENV, session)
        self.persistent_workers = persistent_workers
        self.procs: dict[ProcessKey, Proc] = {}
        self.live: dict[ProcessKey, Proc] = {}  # what each walk checks, not every one seen
        self.by_pid: dict[int, ProcessKey] = {}
        self.workers: dict[ProcessKey, bool | None] = {}  # reported ones -> persistent
        self.changed = True  # processes or their bytes changed: the epoch's peaks are stale
        info = root_info or ProcInfo(key=root, ppid=0, name="", cmdline="")
        self._place(info, 0.0, pre_existing=True, rank=_rank_of(root.pid))
        claims.add_root(root, session)

    def _place(self, info: ProcInfo, now: float, **fields: Any) -> Proc:
        proc = Proc(info.key, info.ppid, (info.cmdline or info.name).strip(), now, **fields)
        self.procs[info.key] = self.live[info.key] = proc
        self.by_pid[info.key.pid] = info.key
        self.changed = True
        return proc

    def add(
        self,
        info: ProcInfo,
        *,
        now: float,
        born_epoch: int | None,
        pre_existing: bool = False,
        in_lineage: bool = True,
    ) -> Proc:
        """Place a process seen for the first time, claimed as NOTE [claims] says."""
        parent = self.by_pid.get(info.ppid)
        owner = claims.claim(info.key, parent, self.session)
        parent_proc = self.procs.get(parent) if parent is not None else None
        proc = self._place(
            info,
            now,
            born_epoch=born_epoch,
            pre_existing=pre_existing,
            in_lineage=in_lineage,
            birth_epoch=born_epoch,
            own=owner == self.session,
            # Gone before it could be read (known from its record only): its parent's rank.
            rank=_rank_of(info.key.pid) or (parent_proc.rank if parent_proc else None),
        )
        if proc.rank is None and parent_proc is not None and proc.cmdline == parent_proc.cmdline:
            proc.rank_until_s = now + _RANK_EXEC_WINDOW_S
        self._note_other_rank(proc)
        return proc

    def _note_other_rank(self, proc: Proc) -> None:
        # NOTE [other ranks]: a rank started below this one (Lightning's ddp launcher) and all
        # its lineage are its own trackers' to judge.
        ours = self.procs[self.root].rank
        if ours is not None and proc.rank is not None and proc.rank.rank != ours.rank:
            proc.own, proc.other_rank = False, True

    def apply_walk(
        self,
        lineage: list[ProcInfo],
        *,
        now: float,
        quick: bool,
        born_epoch: int | None,
    ) -> list[Proc]:
        """Fold a walk of the root's descendants in; returns the processes new to the table.

        One missing from a ``quick`` walk (NOTE [quick walk]) is reparented only for a full one.
        """
        added: list[Proc] = []
        current: set[ProcessKey] = {self.root}
        for info in lineage:
            proc = self.procs.get(info.key)
            if proc is None:
                # Walks read no command lines; a process new to the table is read once.
                full = procs.read_proc(info.key.pid) or info
                proc = self.add(full, now=now, born_epoch=born_epoch)
                added.append(proc)
            proc.ppid, proc.last_seen_s, proc.in_lineage = info.ppid, now, True
            if proc.rank_until_s is not None:
                self._read_rank_after_exec(proc, now)
            current.add(info.key)
        self.procs[self.root].last_seen_s = now
        gone: list[ProcessKey] = []
        for key, proc in list(self.live.items()):
            if key not in current:
                if procs.is_alive(key):
                    proc.last_seen_s = now
                    if not proc.foreign and not quick:
                        proc.in_lineage = False  # alive but no longer below the root
                        moved = procs.read_proc(key.pid, with_cmdline=False)
                        if moved is not None:
                            proc.ppid = moved.ppid
                else:
                    self.mark_exited(proc, now)
                    gone.append(key)
            if key != self.root and not proc.other_rank:
                self._own_by_claim(proc)
        claims.forget(gone)
        self._give_back_taken()
        return added

    def _read_rank_after_exec(self, proc: Proc, now: float) -> None:
        # NOTE [rank read]: it may have exec'd since.
        if now > (proc.rank_until_s or 0.0):
            proc.rank_until_s = None
            return
        rank = _rank_of(proc.key.pid)
        if rank is None:
            return  # not exec'd yet, or not a rank: looked at again until the window closes
        proc.rank, proc.rank_until_s = rank, None
        self._note_other_rank(proc)
        info = procs.read_proc(proc.key.pid)  # it exec'd: its command line is its own now
        if info is not None and info.key == proc.key and info.cmdline:
            proc.cmdline = info.cmdline.strip()
        self.changed = True

    def refresh_ownership(self) -> None:
        """Re-read every placed process's owner from the claims (the mailbox corrects them)."""
        for key, proc in self.procs.items():
            if key == self.root or proc.foreign or proc.other_rank or key in self.workers:
                continue
            self._own_by_claim(proc)
        self._give_back_taken()

    def _own_by_claim(self, proc: Proc) -> None:
        owner = claims.owner_of(proc.key)
        if owner is not None:
            proc.own = owner == self.session

    def _give_back_taken(self) -> None:
        # Another tracker's worker, claimed here first, is not this one's: alive or gone.
        for key in claims.taken_from(self.session):
            proc = self.procs.get(key)
            if proc is not None and key not in self.workers and proc.own:
                proc.own = False
                self.changed = True

    def mark_exited(self, proc: Proc, now: float) -> None:
        """Record that ``proc`` was seen gone at ``now``."""
        proc.exited_s = now
        proc.gpu_bytes = {}
        self.live.pop(proc.key, None)
        self.changed = True

    def register_worker(
        self, key: ProcessKey, persistent: bool | None, *, now: float, born_epoch: int | None
    ) -> Proc:
        """Declare ``key`` a worker; one already gone is kept, born and gone now."""
        self.workers[key] = persistent
        claims.claim_worker(key, self.session)
        proc = self.procs.get(key)
        if proc is None:
            info = procs.read_proc(key.pid)
            gone = info is None or info.key != key
            if info is None or gone:
                info = ProcInfo(key=key, ppid=self.root.pid, name="", cmdline="")
            proc = self.add(info, now=now, born_epoch=born_epoch)
            if gone:
                self.mark_exited(proc, now)
                claims.forget([key])  # seen gone: its claim is kept only a while
        proc.own = True
        proc.rank_until_s = None  # a worker never becomes a rank (NOTE [rank read])
        self.changed = True
        return proc

    def note_birth(self, key: ProcessKey, forked: bool | None, memory: HostMemory | None) -> None:
        """A worker's birth report: how it started, and its host memory then."""
        proc = self.procs.get(key)
        if proc is not None:
            proc.forked = forked
            proc.birth_host = memory
            self.changed = True

    def births(self) -> dict[ProcessKey, tuple[bool | None, HostMemory | None]]:
        """``(forked, birth reading)`` of the live processes that reported their birth."""
        return {
            key: (proc.forked, proc.birth_host)
            for key, proc in self.live.items()
            if proc.forked is not None or proc.birth_host is not None
        }

    def live_workers(self) -> list[ProcessKey]:
        """Workers of this tracker, alive as far as the table knows."""
        return [key for key in self.workers if key in self.live and self.procs[key].own]

    def job_live(self) -> dict[ProcessKey, Proc]:
        """The live processes this tracker judges: its own, not foreign GPU holders."""
        return {key: proc for key, proc in self.live.items() if proc.own and not proc.foreign}

    def copy_watched(self) -> list[ProcessKey]:
        """Live own forked workers that reported their birth: whose copies reads measure."""
        return [k for k, p in self.job_live().items() if p.forked is True and p.birth_host]

    def attribute_gpu(self, gpu: tuple[GpuProcess, ...], *, now: float) -> list[int]:
        """Give every live process its bytes in NVML's lists; returns the PIDs not here."""
        by_pid, unknown = nvml.gpu_bytes_by_pid(gpu)
        self.changed = True
        for proc in self.live.values():
            proc.gpu_bytes, proc.gpu_unknown = {}, False
        missing: list[int] = []
        for pid, per_device in by_pid.items():
            key = self.by_pid.get(pid)
            target = self.procs.get(key) if key is not None else None
            if target is not None and target.exited_s is not None and procs.process_key(pid) == key:
                continue  # exiting: NVML lists it until its context is gone
            if target is None or target.exited_s is not None:
                target = self._adopt_gpu_pid(pid, now)
            if target is None:
                missing.append(pid)
                continue
            target.gpu_bytes, target.gpu_unknown = per_device, pid in unknown
        return missing

    def _adopt_gpu_pid(self, pid: int, now: float) -> Proc | None:
        """Place a GPU PID the walks did not see: a tagged orphan of this session, or foreign."""
        info = procs.read_proc(pid, session_id=self.tag[1], tag_variable=self.tag[0])
        if info is None:
            return None
        proc = self.procs.get(info.key)
        if proc is not None:
            # Never replace what is known of a process: an exiting one is still ours.
            return proc if proc.exited_s is None else None
        if not info.tagged and claims.owner_of(info.key) is None:
            root = self.procs[self.root]
            rank = _rank_of(pid) if root.rank is not None else None
            other_rank = _same_job(root.rank, root.ppid, rank, pid)
            return self._place(
                info,
                now,
                foreign=not other_rank,
                own=not other_rank,
                in_lineage=False,
                rank=rank,
                other_rank=other_rank,
            )
        in_lineage = procs.is_ancestor(self.root.pid, pid)
        return self.add(info, now=now, born_epoch=None, in_lineage=in_lineage)

    def others_gpu_bytes(self) -> dict[int, int]:
        """GPU bytes per device of the live processes another tracker or rank owns."""
        total: Counter[int] = Counter()
        for proc in self.live.values():
            if not (proc.own or proc.foreign):
                total.update(proc.gpu_bytes)
        return dict(total)

    def count_nvidia_fds(self) -> None:
        """Count each own live process's descriptors, ``/dev/nvidia*`` ones apart."""
        # Less leakcheck's NVML ones (NOTE [descriptors]): the root's, and a forked child's
        # inherited copies of them (its command line is still the root's).
        own = nvml.own_descriptors() if self.root.pid == os.getpid() else frozenset()
        root_cmdline = self.procs[self.root].cmdline
        for proc in self.job_live().values():
            table = procs.descriptors(proc.key.pid)  # one listing for both counts
            if table is None:
                proc.nvidia_fds = proc.open_fds = proc.fd_limit = None
                continue
            forked = proc.cmdline == root_cmdline
            proc.nvidia_fds = len(set(table.nvidia) - own) if forked else len(table.nvidia)
            proc.open_fds, proc.fd_limit = table.open_count, table.limit

    def confirm_cmdlines(self) -> None:
        """Re-read the command lines that may still be a parent's (seen between fork and exec)."""
        for key, proc in self.live.items():
            if proc.foreign or proc.cmdline_confirmed or key == self.root or not proc.own:
                continue
            info = procs.read_proc(key.pid)
            if info is None or info.key != key or not info.cmdline:
                continue  # gone, or caught mid-exec with no command line: read it next time
            proc.cmdline = info.cmdline.strip()
            parent = self.procs.get(self.by_pid.get(proc.ppid, ProcessKey(0, 0)))
            proc.cmdline_confirmed = parent is not None and proc.cmdline != parent.cmdline

    def role(self, proc: Proc) -> Role:
        """Where ``proc`` stands in the job (docs/ARCHITECTURE.md, Roles and attribution)."""
        if proc.key == self.root:
            return "parent"
        if proc.foreign:
            return "foreign"
        if not proc.in_lineage:
            return "orphan"
        return direct_child_role(proc.key, self.workers)  # NOTE [roles from outside]

    @staticmethod
    def baseline_helper(proc: Proc) -> bool:
        """A runtime helper that pins nothing on the GPU: a baseline, never a survivor."""
        return (
            is_runtime_helper(proc.cmdline)
            and not any(proc.gpu_bytes.values())
            and not proc.nvidia_fds
        )

    def persistent(self, proc: Proc) -> bool:
        """Whether ``proc`` is expected to outlive the epoch it was born in."""
        if proc.key == self.root or proc.pre_existing or self.baseline_helper(proc):
            return True
        if self.role(proc) != "worker":
            return False
        registered = self.workers.get(proc.key)
        return self.persistent_workers if registered is None else registered
