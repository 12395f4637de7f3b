"""Plain data shared by every layer: frozen dataclasses with units in their field names.

They are the JSON schema too (``core/records.py``): fields may be added, never renamed. The
tracker folds ``readings.py``'s records into a ``Timeline`` of ``EpochRecord``; ``verdict``
turns it into ``Finding``; ``report`` renders both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from leakcheck.core.readings import MIB as MIB
from leakcheck.core.readings import AccountedProcess as AccountedProcess
from leakcheck.core.readings import DeviceState as DeviceState
from leakcheck.core.readings import GpuProcess as GpuProcess
from leakcheck.core.readings import ProcessKey as ProcessKey
from leakcheck.core.readings import ProcInfo as ProcInfo
from leakcheck.core.readings import Role as Role

Rule = Literal[
    "survivor",
    "orphan",
    "growth",
    "residual",
    "blind",
    "descriptor-holder",
    "context-kept",
    "high-clocks",
    "tracker-failure",
    "shm",
    "host-growth",
    "device-mismatch",
    "copy-on-read",
    "died",
    "fd-pressure",
    "hang",
    "pinned-growth",
    "shutdown-hang",
]
Severity = Literal["leak", "info"]


@dataclass(frozen=True)
class RankInfo:
    """Where a process stands in a distributed job: torchrun's variables (None: not set).

    ``device``: the GPU (NVML index) it trains on, its ``set_device`` where recorded, else its
    ``LOCAL_RANK``'s through ``CUDA_VISIBLE_DEVICES``.
    """

    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    node_rank: int | None = None
    run_id: str | None = None
    restart_count: int | None = None
    device: int | None = None


PeakSource = Literal["reported", "sampled", "unknown"]

HostSource = Literal["uss", "rss"]  # private pages (smaps_rollup), else resident (status)


@dataclass(frozen=True)
class ProcessEpoch:
    """What one process did during one epoch; None in a field means not known.

    ``*_end`` fields are read at the epoch's end, or for a process that exited in it taken
    from its own report at exit (a worker's teardown record).

    Attributes:
        gpu_bytes_peak: Per device, the larger of what was sampled and what it reported.
        gpu_peak_source: ``reported`` (its teardown report, or the driver's accounting),
            ``sampled`` (a lower bound) or ``unknown`` (it exited unseen and unreported: not 0).
        scope: What started it when not the work itself (``module-scoped fixture 'pool'``).
        host_bytes_end: USS where read, else RSS (``host_source``; an older USS is never
            carried over). ``anon_bytes_end``: ``RssAnon``; ``rss_bytes_peak``: ``VmHWM``.
        freed_by_gc: It exited only once leakcheck collected garbage (a reference cycle
            kept its DataLoader iterator alive).
        forked: A worker started by fork; None where it did not report its birth.
        shared_bytes_birth: Its ``Shared_Dirty`` at its birth report, as
            ``private_bytes_birth`` its USS (NOTE [copy on read] in hostmem.py).
        copied_bytes_end: What it had copied of its parent's memory since its birth, at the
            epoch's last reading; ``copied_bytes_peak`` the most any reading showed.

    """

    key: ProcessKey
    role: Role
    ppid: int
    cmdline: str
    born_in_epoch: bool
    persistent: bool
    alive_at_end: bool
    exited_after_s: float | None = None
    last_seen_after_s: float | None = None
    gpu_bytes_end: Mapping[int, int] = field(default_factory=dict)
    gpu_bytes_peak: Mapping[int, int] = field(default_factory=dict)
    gpu_peak_source: PeakSource = "sampled"
    gpu_bytes_unknown: bool = False
    nvidia_fds: int | None = None
    open_fds: int | None = None
    fd_limit: int | None = None
    scope: str | None = None
    host_bytes_end: int | None = None
    host_source: HostSource | None = None
    pss_bytes_end: int | None = None
    rss_bytes_end: int | None = None
    anon_bytes_end: int | None = None
    rss_bytes_peak: int | None = None
    freed_by_gc: bool = False
    rank: int | None = None
    rank_device: int | None = None
    born_epoch: int | None = None
    forked: bool | None = None
    private_bytes_birth: int | None = None
    shared_bytes_birth: int | None = None
    shared_bytes_end: int | None = None
    copied_bytes_end: int | None = None
    copied_bytes_peak: int | None = None
    copied_over_after_s: float | None = None

    @property
    def total_gpu_bytes_end(self) -> int:
        """Sum over devices at the end of the epoch."""
        return sum(self.gpu_bytes_end.values())

    @property
    def total_gpu_bytes_peak(self) -> int | None:
        """Sum over devices of the per-device peaks; None when the peak is unknown."""
        if self.gpu_peak_source == "unknown":
            return None
        return sum(self.gpu_bytes_peak.values())


EndReason = Literal["completed", "break", "exception", "interrupt", "collected", "closed"]


@dataclass(frozen=True)
class EpochRecord:
    """One epoch: every process of the job, the devices and ``/dev/shm`` at its end.

    ``shm_used_peak_bytes``: the highest use of ``/dev/shm`` in the epoch (removed but held
    files included): what runs out when workers die of a bus error.
    ``pinned_allocated_bytes``, ``pinned_reserved_bytes``: the loop's process's pinned host
    memory at the end, in use and held by torch's caching host allocator (None: CUDA not
    initialised there, or the loop runs elsewhere).
    """

    index: int
    label: str
    start_s: float
    end_s: float
    end_reason: EndReason
    processes: tuple[ProcessEpoch, ...]
    devices: tuple[DeviceState, ...]
    device_peak_used_bytes: Mapping[int, int] = field(default_factory=dict)
    samples: int = 0
    error: str | None = None
    batches: int | None = None
    shm_files: tuple[ShmFile, ...] = ()
    shm_bytes: int | None = None
    shm_total_bytes: int | None = None
    shm_used_peak_bytes: int | None = None
    pinned_allocated_bytes: int | None = None
    pinned_reserved_bytes: int | None = None

    @property
    def duration_s(self) -> float:
        """Wall seconds from start to end."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class TeardownRecord:
    """What the teardown policy freed in one worker before it exited; None: unknown.

    Attributes:
        resources_released: Registered streams, events and callables dropped or called.
        gpu_bytes_by_device: NVML's used bytes per device before the release, summed in
            ``gpu_bytes_before``; ``left_nvml``: NVML no longer listed the PID after it.
        monotonic_s: ``time.monotonic()`` when it read what it held.
        released: The policy released resources (False: it only reported).
        host_uss_bytes: Its own USS as it exited; the other ``host_*`` fields likewise.

    """

    key: ProcessKey
    worker_id: int | None
    cuda_initialized: bool
    streams_joined: int = 0
    resources_released: int = 0
    freed_cache_bytes: int = 0
    context_released: bool = False
    gpu_bytes_before: int | None = None
    left_nvml: bool | None = None
    duration_s: float = 0.0
    error: str | None = None
    gpu_bytes_by_device: Mapping[int, int] | None = None
    peak_reserved_bytes: int | None = None
    monotonic_s: float | None = None
    released: bool = True
    host_uss_bytes: int | None = None
    host_pss_bytes: int | None = None
    host_rss_bytes: int | None = None
    host_rss_peak_bytes: int | None = None
    host_shared_dirty_bytes: int | None = None
    host_private_dirty_bytes: int | None = None


@dataclass(frozen=True)
class Death:
    """A process of the job ended by a signal, with what the machine said as it died.

    ``at_s`` is on the tracker's clock; ``oom_kills`` the rise of the cgroup's OOM-kill counter
    since the tracker started or its last death; ``stack`` what its faulthandler wrote.
    """

    key: ProcessKey
    signal_number: int
    at_s: float
    epoch: int | None = None
    oom_kills: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    shm_total_bytes: int | None = None
    shm_used_peak_bytes: int | None = None
    rss_bytes_birth: int | None = None
    rss_bytes_last: int | None = None
    stack: str | None = None


@dataclass(frozen=True)
class Stall:
    """An epoch that waited ``hang_after`` seconds for a batch, and the job's stacks then.

    ``stacks``: every thread's of the loop's process and its workers (NOTE [hang watch]).
    With ``pid``: that worker did not exit within its DataLoader's join time at shutdown
    (``waited_s``), and ``stacks`` are its own (NOTE [exit watch]).
    """

    epoch: int | None
    waited_s: float
    at_s: float
    stacks: str
    pid: int | None = None


@dataclass(frozen=True)
class TrackerCost:
    """What a tracker has cost so far: its own time, for overhead budgets and benchmarks.

    Attributes:
        caller_wall_s: Wall seconds the calling threads spent inside the tracker's methods:
            time the user's loop pays in full.
        nvml_wall_s: Wall seconds of the samples' NVML reads, lock waits included (NOTE
            [nvml pacing] in track/pacing.py); ``nvml_cpu_s`` their CPU seconds.
        host_read_cpu_s: The sampler's CPU seconds on host-memory reads, part of
            ``sampler_cpu_s``.

    """

    samples: int
    sample_wall_s: float
    sampler_cpu_s: float
    caller_wall_s: float
    nvml_wall_s: float
    nvml_cpu_s: float
    host_read_cpu_s: float = 0.0


Attribution = Literal["ok", "nvml-unavailable", "blind-namespace", "no-gpu"]


@dataclass(frozen=True)
class FinalState:
    """The job after the watched work, read fresh: who is still there and what they hold.

    Taken when the tracker closes, and by every ``report()`` before (``closed`` False).

    Attributes:
        others_gpu_bytes: Per device, bytes of the job's processes another tracker here owns:
            they explain device memory and are never judged.
        pending_pids: Processes alive whose survival is not decided yet (within the grace).
        open_epoch: The epoch open as this was read.

    """

    time_s: float
    devices: tuple[DeviceState, ...]
    processes: tuple[ProcessEpoch, ...]
    parent_allocated_gpu_bytes: int | None = None
    others_gpu_bytes: Mapping[int, int] = field(default_factory=dict)
    closed: bool = True
    pending_pids: tuple[int, ...] = ()
    open_epoch: int | None = None


@dataclass(frozen=True)
class ShmFile:
    """A file the watched work left in ``/dev/shm``.

    A file ``attributable`` False (nothing ties it to the work), ``in_use`` (its holder's
    work goes on) or ``made_by_older`` (the maker its name gives is older than the work) is
    reported, not blamed.
    """

    name: str
    size_bytes: int
    holder_pid: int | None = None
    holder_role: Role | None = None
    scope: str | None = None
    attributable: bool = True
    in_use: bool = False
    made_by_older: int | None = None
    allocated_bytes: int | None = None  # memory it holds (None: not read)


@dataclass(frozen=True)
class ParentMemory:
    """GPU memory the test process keeps after a test, beyond its start (pytest plugin).

    Attributes:
        kept_tensor_bytes: Per device, torch allocator bytes above the start, after a
            garbage collection and an emptied cache, net of live fixture scopes.
        driver_bytes: Per device that had a context at the start, NVML bytes above it beyond
            the allocator's growth.
        torch_in_use: The driver's growth may be libraries loading kernels on first use.

    """

    kept_tensor_bytes: Mapping[int, int] = field(default_factory=dict)
    driver_bytes: Mapping[int, int] = field(default_factory=dict)
    torch_in_use: bool = False
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timeline:
    """All that a tracker observed; the only input of the leak rules.

    Attributes:
        baseline_gpu_bytes: Per device, at the start, the bytes the final state counts as
            the job's beside its lineage (the root's own, other trackers' or ranks').
        failures: Leakcheck's own failures while sampling: reported, never raised.
        boot_unix_s: ``btime``: only to show start ticks as Unix times, never for identity.
        rank_devices: Rank -> its GPU where it recorded ``set_device``.

    """

    session_id: str
    root: ProcessKey
    started_unix_s: float
    attribution: Attribution
    attribution_reason: str
    baseline_devices: tuple[DeviceState, ...]
    baseline_gpu_bytes: Mapping[int, int]
    epochs: tuple[EpochRecord, ...]
    final: FinalState | None = None
    failures: tuple[str, ...] = ()
    teardowns: tuple[TeardownRecord, ...] = ()
    shm_files: tuple[ShmFile, ...] = ()
    parent_memory: ParentMemory | None = None
    boot_unix_s: float | None = None
    rank_devices: Mapping[int, int] = field(default_factory=dict)
    deaths: tuple[Death, ...] = ()
    stalls: tuple[Stall, ...] = ()


@dataclass(frozen=True)
class Finding:
    """One judged fact: a leak (``severity`` ``leak`` fails a check), or advice (``info``).

    The optional fields describe the culprit, where the rule has one.

    Attributes:
        message: One line that names the culprit and what it holds; ``remedy``: the fix.
        create_time: Its start as a Unix time, for people only (never compared).
        bytes_per_epoch: For growth: fitted slope.
        size_bytes: For shm: the file's size (capacity pressure: the filesystem's use).
        host_bytes: For host-growth and pinned-growth: the rise over the judged epochs; for
            copy-on-read: what the workers copied of their parent's memory, in all.
        stack: For died: its faulthandler's stack; for hang: the loop's and workers'; for
            shutdown-hang: the worker's.

    """

    rule: Rule
    severity: Severity
    message: str
    remedy: str
    pid: int | None = None
    start_ticks: int | None = None
    create_time: float | None = None
    role: Role | None = None
    cmdline: str | None = None
    gpu_bytes: int | None = None
    epoch: int | None = None
    device_index: int | None = None
    bytes_per_epoch: float | None = None
    nvidia_fds: int | None = None
    scope: str | None = None
    shm_name: str | None = None
    size_bytes: int | None = None
    host_bytes: int | None = None
    rank: int | None = None
    stack: str | None = None

    @property
    def bytes(self) -> int | None:
        """Alias of ``gpu_bytes`` (kept: docs/ARCHITECTURE.md, Public interface)."""
        return self.gpu_bytes


@dataclass(frozen=True)
class RuleConfig:
    """Thresholds of the leak rules.

    Attributes:
        tolerance_bytes: Growth or residual below this is noise.
        warmup_epochs: Epochs ignored by the growth rule (allocator warm-up).
        grace_s: How long a process born in an epoch may outlive the epoch end.
        host_tolerance_bytes: Host growth below this is noise: above the GPU's, since a heap
            moves more without leaking (arenas kept after a peak, pinned-memory caches).
        copy_tolerance_bytes: What a forked worker may copy of its parent's memory: a full
            garbage collection in it copies 36 MiB with torch imported (measured).

    """

    tolerance_bytes: int = 16 * MIB
    warmup_epochs: int = 1
    grace_s: float = 2.0
    high_clock_fraction: float = 0.8
    host_tolerance_bytes: int = 64 * MIB
    shm_pressure_fraction: float = 0.8
    fd_pressure_fraction: float = 0.8
    copy_tolerance_bytes: int = 64 * MIB
