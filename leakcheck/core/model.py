"""Plain data of every layer and the JSON schema (``records.py``): add fields, never rename.

The tracker folds readings into a ``Timeline``; ``verdict`` judges it into ``Finding``.
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
    "survivor", "orphan", "growth", "residual", "blind", "descriptor-holder", "context-kept",
    "high-clocks", "tracker-failure", "shm", "host-growth", "device-mismatch", "copy-on-read",
    "died", "fd-pressure", "hang", "pinned-growth", "shutdown-hang",
]  # fmt: skip
Severity = Literal["leak", "info"]


@dataclass(frozen=True)
class RankInfo:
    """A process's place in a distributed job: torchrun's variables (None: not set).

    ``device``: its GPU (NVML index), by its ``set_device`` where recorded, else ``LOCAL_RANK``.
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
    """What one process did during one epoch; None: not known.

    ``*_end``: at the epoch's end, or from its report at exit. ``gpu_bytes_peak``: per device,
    the larger of sampled and reported (``gpu_peak_source``: teardown or driver accounting;
    ``sampled``, a lower bound; ``unknown``, exited unseen). ``scope``: what started it besides
    the work (``module-scoped fixture 'pool'``). ``host_bytes_end``: USS, else RSS;
    ``rss_bytes_peak``: ``VmHWM``. ``freed_by_gc``: it exited only once leakcheck collected
    garbage. ``*_birth``, ``copied_bytes_*``: NOTE [copy on read] in hostmem.py.
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
        """Sum over devices at the epoch's end."""
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

    ``pinned_*_bytes``: the loop's process's pinned host memory at the end (None: no CUDA).
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

    ``gpu_bytes_by_device``: NVML's bytes before the release (summed: ``gpu_bytes_before``);
    ``left_nvml``: NVML no longer listed it after; ``released`` False: it only reported;
    ``host_*``: its own memory as it exited; ``interrupted``: it took a SIGINT (a Ctrl-C).
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
    interrupted: bool = False


@dataclass(frozen=True)
class Death:
    """A process of the job ended by a signal, and what the machine said then.

    ``oom_kills``: the rise of the cgroup's OOM-kill count since the last death or the start.
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
    """An epoch that waited ``hang_after`` for a batch, and the job's stacks (NOTE [hang watch]).

    With ``pid``: that worker outlived its shutdown's join (NOTE [exit watch]); its stacks.
    """

    epoch: int | None
    waited_s: float
    at_s: float
    stacks: str
    pid: int | None = None


@dataclass(frozen=True)
class TrackerCost:
    """What a tracker has cost so far: its own time, for overhead budgets and benchmarks.

    ``caller_wall_s``: the calling threads' time inside it; ``nvml_wall_s``: lock waits
    included; ``host_read_cpu_s``: part of ``sampler_cpu_s``.
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
    """The job read fresh at ``close()`` (or a ``report()`` before: ``closed`` False).

    ``others_gpu_bytes``: what processes another tracker owns hold (explained, never judged);
    ``pending_pids``: alive, still within the grace.
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

    Reported, not blamed: ``attributable`` False (nothing ties it to the work), ``in_use``
    (its holder works on), ``made_by_older`` (its name's maker is older than the work).
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

    ``kept_tensor_bytes``: allocator bytes above the start after a collection, net of live
    fixture scopes; ``driver_bytes``: NVML's growth beyond the allocator's.
    """

    kept_tensor_bytes: Mapping[int, int] = field(default_factory=dict)
    driver_bytes: Mapping[int, int] = field(default_factory=dict)
    torch_in_use: bool = False
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timeline:
    """All that a tracker observed; the only input of the leak rules.

    ``baseline_gpu_bytes``: at the start, the job's beside its lineage (the root's own, other
    trackers' or ranks'); ``rank_devices``: rank -> the GPU of its ``set_device``.
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

    ``message``: one line naming the culprit and what it holds; ``remedy``: the fix;
    ``create_time``: for people only, never compared; ``host_bytes``: a host rule's rise.
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

    ``host_tolerance_bytes`` is above the GPU's: a heap moves more without leaking;
    ``copy_tolerance_bytes``: a full collection in a forked worker copies 36 MiB (measured).
    """

    tolerance_bytes: int = 16 * MIB
    warmup_epochs: int = 1
    grace_s: float = 2.0
    high_clock_fraction: float = 0.8
    host_tolerance_bytes: int = 64 * MIB
    shm_pressure_fraction: float = 0.8
    fd_pressure_fraction: float = 0.8
    copy_tolerance_bytes: int = 64 * MIB
