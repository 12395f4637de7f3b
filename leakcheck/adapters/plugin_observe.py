"""What the pytest plugin sees of one test, turned into a ``Timeline`` for ``verdict.judge``.

One ``Checker`` per pytest process marks the moment before a checked test's setup (``begin``),
notes what wider-scoped fixtures start (``fixture_scope``), and after the teardown
(``observe``) waits out the grace and reads the machine through ``observe/`` (NOTE [cheap
snapshots], NOTE [whose process] in procs.py).

NOTE [scopes]: what leaks is what outlives the scope that created it. Processes, /dev/shm
files and allocator bytes that appear while a class/module/package/session fixture is set up
are that fixture's: judged, once its finalizer ran, within the test whose teardown ran it.
One that starts processes lazily, inside a test, is not their owner: the test is; but for the
persistent workers of a DataLoader (or a ProcessPoolExecutor's, started at the first submit)
that is the fixture's value, which it keeps across tests. A /dev/shm file is a fixture's, as
a test's, only on evidence (NOTE [job shm] in hostmem.py).

NOTE [reference cycles]: an iterator caught in a reference cycle stops its workers only when
the garbage collector runs. Processes alive after the grace get a moment more (one on its way
out is late, not kept), then one ``gc.collect()``: those gone as it returns are still the
test's leak, and their finding names the cycle.

NOTE [first context]: a process's first CUDA context (and the driver memory of libraries it
loads on first use) is a baseline: the allocator judges the tensors a test keeps; driver memory
beyond it fails a test only where torch is not the one using CUDA here.

NOTE [one short epoch]: the test is epoch 0 of its own timeline, labelled ``the test``, from
before its setup to the end of its teardown. Its processes: the test process (the parent),
those it started still alive after the grace, and runtime helpers that pin nothing on the GPU
(a persistent baseline). Device totals are not read per test (other jobs share the device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from leakcheck.core.model import (
    Attribution,
    DeviceState,
    EpochRecord,
    FinalState,
    ParentMemory,
    ProcessEpoch,
    ProcInfo,
    Role,
    ShmFile,
    Timeline,
)
from leakcheck.core.roles import direct_child_role, is_runtime_helper
from leakcheck.observe import nvml, procs
from leakcheck.observe.hostmem import is_named_semaphore, job_shm, note_shm_made, shm_creator_pid
from leakcheck.observe.procs import SESSION_ENV, Lineage, PidMark, handed_out_since
from leakcheck.observe.snapshot import read_gpu_processes
from leakcheck.observe.torch_state import allocator_bytes
from leakcheck.track import exports

if TYPE_CHECKING:
    from leakcheck.core.model import Finding

__all__ = ["Checker", "GpuState", "Window"]

_SHUTDOWN_SETTLE_S = 0.25  # NOTE [reference cycles]: how long a process may take to exit
_BLIND_NOTE = (
    "NVML PIDs are not this PID namespace's (container without --pid=host): "
    "GPU memory of processes is not attributed"
)


def _listdir(path: str) -> frozenset[str]:
    try:
        return frozenset(os.listdir(path))
    except OSError:
        return frozenset()


@dataclass(frozen=True)
class GpuState:
    """The test process's GPU memory per device: NVML's and the allocator's (None: unknown)."""

    nvml_bytes: Mapping[int, int] | None = None
    allocated_bytes: Mapping[int, int] | None = None
    reserved_bytes: Mapping[int, int] | None = None


@dataclass(frozen=True)
class ScopeOwner:
    """What one wide-scope fixture instance started while it was set up (NOTE [scopes])."""

    label: str  # ``module-scoped fixture 'pool'``
    window_serial: int
    processes: tuple[ProcInfo, ...]
    shm: frozenset[str]
    allocated_bytes: Mapping[int, int]


@dataclass
class Window:
    """One checked test, from before its setup (``pids``, ``shm``, ``gpu``, ``start_s``)."""

    serial: int  # increasing in this process
    tag: str  # its own, which the test's children inherit as ``LEAKCHECK_SESSION``
    tags: set[str]  # ``tag`` and those of the trackers the test ran
    pids: PidMark
    shm: frozenset[str]
    gpu: GpuState
    saved_env: str | None  # the tag variable's previous value (None: unset)
    start_s: float  # ``time.monotonic()``
    exports_mark: int  # where the tags of trackers the test starts begin (``exports.mark``)
    extra: list[Finding] = field(default_factory=list)  # the ``gpu_leak_tracker`` fixture's


@dataclass
class _Candidate:
    """A process the test may have left, while the grace period runs out."""

    info: ProcInfo
    scope: str | None  # the label of the wide-scope fixture that started it (None: the test)
    last_seen_s: float
    exited_s: float | None = None
    # A runtime helper's GPU memory or /dev/nvidia* use (None: not asked); False: a baseline.
    pins: bool | None = None
    freed_by_gc: bool = False  # NOTE [reference cycles]


class Checker:
    """Per-process state of the plugin's observation of tests."""

    def __init__(self, *, shm_dir: str = "/dev/shm") -> None:
        self.pid = os.getpid()
        self.shm_dir = shm_dir
        note_shm_made(shm_dir)
        self.forks = procs.fork_ledger()
        self.lineage = Lineage(self.pid)
        # How far the latest read attributed GPU memory to processes (and why not), the
        # devices it saw, and a failed read of this test's window: it stays unavailable.
        self.attribution: tuple[Attribution, str] = ("nvml-unavailable", "NVML not consulted")
        self.devices: tuple[DeviceState, ...] = ()
        self._gpu_failure: str | None = None
        self._serial = 0
        self._owners: dict[object, ScopeOwner] = {}
        self._finished: list[ScopeOwner] = []

    @property
    def gpu_note(self) -> str:
        """How GPU memory was read, for the session summary."""
        return self.attribution[1] or "NVML"

    def begin(self) -> Window:
        """Snapshot before the test's setup and export its tag to the children it starts."""
        self._serial += 1
        self._gpu_failure = None
        self.forks.drain()  # NOTE [fork ledger]: the test's own start here
        tag = f"pytest-{self.pid}-{self._serial}"
        pids, shm, gpu = PidMark.now(), _listdir(self.shm_dir), self._gpu_state()
        saved_env = os.environ.get(SESSION_ENV)
        start_s, mark = time.monotonic(), exports.mark()
        os.environ[SESSION_ENV] = tag
        return Window(self._serial, tag, {tag}, pids, shm, gpu, saved_env, start_s, mark)

    def end_environment(self, window: Window) -> None:
        """Give the tag variable back its value from before the test."""
        if window.saved_env is None:
            os.environ.pop(SESSION_ENV, None)
        else:
            os.environ[SESSION_ENV] = window.saved_env

    @contextlib.contextmanager
    def fixture_scope(self, key: object, label: str, window: Window) -> Iterator[None]:
        """Around a wide-scope fixture's setup: what appears meanwhile is its own.

        The allocator is read, not NVML. A failed read leaves it unowned: what it starts
        counts as the test's.
        """
        before: Mapping[int, int] | None = None
        try:
            pids, shm = PidMark.now(), _listdir(self.shm_dir)
            before = self._gpu_state(nvml=False).allocated_bytes or {}
        except Exception:
            pass  # yielded below, outside the handler: the fixture's own error has no context
        if before is None:
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                processes = tuple(self._born_since(pids, window.tags))
                owned_shm = {name for o in self._owners.values() for name in o.shm}
                theirs = {self.pid, *(info.key.pid for info in processes)}
                new = _listdir(self.shm_dir) - shm - owned_shm
                new_shm = frozenset(job_shm(new, theirs, theirs, self.shm_dir))
                now = self._gpu_state(nvml=False).allocated_bytes or {}
                added = {d: now[d] - before.get(d, 0) for d in now if now[d] > before.get(d, 0)}
                self._owners[key] = ScopeOwner(label, window.serial, processes, new_shm, added)

    def fixture_finished(self, key: object, *, judge: bool = True) -> None:
        """A wide-scope fixture ended: what it owned goes with the current test (or none)."""
        owner = self._owners.pop(key, None)
        if owner is not None and judge:
            self._finished.append(owner)

    def observe(
        self, window: Window, *, label: str, end_s: float, grace_s: float, tolerance_bytes: int
    ) -> Timeline:
        """Wait out the grace period and describe the test as one short epoch.

        ``end_s``: ``time.monotonic()`` at the end of the teardown. Above ``tolerance_bytes``
        the allocator is asked again after a garbage collection.
        """
        self._adopt_loader_workers()
        finished, self._finished = self._finished, []
        active = list(self._owners.values())
        # Trackers the test ran (watch(), Tracker) tag their children with their own tag.
        window.tags.update(exports.exported_since(window.exports_mark, SESSION_ENV))
        # A fixture set up and ended within this test: its processes are its own, once.
        theirs = {info.key.pid for owner in finished for info in owner.processes}
        found = [p for p in self._born_since(window.pids, window.tags) if p.key.pid not in theirs]
        seen_s = time.monotonic()
        candidates = [_Candidate(info, None, seen_s) for info in found]
        for ended in finished:  # dead ones drop out in _wait's first pass
            candidates.extend(_Candidate(info, ended.label, seen_s) for info in ended.processes)
        candidates = [cand for cand in candidates if cand.info.key.pid != self.pid]
        self._wait(candidates, end_s + grace_s)
        staying = [cand for cand in candidates if cand.exited_s is None]
        self._collect_and_settle(staying)
        left = self._left(staying, end_s)
        # /dev/shm after the grace period: exiting workers remove their own.
        test_pids = {cand.info.key.pid for cand in candidates} | self.forks.drain()
        shm_files = self._shm_files(window, active, finished, left, test_pids)
        parent_memory, after = self._parent_memory(window, active, finished, tolerance_bytes)
        now_s = time.monotonic()
        alive = [process for process in left if process.exited_after_s is None]
        devices = self.devices if alive else ()
        gpu = dict(after.nvml_bytes or {})
        parent = ProcessEpoch(
            key=self.lineage.key,
            role="parent",
            ppid=os.getppid(),
            cmdline=self.lineage.cmdline,
            born_in_epoch=False,
            persistent=True,
            alive_at_end=True,
            gpu_bytes_end=gpu,
            gpu_bytes_peak=gpu,
        )
        epoch = EpochRecord(0, label, window.start_s, end_s, "completed", (parent, *left), devices)
        still = (
            dataclasses.replace(p, born_in_epoch=False, last_seen_after_s=now_s - end_s)
            for p in alive
        )
        return Timeline(
            session_id=window.tag,
            root=parent.key,
            started_unix_s=window.pids.unix_s,
            boot_unix_s=procs.boot_time_s(),
            attribution=self.attribution[0],
            attribution_reason=self.attribution[1],
            baseline_devices=(),
            baseline_gpu_bytes=dict(window.gpu.nvml_bytes or {}),
            epochs=(epoch,),
            final=FinalState(now_s, devices, (parent, *still), closed=True),
            shm_files=shm_files,
            parent_memory=parent_memory,
        )

    def _adopt_loader_workers(self) -> None:
        """NOTE [scopes]: the live workers of an active fixture's loader or executor are its."""
        for key, owner in list(self._owners.items()):
            cached = getattr(key, "cached_result", None)  # pytest's (value, key, error)
            value = cached[0] if isinstance(cached, tuple) and cached else None
            workers = getattr(getattr(value, "_iterator", None), "_workers", None) or ()
            executor = getattr(value, "_processes", None)  # ProcessPoolExecutor: PID -> process
            workers = [*workers, *(executor.values() if isinstance(executor, dict) else ())]
            owned = {info.key.pid for info in owner.processes}
            pids = {w.pid for w in workers if isinstance(getattr(w, "pid", None), int)} - owned
            found = [info for info in map(procs.read_proc, sorted(pids)) if info is not None]
            if found:
                self._owners[key] = dataclasses.replace(owner, processes=(*owner.processes, *found))

    def _gpu_by_pid(self) -> dict[int, dict[int, int]] | None:
        """Used GPU bytes per device of each process NVML lists; None where it cannot say."""
        attribution, reason, devices, processes = read_gpu_processes(telemetry=False)
        if attribution != "nvml-unavailable" and procs.pid_namespace_nested():
            # NVML reports host PIDs, whether or not one happens to match a PID here.
            attribution, reason = "blind-namespace", _BLIND_NOTE
        if attribution == "nvml-unavailable" and self._gpu_failure is None:
            self._gpu_failure = reason
        if self._gpu_failure is not None:
            attribution, reason = "nvml-unavailable", self._gpu_failure
        self.attribution, self.devices = (attribution, reason), devices
        return nvml.gpu_bytes_by_pid(processes)[0] if attribution == "ok" else None

    def _gpu_state(self, *, collect: bool = False, nvml: bool = True) -> GpuState:
        """NVML's view (``nvml``) and the allocator's counters, where CUDA is initialised."""
        by_pid = self._gpu_by_pid() if nvml else None
        nvml_bytes = None if by_pid is None else by_pid.get(self.pid, {})
        return GpuState(nvml_bytes, *(allocator_bytes(collect=collect) or ()))

    def _born_since(self, mark: PidMark, tags: set[str]) -> list[ProcInfo]:
        """The test's processes born since ``mark`` that no active fixture owns."""
        owned = {info.key.pid for owner in self._owners.values() for info in owner.processes}
        new_pids = [pid for pid in mark.pids_since() if pid not in owned]
        return self.lineage.ours(new_pids, tags, since=mark)

    def _pins_gpu(self, pid: int) -> bool:
        """Whether a process holds GPU memory or ``/dev/nvidia*`` descriptors now."""
        return bool(procs.nvidia_fd_count(pid)) or pid in (self._gpu_by_pid() or {})

    def _wait(self, candidates: Sequence[_Candidate], deadline_s: float) -> None:
        """Poll until every candidate exited or is a baseline helper, or the deadline passed."""
        pending = list(candidates)
        delay = 0.005
        while True:
            now = time.monotonic()
            for cand in pending:
                key = cand.info.key
                if not procs.is_alive(key):
                    cand.exited_s = now
                    continue
                cand.last_seen_s = now  # a survivor's last poll is at or after the deadline
                # Read at each poll: a child between fork and exec shows its parent's command
                # line, and a helper must be recognised before it costs a grace.
                current = procs.read_proc(key.pid)
                if current is not None and current.key == key and current.cmdline:
                    cand.info = current._replace(tagged=cand.info.tagged)
                if cand.pins is None and is_runtime_helper(cand.info.cmdline):
                    cand.pins = self._pins_gpu(key.pid)
            pending = [cand for cand in pending if cand.exited_s is None and cand.pins is not False]
            if not pending or now >= deadline_s:
                return
            time.sleep(min(delay, max(deadline_s - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.1)

    def _collect_and_settle(self, staying: Sequence[_Candidate]) -> None:
        """NOTE [reference cycles]: wait a moment, collect garbage once, wait a moment again."""
        pending = [cand for cand in staying if cand.pins is not False]
        self._wait(pending, time.monotonic() + _SHUTDOWN_SETTLE_S)
        pending = [cand for cand in pending if cand.exited_s is None]
        if pending:
            gc.collect()
            now = time.monotonic()
            for cand in pending:
                if not procs.is_alive(cand.info.key):
                    cand.exited_s, cand.freed_by_gc = now, True
            pending = [cand for cand in pending if cand.exited_s is None]
            self._wait(pending, time.monotonic() + _SHUTDOWN_SETTLE_S)

    def _role(self, info: ProcInfo) -> Role:
        """A loader worker of the test process by torch's name for it; what else it started."""
        if not self.lineage.descends(info):
            return "orphan"
        if info.ppid != os.getpid():
            return "descendant"
        return direct_child_role(info.key, name=info.name)

    def _left(self, staying: Sequence[_Candidate], end_s: float) -> list[ProcessEpoch]:
        """The candidates alive after the grace (``exited_after_s``: gone now)."""
        gpu_by_pid = (self._gpu_by_pid() or {}) if staying else {}
        left: list[ProcessEpoch] = []
        for cand in staying:
            key = cand.info.key
            current = procs.read_proc(key.pid)
            alive = current is not None and current.key == key and procs.is_alive(key)
            info = current if alive and current is not None else cand.info
            gpu = dict(gpu_by_pid.get(key.pid, {})) if alive else {}
            process = ProcessEpoch(
                key=key,
                role=self._role(info),
                ppid=info.ppid,
                cmdline=info.cmdline or cand.info.cmdline or info.name,
                born_in_epoch=True,
                born_epoch=0,
                persistent=cand.pins is False,
                alive_at_end=True,
                exited_after_s=None if alive else time.monotonic() - end_s,
                last_seen_after_s=cand.last_seen_s - end_s,
                gpu_bytes_end=gpu,
                gpu_bytes_peak=gpu,
                nvidia_fds=procs.nvidia_fd_count(key.pid) if alive else None,
                scope=cand.scope,
                freed_by_gc=cand.freed_by_gc,
            )
            left.append(process)
        return left

    def _shm_files(
        self,
        window: Window,
        active: Sequence[ScopeOwner],
        finished: Sequence[ScopeOwner],
        left: Sequence[ProcessEpoch],
        test_pids: set[int],
    ) -> tuple[ShmFile, ...]:
        """The files the test (or a wide-scope fixture that ended) left in /dev/shm.

        The test's on evidence (NOTE [job shm] in hostmem.py; ``test_pids``: gone ones too,
        NOTE [fork ledger]), and its fixtures'. Of the rest, a stranger's (held by one, or
        made by a live one, as its name says) is left out, others are said, not blamed.
        """
        now = _listdir(self.shm_dir)
        fresh = now - window.shm - {name for owner in active for name in owner.shm}
        scopes = {name: owner.label for owner in finished for name in owner.shm if name in now}
        if not fresh and not scopes:
            return ()
        roles: dict[int, Role] = {self.pid: "parent"}
        roles |= {p.key.pid: p.role for p in left if p.exited_after_s is None and not p.persistent}
        segments = procs.shm_segments(self.shm_dir)
        # Not a plain file of this user's, a named semaphore, or removed meanwhile: not ours.
        mine = [n for n in sorted(fresh | scopes.keys()) if n in segments]
        mine = [n for n in mine if segments[n].uid == os.getuid() and not is_named_semaphore(n)]
        tied = job_shm(mine, roles, roles.keys() | test_pids, self.shm_dir)
        found: list[ShmFile] = []
        held_by_strangers: set[str] | None = None  # read once, where first needed
        now_pid = None
        for name in mine:
            size = segments[name].size_bytes
            if name in scopes or name in tied:
                holder = tied.get(name)
                role = None if holder is None else roles[holder]
                scope = scopes.get(name)
                found.append(ShmFile(name, size, holder_pid=holder, holder_role=role, scope=scope))
                continue
            if _made_by_stranger(name, roles):
                continue
            if held_by_strangers is None:  # a stranger's holding makes a file not ours
                strangers = [
                    int(n) for n in _listdir("/proc") if n.isdigit() and int(n) not in roles
                ]
                held_by_strangers = set().union(
                    *procs.shm_open_by(strangers, self.shm_dir).values()
                )
                now_pid = procs.last_pid()
            if name in held_by_strangers or not os.path.exists(os.path.join(self.shm_dir, name)):
                continue
            # Its maker, by its naming scheme, is older than the test: another job's file.
            # Only the scheme's PID counts; an unknown PID mark proves nothing.
            creator = shm_creator_pid(name)
            older = creator is not None and handed_out_since(window.pids, creator, now_pid) is False
            made_by = creator if older else None
            found.append(ShmFile(name, size, attributable=False, made_by_older=made_by))
        return tuple(found)

    def _parent_memory(
        self,
        window: Window,
        active: Sequence[ScopeOwner],
        finished: Sequence[ScopeOwner],
        tolerance_bytes: int,
    ) -> tuple[ParentMemory | None, GpuState]:
        """The test process's GPU memory beyond its start, net of the scopes' allowances."""
        before = window.gpu
        after = self._gpu_state()
        if after.allocated_bytes is None and after.nvml_bytes is None:
            return None, after
        # NOTE [scopes]: fixtures set up during this test and still active add to the
        # baseline; those set up earlier and finished now take away from it.
        base: Counter[int] = Counter(before.allocated_bytes or {})
        for owner in active:
            if owner.window_serial == window.serial:
                base.update(owner.allocated_bytes)
        for owner in finished:
            if owner.window_serial != window.serial:
                base.subtract(owner.allocated_bytes)
        kept = {d: num - base[d] for d, num in (after.allocated_bytes or {}).items()}
        if any(num > tolerance_bytes for num in kept.values()):
            after = self._gpu_state(collect=True)  # confirmed without cycles and cache
            kept = {d: num - base[d] for d, num in (after.allocated_bytes or {}).items()}
        memory = ParentMemory(
            kept_tensor_bytes={d: num for d, num in kept.items() if num > 0},
            driver_bytes=_driver_growth(before, after, kept),
            torch_in_use=after.allocated_bytes is not None,
            scopes=tuple(o.label for o in finished if o.allocated_bytes),
        )
        return memory, after


# --- helpers ------------------------------------------------------------------------------


def _made_by_stranger(name: str, roles: Mapping[int, Role]) -> bool:
    """Whether a live process that is not the test's made the file, as its name says."""
    creator = shm_creator_pid(name)
    if creator is None or creator <= 1 or creator in roles:
        return False
    return procs.pid_exists_here(creator)


def _driver_growth(before: GpuState, after: GpuState, kept: Mapping[int, int]) -> dict[int, int]:
    """NVML bytes of the test process above its start that the allocator does not explain.

    A device without a context at the start is left out (NOTE [first context]).
    """
    if before.nvml_bytes is None or after.nvml_bytes is None:
        return {}
    start = before.nvml_bytes
    growth = {d: num - start[d] for d, num in after.nvml_bytes.items() if d in start}
    if after.allocated_bytes is not None:
        # Cached blocks and tensors already counted as kept are not the driver's.
        reserved, reserved_start = after.reserved_bytes or {}, before.reserved_bytes or {}
        for d in growth:
            cached = max(reserved.get(d, 0) - reserved_start.get(d, 0), 0)
            growth[d] -= cached + max(kept.get(d, 0), 0)
    return {d: num for d, num in growth.items() if num > 0}
