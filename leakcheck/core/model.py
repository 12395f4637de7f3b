"""Plain data shared by every layer: frozen dataclasses with units in their field names.

``nvml`` and ``procs`` read ``readings.py``'s records; the tracker folds them into a
``Timeline`` of ``EpochRecord``; ``verdict`` turns it into ``Finding``; ``report`` renders both.
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
    """Where a process stands in a distributed job, as torchrun's environment says.

    The fields are ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``,
    ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` (None: not set); ``device`` is
    the GPU (NVML index) it trains on: its ``torch.cuda.set_device`` where recorded, else its
    ``LOCAL_RANK``'s through ``CUDA_VISIBLE_DEVICES`` (None: not known).
    """

    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    node_rank: int | None = None
    run_id: str | None = None
    restart_count: int | None = None
    device: int | None = None


PeakSource = Literal["reported", "sampled", "unknown"]

HostSource = Literal["uss", "rss"]
"""``uss``: private pages (smaps_rollup: what copy-on-read grows); ``rss``: resident pages
(status), where USS was not read."""


@dataclass(frozen=True)
class ProcessEpoch:
    """What one process did during one epoch; None in a field means not known.

    ``*_end`` fields are read at the epoch's end, or for a process that exited in it
    (``alive_at_end`` False) taken from its own report at exit (a worker's teardown record).

    Attributes:
        exited_after_s: Seconds after the epoch end at which it was seen gone.
        gpu_bytes_peak: Per device, the larger of what was sampled and what it reported;
            empty when ``gpu_peak_source`` is ``unknown``.
        gpu_peak_source: ``reported`` (its teardown report, or the driver's accounting),
            ``sampled`` (NVML reads while it lived: a lower bound) or ``unknown`` (it exited
            unseen and unreported: not 0).
        gpu_bytes_unknown: NVML listed it on a device without a byte count.
        fd_limit: Its soft ``RLIMIT_NOFILE`` (None: unlimited, or unreadable).
        scope: What started it when not the work itself (``module-scoped fixture 'pool'``).
        host_bytes_end: USS where read, else RSS: ``host_source`` says which (a paced-out
            USS read says ``rss``: an older USS is never carried over).
        anon_bytes_end: ``RssAnon``: the heap, what grows when a process keeps memory.
        rss_bytes_peak: ``VmHWM``: its highest RSS up to the epoch end (or its exit).
        freed_by_gc: It exited only once leakcheck collected garbage (a reference cycle
            kept its DataLoader iterator alive).
        rank: Its distributed rank (``RANK`` in its initial environment).
        rank_device: Its rank's GPU (NVML index) as its environment says.
        born_epoch: The epoch its create time falls in (earlier than the first that saw
            it, for a helper found after its worker exited).
        forked: A worker started by fork (False: spawn or forkserver); None where it did
            not report its birth.
        private_bytes_birth: Its USS at its birth report.
        shared_bytes_birth: Its ``Shared_Dirty`` then (NOTE [copy on read] in hostmem.py).
        shared_bytes_end: Its ``Shared_Dirty`` at the reading ``copied_bytes_end`` is from.
        copied_bytes_end: What it had copied of its parent's memory since its birth, at the
            epoch's last reading (NOTE [copy on read]).
        copied_bytes_peak: The most any reading of the epoch showed copied (NOTE [host
            pacing] in pacing.py).
        copied_over_after_s: Seconds into the epoch of the first reading over the copy
            tolerance.

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

    Attributes:
        error: The exception that ended it, if one did.
        batches: Batches it yielded, where the adapter counts them (``watch``).
        shm_files: The job's files in ``/dev/shm`` at the end, with their holders.
        shm_total_bytes: Size of ``/dev/shm`` (None: no limit, or not read).
        shm_used_peak_bytes: Its highest use in the epoch (every process's files, removed
            but held ones included): what runs out when workers die of a bus error.
        pinned_allocated_bytes: The loop's process's pinned host memory at the end, in use
            by tensors (torch's caching host allocator; None: CUDA not initialised there, or
            the loop runs elsewhere).
        pinned_reserved_bytes: What that allocator holds, its cached blocks included.

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
        freed_cache_bytes: Allocator bytes reserved before emptying the cache.
        gpu_bytes_before: NVML's used bytes of the PID before teardown, summed.
        left_nvml: NVML no longer listed the PID after teardown.
        error: One line if a step failed (the worker still exits normally).
        gpu_bytes_by_device: NVML's used bytes per device just before the release (empty:
            nothing).
        peak_reserved_bytes: torch's peak reserved bytes over its life, summed.
        monotonic_s: ``time.monotonic()`` when it read what it held (shared by the host).
        released: The policy released resources (False: it only reported).
        host_uss_bytes: Its own USS as it exited; the other ``host_*`` fields likewise
            (``rss_peak``: ``VmHWM``; ``shared_dirty``: NOTE [copy on read] in hostmem.py).

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

    Attributes:
        at_s: When the death was noted, on the tracker's clock.
        epoch: The epoch open then; None between epochs.
        oom_kills: The rise of the cgroup's OOM-kill counter since the tracker started or
            its last death (None: not readable).
        memory_available_bytes: ``MemAvailable`` as the death was noted (None: not read).
        shm_used_peak_bytes: ``/dev/shm``'s highest use seen in the epoch, up to the death.
        rss_bytes_birth: Its resident memory at its birth report.
        stack: What its faulthandler wrote as it crashed, where the policy pointed it into
            the mailbox.

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

    ``waited_s`` counts from its last batch (or its start); ``stacks`` holds every thread's
    of the loop's process and of each worker (NOTE [hang watch] in hang.py). With ``pid``:
    that worker did not exit within its DataLoader's join time at shutdown (``waited_s``),
    and ``stacks`` are its own (NOTE [exit watch]).
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
        samples: Samples taken (sampler ticks, epoch ends, explicit ``sample()`` calls).
        sample_wall_s: Wall seconds inside samples, whichever thread took them.
        sampler_cpu_s: CPU seconds of the sampler thread: with a spare core, the most it can
            delay the training thread.
        caller_wall_s: Wall seconds the calling threads spent inside the tracker's methods:
            time the user's loop pays in full.
        nvml_wall_s: Wall seconds of the samples' NVML memory and process reads, lock waits
            included: a driver lock the job's own calls may wait for (NOTE [nvml pacing] in
            track/pacing.py).
        nvml_cpu_s: CPU seconds of those reads (the binding releases the interpreter lock).
        host_read_cpu_s: The sampler's CPU seconds on host-memory reads (NOTE [host pacing]
            in track/pacing.py), part of ``sampler_cpu_s``.

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

    Taken when the tracker closes, and by every ``report()`` before (then ``closed`` is
    False: the work may go on).

    Attributes:
        parent_allocated_gpu_bytes: Bytes the parent's torch allocator still holds; None
            where CUDA was never initialised in it.
        others_gpu_bytes: Per device, bytes of the job's processes another tracker here owns
            (another loader's workers): they explain device memory and are never judged.
        pending_pids: Processes alive whose survival is not decided yet (born in an ended
            epoch, within the grace after it; empty once closed).
        open_epoch: The epoch open as this was read: its processes' copy fields are so far.

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
    """A file the watched work left in the shared-memory directory (``/dev/shm``).

    ``attributable``, ``in_use`` and ``made_by_older`` mark a file reported, not blamed.

    Attributes:
        holder_pid: A process of the job that still holds it open or mapped, if any.
        scope: What created it when not the work itself (a pytest fixture scope).
        attributable: False when nothing ties it to the work (no holder of it, no maker in
            its name) and others may have made it (other jobs, pytest-xdist workers).
        in_use: Its holder's work goes on (a tracker closed before its job ended).
        made_by_older: The maker its name gives (torch's and CUDA IPC's files), where that
            process is older than the work and not of it.

    """

    name: str
    size_bytes: int
    holder_pid: int | None = None
    holder_role: Role | None = None
    scope: str | None = None
    attributable: bool = True
    in_use: bool = False
    made_by_older: int | None = None


@dataclass(frozen=True)
class ParentMemory:
    """GPU memory the test process keeps after a test, beyond its start (pytest plugin).

    Attributes:
        kept_tensor_bytes: Per device, torch allocator bytes above the start, after a
            garbage collection and an emptied cache, net of live fixture scopes.
        driver_bytes: Per device that had a context at the start, NVML bytes above it beyond
            the allocator's growth.
        torch_in_use: torch's CUDA is initialised here: the driver's growth may be libraries
            loading kernels on first use.
        scopes: Fixture scopes that ended now and owned allocations (for the wording).

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
        teardowns: Worker teardowns reported through the mailbox, in arrival order.
        parent_memory: The parent's own GPU memory after the work (pytest plugin only).
        boot_unix_s: The boot time (``btime``) read at the start: only to show start ticks as
            Unix times, never for identity (NOTE [process identity] in procs.py).
        rank_devices: Rank -> its GPU (NVML index) where it recorded ``set_device``: wins
            over what a process's environment says.
        deaths: Processes of the job a signal ended, as an adapter saw their exit.

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
    """One judged fact: a leak, or information worth acting on.

    The optional fields describe the culprit, where the rule has one.

    Attributes:
        rule: Which rule fired (docs/ARCHITECTURE.md, Rules).
        severity: ``leak`` fails a check; ``info`` is advice.
        message: One line that names the culprit and what it holds.
        remedy: One line on what to do about it.
        start_ticks: With ``pid``, its identity (NOTE [process identity] in procs.py).
        create_time: Its start as a Unix time, for people only (never compared).
        gpu_bytes: GPU bytes involved (held, leaked, or unexplained).
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
        high_clock_fraction: SM clock at or above this fraction of its max after work
            counts as "high clocks".
        host_tolerance_bytes: Host growth below this is noise: above the GPU's, since a
            heap moves more without leaking (arenas kept after a peak, modules imported late,
            pinned-memory caches), while copy-on-read copies tens of MiB per worker and epoch.
        fd_pressure_fraction: Open descriptors at or above this share of ``RLIMIT_NOFILE``
            at an epoch end is pressure: the next ``open`` fails.
        shm_pressure_fraction: ``/dev/shm`` use at or above this fraction of its size is
            capacity pressure: when it is full, batches fail or workers die (SIGBUS).
        copy_tolerance_bytes: What a forked worker may copy of its parent's memory (NOTE
            [copy on read] in hostmem.py): the interpreter's objects it touches copy a few
            MiB, a full garbage collection in it 36 MiB with torch imported (measured; what
            ``gc.freeze()`` in the parent avoids).

    """

    tolerance_bytes: int = 16 * MIB
    warmup_epochs: int = 1
    grace_s: float = 2.0
    high_clock_fraction: float = 0.8
    host_tolerance_bytes: int = 64 * MIB
    shm_pressure_fraction: float = 0.8
    fd_pressure_fraction: float = 0.8
    copy_tolerance_bytes: int = 64 * MIB
