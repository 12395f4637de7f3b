"""The per-test leak check of the pytest plugin, without pytest: snapshots, attribution, culprits.

One ``Checker`` lives per pytest process that runs tests. For each checked test it takes a
cheap snapshot before the setup phase (``begin``) and judges after the teardown phase
(``judge``); in between, fixtures of a wider scope report what they started
(``fixture_begin``/``fixture_end``/``fixture_finished``).

NOTE [cheap snapshots]: a clean test must cost well under a millisecond, so the snapshot is
the last PID handed out (one small read of ``/proc/loadavg``) and ``listdir('/dev/shm')``
(plus, where CUDA or NVML is already in use, the allocator counters and one NVML process
list). PIDs are handed out in increasing order, so when the last PID did not move, no process
was started at all and nothing else is read; when it moved, one ``listdir('/proc')`` gives
the PIDs in between, the only candidates. Only those are read, and only the few that turn
out to be ours are waited on. Where /proc/loadavg cannot be read, two listings are compared.

NOTE [whose process]: a new process belongs to the test when the test process is its
ancestor now, when its initial environment carries the test's ``LEAKCHECK_SESSION`` tag
(every child that execs inherits it, even after it was reparented away), or when it has the
test process's initial environment and command line byte for byte (a forked child whose
forking parent already exited: it never exec'd, so it carries no tag).

NOTE [scopes]: what leaks is what outlives the scope that created it. Processes, /dev/shm
segments and allocator bytes that appear while a class/module/package/session fixture is set
up belong to that fixture instance, not to the test that happened to trigger it; they are
left alone until the fixture's finalizer ran, and then judged within the test whose teardown
ran it. A wide-scope fixture that starts processes lazily, later, inside a test is not seen
as their owner: those processes are the test's.

NOTE [first context]: the first CUDA context of a process (and the driver memory of the
libraries it loads on first use) is a baseline, not a leak: the torch allocator is the judge
of tensors a test keeps; memory the driver shows for the test process beyond the allocator
only fails a test when torch is not the one using CUDA here.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from leakcheck import nvml, procs
from leakcheck.errors import LeakCheckError
from leakcheck.model import ProcInfo, Severity
from leakcheck.procs import SESSION_ENV
from leakcheck.torch_state import initialized_cuda
from leakcheck.units import format_mib, shorten_cmdline

if TYPE_CHECKING:
    from leakcheck.model import Finding
    from leakcheck.nvml import Nvml

CulpritKind = Literal["process", "shm", "memory", "tracker", "error"]

SHM_DIR = "/dev/shm"

SESSION_HELPERS: tuple[str, ...] = (
    "multiprocessing.resource_tracker",
    "multiprocessing.semaphore_tracker",
    "multiprocessing.forkserver",
    "loky.backend.resource_tracker",
    "loky.backend.popen_loky_posix",
    "torch_shm_manager",
    "torch._inductor.compile_worker",
)
"""Command-line fragments of helper processes a library starts once and keeps for the rest of
the process, by design (multiprocessing's resource tracker and fork server, joblib's reusable
executor, torch's shared-memory manager and compile workers). Like the first CUDA context,
they are a baseline, not a leak, unless they hold GPU memory or ``/dev/nvidia*``
descriptors."""

_CREATE_TIME_SLACK_S = 2.0
"""Create times have clock-tick resolution, and the boot time they add to is whole seconds."""

_NUMBER_TOKEN = re.compile(r"^[0-9]{2,9}$")
_TOKEN_SPLIT = re.compile(r"[^0-9A-Za-z]+")
_CREATOR_PID = re.compile(r"^torch_([0-9]+)_")
"""Segment names that start with their creator's PID (torch's file_system sharing)."""

REMEDY_SURVIVOR = (
    "stop what the test starts before it returns (proc.wait()/kill(), Process.join(), "
    "`with Pool(...)`, close DataLoader iterators), or own it in a fixture that stops it"
)
REMEDY_ORPHAN = (
    "the process outlived its parent: stop children before their parent exits (kill the "
    "process group, or leakcheck.worker_init_fn for DataLoader workers: PR_SET_PDEATHSIG)"
)
REMEDY_SCOPE = "stop it in the fixture's finalizer (after its `yield`, or request.addfinalizer)"
REMEDY_SHM = (
    "unlink the shared memory the test creates (SharedMemory.unlink(), or let DataLoader "
    "workers shut down so they remove theirs)"
)
REMEDY_MEMORY = (
    "drop references to CUDA tensors the test creates (module-level lists, caches, globals, "
    "stored exceptions) or free them in a fixture finalizer"
)
REMEDY_DRIVER = (
    "free what the test allocates on the GPU outside torch (library memory pools, raw "
    "allocations); one-time library loading counts here too: raise --gpu-leak-tolerance"
)


@dataclass(frozen=True)
class Culprit:
    """One thing a test left behind (or one thing worth knowing), as the plugin reports it.

    Attributes:
        kind: ``process``, ``shm`` (a /dev/shm segment), ``memory`` (GPU memory of the test
            process), ``tracker`` (a finding of the ``gpu_leak_tracker`` fixture) or
            ``error`` (leakcheck could not check; never fails a test).
        rule: ``survivor``, ``orphan``, ``shm``, ``residual`` or the tracker's rule.
        severity: ``leak`` fails (or warns about) the test; ``info`` is only reported.
        message: One line naming the culprit and what it holds.
        remedy: One line on what to do.
        pid: Culprit PID, if a process.
        create_time: With ``pid``, its identity.
        role: ``parent`` (the test process), ``descendant`` or ``orphan``.
        cmdline: Command line (shortened).
        gpu_bytes_by_device: GPU memory per device index.
        nvidia_fds: Open ``/dev/nvidia*`` descriptors, if known.
        shm_name: Segment name for ``shm``.
        size_bytes: Segment size for ``shm``.
        owner: The fixture scope that created it, if not the test itself.

    """

    kind: CulpritKind
    rule: str
    severity: Severity
    message: str
    remedy: str
    pid: int | None = None
    create_time: float | None = None
    role: str | None = None
    cmdline: str | None = None
    gpu_bytes_by_device: Mapping[int, int] = field(default_factory=dict)
    nvidia_fds: int | None = None
    shm_name: str | None = None
    size_bytes: int | None = None
    owner: str | None = None

    @property
    def gpu_bytes(self) -> int:
        """GPU memory summed over devices."""
        return sum(self.gpu_bytes_by_device.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (travels from xdist workers to the controller)."""
        data: dict[str, Any] = {
            "kind": self.kind,
            "rule": self.rule,
            "severity": self.severity,
            "message": self.message,
            "remedy": self.remedy,
        }
        optional: dict[str, Any] = {
            "pid": self.pid,
            "create_time": self.create_time,
            "role": self.role,
            "cmdline": self.cmdline,
            "nvidia_fds": self.nvidia_fds,
            "shm_name": self.shm_name,
            "size_bytes": self.size_bytes,
            "owner": self.owner,
        }
        data.update({key: value for key, value in optional.items() if value is not None})
        if self.gpu_bytes_by_device:
            data["gpu_bytes_by_device"] = {
                str(index): num for index, num in sorted(self.gpu_bytes_by_device.items())
            }
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Culprit:
        """Read back ``to_dict``'s output."""
        by_device = data.get("gpu_bytes_by_device") or {}
        severity: Severity = "leak" if data.get("severity") == "leak" else "info"
        kind = str(data.get("kind", "error"))
        kinds: tuple[CulpritKind, ...] = ("process", "shm", "memory", "tracker", "error")
        return cls(
            kind=next((k for k in kinds if k == kind), "error"),
            rule=str(data.get("rule", "")),
            severity=severity,
            message=str(data.get("message", "")),
            remedy=str(data.get("remedy", "")),
            pid=data.get("pid"),
            create_time=data.get("create_time"),
            role=data.get("role"),
            cmdline=data.get("cmdline"),
            gpu_bytes_by_device={int(k): int(v) for k, v in by_device.items()},
            nvidia_fds=data.get("nvidia_fds"),
            shm_name=data.get("shm_name"),
            size_bytes=data.get("size_bytes"),
            owner=data.get("owner"),
        )

    @classmethod
    def from_finding(cls, finding: Finding) -> Culprit:
        """Wrap a finding of the ``gpu_leak_tracker`` fixture's report."""
        by_device: dict[int, int] = {}
        if finding.gpu_bytes is not None:
            by_device[finding.device_index if finding.device_index is not None else -1] = (
                finding.gpu_bytes
            )
        return cls(
            kind="tracker",
            rule=finding.rule,
            severity=finding.severity,
            message=finding.message,
            remedy=finding.remedy,
            pid=finding.pid,
            create_time=finding.create_time,
            role=finding.role,
            cmdline=finding.cmdline,
            gpu_bytes_by_device=by_device,
            nvidia_fds=finding.nvidia_fds,
        )


# --- snapshots ----------------------------------------------------------------------------


def last_pid() -> int | None:
    """The PID most recently handed out in this PID namespace (last field of /proc/loadavg).

    None where the file is missing or unreadable.
    """
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return int(os.read(fd, 256).split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def list_pids() -> frozenset[str]:
    """Entries of /proc: one ``listdir``, nothing read, nothing parsed (empty without /proc)."""
    try:
        return frozenset(os.listdir("/proc"))
    except OSError:
        return frozenset()


@dataclass(frozen=True)
class PidMark:
    """Where PID allocation stood at one moment (see NOTE [cheap snapshots]).

    Attributes:
        last_pid: The last PID handed out; None where unknown (then ``names`` is used).
        names: /proc entries, only when ``last_pid`` is None.
        unix_s: Wall-clock time of the mark.

    """

    last_pid: int | None
    names: frozenset[str]
    unix_s: float


def pid_mark() -> PidMark:
    """Mark the moment: one small read of /proc/loadavg (or one listdir where it fails)."""
    last = last_pid()
    return PidMark(last, frozenset() if last is not None else list_pids(), time.time())


def pids_since(mark: PidMark) -> list[int]:
    """PIDs of processes that may have started since ``mark``, oldest allocation first.

    PIDs are handed out in increasing order, wrapping at ``pid_max``: the new ones are those
    between the two marks. When nothing was handed out meanwhile, nothing is read at all.
    After a wrap-around an older process may fall in the range too: callers compare create
    times with ``mark.unix_s``.
    """
    now = last_pid()
    if mark.last_pid is None or now is None:
        after = list_pids()
        return sorted(int(name) for name in after - mark.names if name.isdigit())
    if now == mark.last_pid:
        return []
    start = mark.last_pid
    found: list[int] = []
    for name in list_pids():
        if not name.isdigit():
            continue
        pid = int(name)
        if (start < pid <= now) if now > start else (pid > start or pid <= now):
            found.append(pid)
    # Allocation order, so that a parent is seen before its children.
    found.sort(key=lambda pid: (pid <= start, pid))
    return found


def list_shm(directory: str = SHM_DIR) -> frozenset[str]:
    """Names in the shared-memory directory (empty when it does not exist)."""
    try:
        return frozenset(os.listdir(directory))
    except OSError:
        return frozenset()


def _allocated_now() -> dict[int, int] | None:
    """Allocated bytes per device of this process's torch allocator; None: not known."""
    cuda = initialized_cuda()
    if cuda is None:
        return None
    try:
        return _allocator_bytes(cuda, collect=False)[0]
    except Exception:
        return None


def _allocator_bytes(cuda: Any, *, collect: bool) -> tuple[dict[int, int], dict[int, int]]:
    """(allocated, reserved) bytes per device of the torch allocator in this process."""
    if collect:
        # Cycles may be all that keeps a tensor alive; the cache holds freed blocks that
        # NVML still counts. Both are worth their cost only when a leak is suspected.
        gc.collect()
        # cuBLAS keeps a workspace per handle and stream in torch's allocator after the
        # first matrix product (32 MiB on an H200): a one-time library cost, not the test's.
        torch_c = getattr(sys.modules.get("torch"), "_C", None)
        clear_workspaces = getattr(torch_c, "_cuda_clearCublasWorkspaces", None)
        if callable(clear_workspaces):
            clear_workspaces()
        cuda.empty_cache()
    allocated: dict[int, int] = {}
    reserved: dict[int, int] = {}
    for index in range(int(cuda.device_count())):
        allocated[index] = int(cuda.memory_allocated(index))
        reserved[index] = int(cuda.memory_reserved(index))
    return allocated, reserved


@dataclass(frozen=True)
class GpuState:
    """GPU memory of the test process at one moment (None: not known here).

    Attributes:
        nvml_bytes: Driver view (NVML) per device; a device without a context is absent.
        allocated_bytes: torch allocator, live tensors per device.
        reserved_bytes: torch allocator, reserved (cached) per device.

    """

    nvml_bytes: Mapping[int, int] | None = None
    allocated_bytes: Mapping[int, int] | None = None
    reserved_bytes: Mapping[int, int] | None = None


_NO_GPU_STATE = GpuState()


@dataclass
class ScopeOwner:
    """What one wide-scope fixture instance started while it was set up.

    Attributes:
        label: ``module-scoped fixture 'pool'``.
        window_serial: Serial of the test window it was set up in.
        processes: Our processes that appeared during its setup.
        shm: /dev/shm names that appeared during its setup.
        allocated_bytes: Allocator bytes per device it added during its setup.

    """

    label: str
    window_serial: int
    processes: tuple[ProcInfo, ...] = ()
    shm: frozenset[str] = frozenset()
    allocated_bytes: Mapping[int, int] = field(default_factory=dict)


@dataclass
class FixtureProbe:
    """Snapshot taken before a wide-scope fixture's setup (see ``Checker.fixture_begin``)."""

    pids: PidMark
    shm: frozenset[str]
    allocated_bytes: Mapping[int, int] | None


@dataclass
class Window:
    """One checked test, from before its setup to after its teardown.

    Attributes:
        serial: Increasing number of the window in this process.
        tags: Every tag in use during the test: the window's own, which the test's children
            inherit as ``LEAKCHECK_SESSION``, and those of trackers it ran.
        pids: PID allocation before the setup.
        shm: /dev/shm names before the setup.
        gpu: GPU memory of the test process before the setup.
        saved_env: The tag variable's previous value (None: unset).
        extra: Culprits added during the test (tracker findings).

    """

    serial: int
    tags: set[str]
    pids: PidMark
    shm: frozenset[str]
    gpu: GpuState
    saved_env: str | None
    extra: list[Culprit] = field(default_factory=list)


class Checker:
    """Per-process state of the plugin's leak check.

    Args:
        shm_dir: The shared-memory directory.
        attribute_unheld_shm: Blame a new, unheld /dev/shm segment on the test that ran while
            it appeared. True when no other test runs concurrently (no xdist): under xdist a
            sibling worker may have created it.

    """

    def __init__(
        self,
        *,
        shm_dir: str = SHM_DIR,
        attribute_unheld_shm: bool = True,
    ) -> None:
        self.pid = os.getpid()
        self.shm_dir = shm_dir
        self.attribute_unheld_shm = attribute_unheld_shm
        self._nvml: Nvml | None = None
        self._nvml_checked = False
        self.gpu_note = "NVML not consulted"
        self._serial = 0
        self._owners: dict[object, ScopeOwner] = {}
        self._finished: list[ScopeOwner] = []
        self._self_environ: bytes | None = None
        self._create_time: float | None = None
        self._self_cmdline: bytes | None = None

    # -- GPU -----------------------------------------------------------------------------

    def _nvml_handle(self) -> Nvml | None:
        if not self._nvml_checked:
            self._nvml_checked = True
            ok, reason = nvml.availability()
            if not ok:
                self.gpu_note = reason or "NVML unavailable"
            elif procs.pid_namespace_nested():
                # NVML reports host PIDs: none would match ours, so per-PID memory is blind.
                self.gpu_note = (
                    "NVML PIDs are not this PID namespace's (container without --pid=host): "
                    "GPU memory of processes is not attributed"
                )
            else:
                self._nvml = nvml.get()
                self.gpu_note = "NVML"
        return self._nvml

    def _nvml_by_pid(self) -> dict[int, dict[int, int]]:
        handle = self._nvml_handle()
        if handle is None:
            return {}
        try:
            entries = handle.processes()
        except LeakCheckError as exc:
            self.gpu_note = f"NVML failed: {exc}"
            return {}
        by_pid: dict[int, dict[int, int]] = {}
        for entry in entries:
            per_device = by_pid.setdefault(entry.pid, {})
            per_device[entry.device_index] = entry.used_gpu_bytes or 0
        return by_pid

    def gpu_state(self, *, collect: bool = False) -> GpuState:
        """GPU memory of this process now (NVML view and torch allocator)."""
        nvml_bytes: dict[int, int] | None = None
        if self._nvml_handle() is not None:
            nvml_bytes = self._nvml_by_pid().get(self.pid, {})
        cuda = initialized_cuda()
        if cuda is None:
            return _NO_GPU_STATE if nvml_bytes is None else GpuState(nvml_bytes=nvml_bytes)
        try:
            allocated, reserved = _allocator_bytes(cuda, collect=collect)
        except Exception:
            return GpuState(nvml_bytes=nvml_bytes)
        return GpuState(nvml_bytes, allocated, reserved)

    # -- windows -------------------------------------------------------------------------

    def begin(self) -> Window:
        """Snapshot before the test's setup and export its tag to the children it starts."""
        self._serial += 1
        tag = f"pytest-{self.pid}-{self._serial}"
        saved = os.environ.get(SESSION_ENV)
        window = Window(
            serial=self._serial,
            tags={tag},
            pids=pid_mark(),
            shm=list_shm(self.shm_dir),
            gpu=self.gpu_state(),
            saved_env=saved,
        )
        os.environ[SESSION_ENV] = tag
        return window

    def end_environment(self, window: Window) -> None:
        """Give the tag variable back its value from before the test."""
        if window.saved_env is None:
            os.environ.pop(SESSION_ENV, None)
        else:
            os.environ[SESSION_ENV] = window.saved_env

    # -- scopes --------------------------------------------------------------------------

    def fixture_begin(self) -> FixtureProbe:
        """Snapshot before a wide-scope fixture's setup."""
        return FixtureProbe(
            pids=pid_mark(),
            shm=list_shm(self.shm_dir),
            allocated_bytes=_allocated_now(),
        )

    def fixture_end(
        self, key: object, probe: FixtureProbe, label: str, window: Window
    ) -> ScopeOwner:
        """Record what appeared during a wide-scope fixture's setup as that fixture's own."""
        claimed: set[int] = set()
        for owner in self._owners.values():
            claimed.update(info.key.pid for info in owner.processes)
        new_pids = [pid for pid in pids_since(probe.pids) if pid not in claimed]
        processes = tuple(self._ours(new_pids, window, since_unix_s=probe.pids.unix_s))
        claimed_shm: set[str] = set()
        for owner in self._owners.values():
            claimed_shm.update(owner.shm)
        shm = list_shm(self.shm_dir) - probe.shm - claimed_shm
        now = _allocated_now() or {}
        before = probe.allocated_bytes or {}
        added = {d: now[d] - before.get(d, 0) for d in now if now[d] > before.get(d, 0)}
        owner = ScopeOwner(label, window.serial, processes, frozenset(shm), added)
        self._owners[key] = owner
        return owner

    def fixture_finished(self, key: object, *, judge: bool = True) -> None:
        """A wide-scope fixture's finalizer ran: judge what it owned with the current test.

        With ``judge=False`` (no test is being checked) what it owned is forgotten.
        """
        owner = self._owners.pop(key, None)
        if owner is not None and judge:
            self._finished.append(owner)

    def active_owners(self) -> list[ScopeOwner]:
        """Wide-scope fixture instances set up and not finished."""
        return list(self._owners.values())

    # -- attribution ---------------------------------------------------------------------

    def _self_identity(self) -> tuple[bytes | None, bytes | None]:
        if self._self_environ is None:
            self._self_environ = _read_bytes(f"/proc/{self.pid}/environ")
            self._self_cmdline = _read_bytes(f"/proc/{self.pid}/cmdline")
        return self._self_environ, self._self_cmdline

    def _ours(self, pids: Iterable[int], window: Window, *, since_unix_s: float) -> list[ProcInfo]:
        """The processes among ``pids`` that belong to this test (NOTE [whose process]).

        Processes started before ``since_unix_s`` (with a tick of slack) are not new: an
        older PID can fall in the new range after PID numbers wrapped around.
        """
        found: list[ProcInfo] = []
        for pid in pids:
            info = procs.read_proc(pid)
            if info is None or info.key.create_time < since_unix_s - _CREATE_TIME_SLACK_S:
                continue
            if self._descends_from_here(info):
                found.append(info)
                continue
            tag = procs.tagged_session(pid)
            if tag is not None and tag in window.tags:
                found.append(ProcInfo(info.key, info.ppid, info.name, info.cmdline, True))
                continue
            if tag is None and self._forked_from_here(info):
                found.append(info)
        return found

    def _descends_from_here(self, info: ProcInfo) -> bool:
        """Whether the test process is an ancestor of ``info`` now.

        The walk stops at the first ancestor older than the test process: no descendant of
        it can be. A stranger's process (another job's, a sibling xdist worker's) costs a
        read or two, not a walk to PID 1.
        """
        if self._create_time is None:
            key = procs.process_key(self.pid)
            self._create_time = key.create_time if key is not None else 0.0
        ppid = info.ppid
        for _ in range(64):
            if ppid == self.pid:
                return True
            if ppid <= 1:
                return False
            parent = procs.read_proc(ppid, with_cmdline=False)
            if parent is None or parent.key.create_time < self._create_time:
                return False
            ppid = parent.ppid
        return False

    def _looks_like_here(self, pid: int) -> bool:
        environ, cmdline = self._self_identity()
        if not environ or not cmdline:
            return False
        return (
            _read_bytes(f"/proc/{pid}/cmdline") == cmdline
            and _read_bytes(f"/proc/{pid}/environ") == environ
        )

    def _forked_from_here(self, info: ProcInfo) -> bool:
        """A reparented fork of this process: same command line and initial environment.

        Twins started alike (xdist workers, exec'd by one controller with one environment)
        look the same, and so do their forks, for a moment before they exec: a process
        whose live parent looks like this process too is a twin's, not ours (a fork of
        ours whose parent died has PID 1 or a subreaper for parent, which looks different).
        """
        if not self._looks_like_here(info.key.pid):
            return False
        parent = info.ppid
        return parent <= 1 or parent == self.pid or not self._looks_like_here(parent)

    # -- the verdict ---------------------------------------------------------------------

    def judge(self, window: Window, *, tolerance_bytes: int, grace_s: float) -> list[Culprit]:
        """Judge one test after its teardown: what it left, worst first.

        Args:
            window: From ``begin``.
            tolerance_bytes: GPU memory the test may keep.
            grace_s: How long a leftover process may take to exit.

        Returns:
            Culprits (leaks and infos); empty for a clean test.

        """
        culprits: list[Culprit] = []
        finished = self._finished
        self._finished = []
        active = self.active_owners()

        # Processes: new ones that are ours, plus those of wide-scope fixtures that ended.
        owned_now = {info.key.pid for owner in active for info in owner.processes}
        new_pids = [pid for pid in pids_since(window.pids) if pid not in owned_now]
        candidates: list[tuple[ProcInfo, ScopeOwner | None]] = [
            (info, None) for info in self._ours(new_pids, window, since_unix_s=window.pids.unix_s)
        ]
        for ended in finished:
            # Dead ones drop out in _wait_for_exit's first pass.
            candidates.extend((info, ended) for info in ended.processes)
        candidates = [(info, owner) for info, owner in candidates if info.key.pid != self.pid]

        # Session helpers are a baseline unless they pin the GPU (checked below, cheaply,
        # only for the rare helper that just appeared).
        survivors, helpers = _wait_for_exit(candidates, grace_s)
        gpu_by_pid = self._nvml_by_pid() if (survivors or helpers) else {}
        for info, owner in helpers:
            fds = procs.nvidia_fd_count(info.key.pid)
            if gpu_by_pid.get(info.key.pid) or fds:
                survivors.append((info, owner))
        for info, owner in survivors:
            culprits.append(self._process_culprit(info, owner, gpu_by_pid, grace_s))

        # /dev/shm: after the grace period, since exiting workers remove their own.
        culprits.extend(self._shm_culprits(window, active, finished, survivors))

        # GPU memory of the test process itself.
        culprits.extend(self._memory_culprits(window, active, finished, tolerance_bytes))

        # A tracker's finding about a process already named here says nothing new.
        named = {(c.pid, c.rule) for c in culprits if c.kind == "process"}
        culprits.extend(c for c in window.extra if (c.pid, c.rule) not in named)
        culprits.sort(key=_culprit_sort_key)
        return culprits

    def _process_culprit(
        self,
        info: ProcInfo,
        owner: ScopeOwner | None,
        gpu_by_pid: Mapping[int, Mapping[int, int]],
        grace_s: float,
    ) -> Culprit:
        pid = info.key.pid
        current = procs.read_proc(pid) or info
        lineage = self._descends_from_here(current)
        role = "descendant" if lineage else "orphan"
        gpu = dict(gpu_by_pid.get(pid, {}))
        fds = procs.nvidia_fd_count(pid)
        holding = _holding_text(gpu, fds)
        cmd = _short(current.cmdline or info.cmdline or current.name)
        if owner is not None:
            message = (
                f"PID {pid} started by {owner.label} is still alive after the fixture's "
                f"teardown{holding}: {cmd}"
            )
            remedy = REMEDY_SCOPE
        elif lineage:
            message = (
                f"PID {pid} started by the test is still alive {grace_s:g}s after its "
                f"teardown{holding}: {cmd}"
            )
            remedy = REMEDY_SURVIVOR
        else:
            how = "tagged" if info.tagged else "forked"
            message = (
                f"PID {pid} ({how} by the test, reparented to PID {current.ppid}) is still "
                f"alive {grace_s:g}s after its teardown{holding}: {cmd}"
            )
            remedy = REMEDY_ORPHAN
        return Culprit(
            kind="process",
            rule="survivor" if lineage else "orphan",
            severity="leak",
            message=message,
            remedy=remedy,
            pid=pid,
            create_time=info.key.create_time,
            role=role,
            cmdline=cmd,
            gpu_bytes_by_device=gpu,
            nvidia_fds=fds,
            owner=None if owner is None else owner.label,
        )

    def _shm_culprits(
        self,
        window: Window,
        active: Sequence[ScopeOwner],
        finished: Sequence[ScopeOwner],
        survivors: Sequence[tuple[ProcInfo, ScopeOwner | None]],
    ) -> list[Culprit]:
        now = list_shm(self.shm_dir)
        owned_active = {name for owner in active for name in owner.shm}
        fresh = now - window.shm - owned_active
        from_fixtures = {name: owner for owner in finished for name in owner.shm if name in now}
        if not fresh and not from_fixtures:
            return []
        lineage_pids = {self.pid} | {info.key.pid for info, _ in survivors}
        held_by: dict[str, int] = {}
        for pid, names in procs.shm_open_by(lineage_pids, self.shm_dir).items():
            for name in names:
                held_by.setdefault(name, pid)
        segments = procs.shm_segments(self.shm_dir)
        uid = os.getuid()
        culprits: list[Culprit] = []
        unresolved: list[str] = []
        blamed: list[str] = []
        for name in sorted(fresh | set(from_fixtures)):
            if name not in segments or _owner_uid(self.shm_dir, name) not in (uid, None):
                continue  # removed meanwhile, not a plain file, or another user's
            if name in from_fixtures or name in held_by or _embedded_pids(name) & lineage_pids:
                blamed.append(name)
                continue
            creator = _creator_pid(name)
            if creator is not None and _foreign_alive(creator, lineage_pids):
                continue  # created by a live process that is not ours
            unresolved.append(name)
        if unresolved:
            # Nobody of ours holds these. Held by a stranger (another job's semaphore, a
            # sibling worker's buffer): not ours. Held by nobody: created during the test
            # and abandoned, ours unless other tests ran at the same time. One scan of every
            # process, paid only when such a segment appeared.
            strangers = [int(n) for n in list_pids() if n.isdigit() and int(n) not in lineage_pids]
            held_elsewhere = {
                name
                for names in procs.shm_open_by(strangers, self.shm_dir).values()
                for name in names
            }
            for name in unresolved:
                if name in held_elsewhere or not os.path.exists(os.path.join(self.shm_dir, name)):
                    continue  # a stranger's, or one that was on its way out
                if name.startswith("sem."):
                    # A named semaphore's holders map it under a temporary name: "nobody
                    # holds it" means nothing here, and any process using multiprocessing
                    # (another pytest run, another job) makes them by the dozen.
                    continue
                if self.attribute_unheld_shm:
                    blamed.append(name)
                    continue
                size = segments[name].size_bytes
                culprits.append(
                    Culprit(
                        kind="shm",
                        rule="shm",
                        severity="info",
                        message=(
                            f"/dev/shm/{name} ({size_text(size)}) appeared during the test "
                            "and nobody holds it; other workers ran at the same time, so it "
                            "is not blamed on this test"
                        ),
                        remedy=REMEDY_SHM,
                        shm_name=name,
                        size_bytes=size,
                    )
                )
        for name in blamed:
            owner = from_fixtures.get(name)
            holder = held_by.get(name)
            size = segments[name].size_bytes
            if owner is not None:
                where = f"created while {owner.label} was set up, still there after its teardown"
            elif holder is not None:
                who = "the test process" if holder == self.pid else f"PID {holder}"
                where = f"created during the test and not removed; {who} still holds it"
            else:
                where = "created during the test and not removed; nobody holds it"
            culprits.append(
                Culprit(
                    kind="shm",
                    rule="shm",
                    severity="leak",
                    message=f"/dev/shm/{name} ({size_text(size)}) {where}",
                    remedy=REMEDY_SHM if owner is None else REMEDY_SCOPE,
                    pid=holder,
                    role=_holder_role(holder, self.pid),
                    shm_name=name,
                    size_bytes=size,
                    owner=None if owner is None else owner.label,
                )
            )
        return culprits

    def _memory_culprits(
        self,
        window: Window,
        active: Sequence[ScopeOwner],
        finished: Sequence[ScopeOwner],
        tolerance_bytes: int,
    ) -> list[Culprit]:
        before = window.gpu
        after = self.gpu_state()
        if after.allocated_bytes is None and after.nvml_bytes is None:
            return []
        # What wide-scope fixtures legitimately hold, by device (NOTE [scopes]): fixtures set
        # up during this test and still active add to the baseline; those set up earlier
        # and finished now take away from it.
        allowance: dict[int, int] = {}
        for owner in active:
            if owner.window_serial == window.serial:
                for device, num in owner.allocated_bytes.items():
                    allowance[device] = allowance.get(device, 0) + num
        released: dict[int, int] = {}
        for owner in finished:
            if owner.window_serial != window.serial:
                for device, num in owner.allocated_bytes.items():
                    released[device] = released.get(device, 0) + num

        culprits: list[Culprit] = []
        kept: dict[int, int] = {}
        if after.allocated_bytes is not None:
            kept = _excess(before.allocated_bytes, after.allocated_bytes, allowance, released)
            if any(num > tolerance_bytes for num in kept.values()):
                # Confirm after a collection and an emptied cache: cycles and cached blocks
                # are not leaks.
                after = self.gpu_state(collect=True)
                if after.allocated_bytes is not None:
                    kept = _excess(
                        before.allocated_bytes, after.allocated_bytes, allowance, released
                    )
            leaked = {d: num for d, num in kept.items() if num > tolerance_bytes}
            if leaked:
                owners = [o.label for o in finished if o.allocated_bytes]
                whose = f" (after the teardown of {', '.join(owners)})" if owners else ""
                culprits.append(
                    Culprit(
                        kind="memory",
                        rule="residual",
                        severity="leak",
                        message=(
                            f"the test process still holds {_devices_text(leaked)} of CUDA "
                            f"tensors{whose}, beyond the tolerance of "
                            f"{format_mib(tolerance_bytes)} MiB (torch allocator, after "
                            "gc.collect() and empty_cache())"
                        ),
                        remedy=REMEDY_MEMORY if not owners else REMEDY_SCOPE,
                        pid=self.pid,
                        role="parent",
                        gpu_bytes_by_device=leaked,
                        owner=", ".join(owners) or None,
                    )
                )
        if before.nvml_bytes is not None and after.nvml_bytes is not None:
            culprits.extend(self._driver_culprits(before, after, kept, tolerance_bytes))
        return culprits

    def _driver_culprits(
        self,
        before: GpuState,
        after: GpuState,
        kept: Mapping[int, int],
        tolerance_bytes: int,
    ) -> list[Culprit]:
        assert before.nvml_bytes is not None and after.nvml_bytes is not None
        torch_in_use = after.allocated_bytes is not None
        grown: dict[int, int] = {}
        for device, num in after.nvml_bytes.items():
            if device not in before.nvml_bytes:
                continue  # the first context on this device: a baseline (NOTE [first context])
            growth = num - before.nvml_bytes[device]
            if torch_in_use:
                # Cached blocks and tensors already judged above are not the driver's to blame.
                reserved_growth = (after.reserved_bytes or {}).get(device, 0) - (
                    before.reserved_bytes or {}
                ).get(device, 0)
                growth -= max(reserved_growth, 0) + max(kept.get(device, 0), 0)
            if growth > tolerance_bytes:
                grown[device] = growth
        if not grown:
            return []
        severity: Severity = "info" if torch_in_use else "leak"
        return [
            Culprit(
                kind="memory",
                rule="residual",
                severity=severity,
                message=(
                    f"the driver shows the test process holding {_devices_text(grown)} more "
                    "than before the test, outside torch's allocator"
                    + (
                        " (libraries loading kernels on first use look like this)"
                        if torch_in_use
                        else ""
                    )
                ),
                remedy=REMEDY_DRIVER,
                pid=self.pid,
                role="parent",
                gpu_bytes_by_device=grown,
            )
        ]


# --- helpers ------------------------------------------------------------------------------


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def _owner_uid(directory: str, name: str) -> int | None:
    try:
        return os.stat(os.path.join(directory, name), follow_symlinks=False).st_uid
    except OSError:
        return None


def _holder_role(holder: int | None, test_pid: int) -> str | None:
    if holder is None:
        return None
    return "parent" if holder == test_pid else "descendant"


def _is_session_helper(cmdline: str) -> bool:
    return any(fragment in cmdline for fragment in SESSION_HELPERS)


def _embedded_pids(name: str) -> set[int]:
    """Whole numeric tokens of a segment name (``x_1234_y`` -> {1234}): PIDs, maybe."""
    return {int(token) for token in _TOKEN_SPLIT.split(name) if _NUMBER_TOKEN.match(token)}


def _creator_pid(name: str) -> int | None:
    """The creator PID of a segment whose naming scheme says so, else None."""
    match = _CREATOR_PID.match(name)
    return int(match.group(1)) if match else None


def _foreign_alive(pid: int, ours: set[int]) -> bool:
    return pid not in ours and pid > 1 and os.path.exists(f"/proc/{pid}")


def _wait_for_exit(
    candidates: list[tuple[ProcInfo, ScopeOwner | None]], grace_s: float
) -> tuple[list[tuple[ProcInfo, ScopeOwner | None]], list[tuple[ProcInfo, ScopeOwner | None]]]:
    """Poll until every candidate exited or ``grace_s`` passed; split off session helpers.

    Returns ``(survivors, helpers)``. The command line is read again at each poll: a child
    caught between fork and exec shows its parent's (or an empty) command line for a moment,
    and a session helper must be recognised before it costs a grace period. Cheap when
    there is nothing to wait for: one liveness read per candidate.
    """
    deadline = time.monotonic() + grace_s
    pending = candidates
    helpers: list[tuple[ProcInfo, ScopeOwner | None]] = []
    delay = 0.005
    while True:
        still: list[tuple[ProcInfo, ScopeOwner | None]] = []
        for info, owner in pending:
            if not procs.is_alive(info.key):
                continue
            current = procs.read_proc(info.key.pid)
            if current is not None and current.cmdline:
                info = ProcInfo(info.key, current.ppid, current.name, current.cmdline, info.tagged)
            if _is_session_helper(info.cmdline):
                helpers.append((info, owner))
            else:
                still.append((info, owner))
        pending = still
        remaining = deadline - time.monotonic()
        if not pending or remaining <= 0:
            return pending, helpers
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.1)


def _excess(
    before: Mapping[int, int] | None,
    after: Mapping[int, int],
    allowance: Mapping[int, int],
    released: Mapping[int, int],
) -> dict[int, int]:
    base = before or {}
    return {
        device: num - (base.get(device, 0) + allowance.get(device, 0) - released.get(device, 0))
        for device, num in after.items()
    }


def _devices_text(by_device: Mapping[int, int]) -> str:
    parts = [f"{format_mib(num)} MiB on GPU {device}" for device, num in sorted(by_device.items())]
    return ", ".join(parts)


def _holding_text(gpu: Mapping[int, int], fds: int | None) -> str:
    parts: list[str] = []
    if any(gpu.values()):
        parts.append(_devices_text({d: n for d, n in gpu.items() if n}))
    elif gpu:
        parts.append(f"a CUDA context on GPU {', '.join(str(d) for d in sorted(gpu))}")
    if fds:
        parts.append(f"{fds} /dev/nvidia* descriptors")
    return f", holding {' and '.join(parts)}" if parts else ""


def _short(cmdline: str, width: int = 160) -> str:
    return shorten_cmdline(cmdline, width)


def _culprit_sort_key(culprit: Culprit) -> tuple[int, int, int, str]:
    return (
        0 if culprit.severity == "leak" else 1,
        -culprit.gpu_bytes,
        -(culprit.nvidia_fds or 0),
        culprit.message,
    )


# --- rendering ----------------------------------------------------------------------------


def size_text(num_bytes: int | None) -> str:
    """Bytes for people: MiB from 1 MiB up, else KiB or bytes."""
    if num_bytes is None:
        return "?"
    if num_bytes >= 1024 * 1024:
        return f"{format_mib(num_bytes)} MiB"
    if num_bytes >= 1024:
        return f"{num_bytes / 1024:.0f} KiB"
    return f"{num_bytes} B"


def culprit_line(culprit: Culprit, *, test_pid: int | None = None) -> str:
    """One line: which rule, who, how much."""
    if culprit.kind == "shm":
        holder = ""
        if culprit.pid is not None:
            parent = culprit.role == "parent" or culprit.pid == test_pid
            who = "the test process" if parent else f"PID {culprit.pid}"
            holder = f"  held by {who}"
        what = f"/dev/shm/{culprit.shm_name}  {size_text(culprit.size_bytes)}{holder}"
    elif culprit.pid is not None:
        what = f"PID {culprit.pid}  {culprit.role or '?'}"
        if culprit.gpu_bytes_by_device:
            what += "  " + ", ".join(
                f"GPU{d if d >= 0 else '?'} {format_mib(n)} MiB"
                for d, n in sorted(culprit.gpu_bytes_by_device.items())
            )
        if culprit.nvidia_fds:
            what += f"  {culprit.nvidia_fds} nvidia fds"
        if culprit.cmdline and culprit.kind != "memory":
            what += f"  `{culprit.cmdline}`"
        if culprit.owner:
            what += f"  (from {culprit.owner})"
    else:
        what = culprit.message
    severity = "" if culprit.severity == "leak" else ", info"
    return f"[{culprit.rule}{severity}] {what}"


def headline(culprits: Sequence[Culprit]) -> str:
    """What a test left, counted by kind: ``1 process, 1 /dev/shm segment (512 MiB GPU)``."""
    counts: dict[str, int] = {}
    for culprit in culprits:
        counts[culprit.kind] = counts.get(culprit.kind, 0) + 1
    words = {
        "process": ("process", "processes"),
        "shm": ("/dev/shm segment", "/dev/shm segments"),
        "memory": ("GPU memory excess", "GPU memory excesses"),
        "tracker": ("tracker finding", "tracker findings"),
        "error": ("check error", "check errors"),
    }
    parts = [
        f"{num} {words[kind][0] if num == 1 else words[kind][1]}" for kind, num in counts.items()
    ]
    gpu = sum(c.gpu_bytes for c in culprits)
    extra = f" ({format_mib(gpu)} MiB GPU)" if gpu else ""
    return f"{', '.join(parts) or 'nothing'}{extra}"


def format_section(culprits: Sequence[Culprit], *, test_pid: int | None = None) -> str:
    """The ``gpu-leak-check`` report section: each culprit, why, and a one-line remedy."""
    lines: list[str] = []
    for culprit in culprits:
        lines.append(culprit_line(culprit, test_pid=test_pid))
        lines.append(f"    {culprit.message}")
        lines.append(f"    remedy: {culprit.remedy}")
    return "\n".join(lines)


def summary_sort_key(culprits: Sequence[Culprit]) -> tuple[int, int, int]:
    """Worst first: more GPU memory, then more leaks, then more infos."""
    leaks = [c for c in culprits if c.severity == "leak"]
    return (-sum(c.gpu_bytes for c in leaks), -len(leaks), -len(culprits))


__all__ = [
    "SESSION_HELPERS",
    "Checker",
    "Culprit",
    "FixtureProbe",
    "GpuState",
    "PidMark",
    "ScopeOwner",
    "Window",
    "culprit_line",
    "format_section",
    "headline",
    "last_pid",
    "list_pids",
    "list_shm",
    "pid_mark",
    "pids_since",
    "size_text",
    "summary_sort_key",
]
