"""Plain data shared by every layer: identities, samples, epochs, findings.

Everything here is a frozen dataclass with units in its field names. The lower layers
(``nvml``, ``procs``) produce ``GpuProcess``/``DeviceState``/``ProcInfo`` (defined in
``readings.py``, named here too); ``tracker`` folds
them into a ``Timeline`` of ``EpochRecord``; ``verdict`` turns a ``Timeline`` into
``Finding``; ``report`` renders both.
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
]
Severity = Literal["leak", "info"]


@dataclass(frozen=True)
class RankInfo:
    """Where a process stands in a distributed job, as torchrun's environment says.

    Attributes:
        rank: Global rank (``RANK``).
        local_rank: Rank on its node (``LOCAL_RANK``); None when not set.
        world_size: Ranks in the job (``WORLD_SIZE``); None when not set.
        node_rank: The node's (agent group's) rank (``GROUP_RANK``); None when not set.
        run_id: The elastic run's id (``TORCHELASTIC_RUN_ID``); None when not set.
        restart_count: How often the elastic agent restarted the ranks before this one
            started (``TORCHELASTIC_RESTART_COUNT``); None when not set.
        device: The GPU (NVML index) the rank trains on: what it set with
            ``torch.cuda.set_device`` where recorded, else its ``LOCAL_RANK``'s device
            through ``CUDA_VISIBLE_DEVICES``; None when not known.

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
"""Which figure a process's host memory is: ``uss`` (private pages, from
``/proc/PID/smaps_rollup``: what copy-on-read grows) or ``rss`` (resident pages, shared ones
included, from ``/proc/PID/status``: where USS was not read, or could not be)."""


@dataclass(frozen=True)
class ProcessEpoch:
    """What one process did during one epoch.

    Attributes:
        key: Identity.
        role: Role at the end of the epoch.
        ppid: Parent PID at the last observation.
        cmdline: Command line, shortened for display.
        born_in_epoch: First seen after this epoch started.
        persistent: Expected to outlive the epoch (the parent, persistent workers).
        alive_at_end: Still running when the epoch ended.
        exited_after_s: Seconds after the epoch end at which it was seen gone; None while
            it has not been seen gone (or if it was gone before the end).
        last_seen_after_s: Seconds after the epoch end of the last observation alive.
        gpu_bytes_end: Used GPU bytes per device index at the end of the epoch.
        gpu_bytes_peak: Peak used GPU bytes per device index during the epoch: the larger
            of what was sampled and what the process reported itself; never below
            ``gpu_bytes_end``. Empty when ``gpu_peak_source`` is ``unknown``.
        gpu_peak_source: Where the peak comes from: ``reported`` (the process's own report
            at teardown, or the driver's accounting of an exited PID), ``sampled`` (NVML
            reads while it lived, a lower bound) or ``unknown`` (it exited before any read
            could see it and reported nothing: its peak is not known, not 0).
        gpu_bytes_unknown: NVML listed it on a device without a byte count.
        nvidia_fds: Open ``/dev/nvidia*`` descriptors at the end (None if unreadable).
        open_fds: Open descriptors of any kind at the end (None if unreadable).
        fd_limit: Its soft ``RLIMIT_NOFILE`` then (None: unlimited, or unreadable).
        scope: What started it, when that is not the watched work itself (the pytest
            plugin: ``module-scoped fixture 'pool'``); None otherwise.
        host_bytes_end: Host memory at the end of the epoch: USS where it was read, else
            RSS (``host_source`` says which). For a process that exited during the epoch
            (``alive_at_end`` False): what it reported of itself at its exit (a worker's
            teardown record). None: not known (gone unreported, or unreadable).
        host_source: ``uss`` or ``rss``: what ``host_bytes_end`` is; None when unknown. An
            epoch whose USS read was paced out says ``rss``: an older USS is never carried
            over as if read.
        pss_bytes_end: Proportional set size at the end (or exit), where USS was read.
        rss_bytes_end: Resident set size at the end (or exit): read at every epoch end.
        anon_bytes_end: The anonymous part of it (``RssAnon``: the heap, where Python objects
            and new allocations live; libraries paged in from files are not): what grows
            when a process allocates memory and keeps it.
        rss_bytes_peak: Highest RSS of the process's life up to the end of the epoch (or its
            exit): the kernel's ``VmHWM``. For a worker that lives one epoch, that epoch's
            peak; for a longer-lived process, an upper bound of it.
        freed_by_gc: It exited only once leakcheck collected garbage: a reference cycle
            kept what owned it (a DataLoader iterator with its workers) alive (the pytest
            plugin says so).
        rank: The distributed rank it belongs to (``RANK`` in its initial environment);
            None outside a distributed job, or where unreadable.
        rank_device: The GPU (NVML index) its rank trains on as its environment says
            (``LOCAL_RANK`` through ``CUDA_VISIBLE_DEVICES``); None when not known.
        born_epoch: The index of the epoch its create time falls in, which can be earlier
            than the first epoch that saw it (a helper found after its worker exited);
            None when it was born outside every epoch, or where not known.
        forked: A loader's worker started by fork, sharing its parent's memory at birth
            (False: spawn or forkserver, where copy-on-read cannot be told); None where the
            worker did not report its birth (not a worker, or no ``worker_init_fn`` of
            leakcheck's ran in it).
        private_bytes_birth: Its USS as it started (its birth report); None: not reported.
        shared_bytes_birth: Its ``Shared_Dirty`` as it started: the written pages it shared
            with its parent then (NOTE [copy on read] in hostmem.py).
        shared_bytes_end: Its ``Shared_Dirty`` at the reading ``copied_bytes_end`` is from.
        copied_bytes_end: The bytes of its parent's memory it had copied since its birth
            (NOTE [copy on read]) at the last reading of the epoch: the end's smaps_rollup
            read, or its report at exit. None where not known (no birth report, no such read,
            or not forked).
        copied_bytes_peak: The most any reading of the epoch showed copied: in-epoch reads
            (NOTE [host pacing] in pacing.py), the end's, the exit report's.
        copied_over_after_s: Seconds into the epoch of the first reading that showed more
            copied than the copy tolerance; None where none did.

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

    The shared-memory fields are None where the directory was not read (an adapter that
    does not, or no such directory).
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
    """Text of the exception that ended the epoch, if one did."""
    batches: int | None = None
    """Batches the epoch yielded, where the adapter counts them (``watch``)."""
    shm_files: tuple[ShmFile, ...] = ()
    """The job's files in ``/dev/shm`` at the end: created since tracking started and held
    by one of its processes (or named after one), with the holder."""
    shm_bytes: int | None = None
    """Apparent size of ``shm_files``, summed."""
    shm_total_bytes: int | None = None
    """Size of the filesystem behind ``/dev/shm`` (None: no limit, or not read)."""
    shm_used_peak_bytes: int | None = None
    """Highest use of that filesystem seen during the epoch (every process's files, those
    already removed but still held included): what runs out when a loader's workers die of
    a bus error."""

    @property
    def duration_s(self) -> float:
        """Wall seconds from start to end."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class TeardownRecord:
    """What the teardown policy freed in one worker before it exited.

    Attributes:
        key: The worker's identity.
        worker_id: The loader's worker index, if known.
        cuda_initialized: CUDA was initialised in the worker (else nothing to free).
        streams_joined: Registered side streams joined into the current stream.
        resources_released: Registered streams, events and callables dropped or called.
        freed_cache_bytes: Allocator bytes reserved before emptying the cache.
        context_released: The context was released (device reset) before exit.
        gpu_bytes_before: NVML's used bytes for this PID before teardown, summed over
            devices (None: unknown).
        left_nvml: NVML no longer listed the PID after teardown (None: could not check).
        duration_s: Seconds the teardown took.
        error: One line if a step failed (the worker still exits normally).
        gpu_bytes_by_device: NVML's used bytes per device index just before the release
            (the worker's own report of what it held; None: unknown, empty: nothing).
        peak_reserved_bytes: torch's peak reserved bytes over the worker's life, summed
            over devices (None: CUDA never initialised, or unknown).
        monotonic_s: ``time.monotonic()`` when the worker read what it held (the clock is
            shared by the processes of one host); None: unknown.
        released: The teardown policy released resources (False: the worker only
            reported what it held).
        host_uss_bytes: The worker's own USS as it exited (``/proc/self/smaps_rollup``):
            its private host memory, what copy-on-read grows. None: unknown.
        host_pss_bytes: Its PSS then; None: unknown.
        host_rss_bytes: Its RSS then; None: unknown.
        host_rss_peak_bytes: Its highest RSS over its life (``VmHWM``); None: unknown.
        host_shared_dirty_bytes: Its ``Shared_Dirty`` then (NOTE [copy on read] in
            hostmem.py); None: unknown.
        host_private_dirty_bytes: Its ``Private_Dirty`` then; None: unknown.

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
        key: Its identity.
        signal_number: The signal that ended it (SIGKILL is 9).
        at_s: When the death was noted, on the tracker's clock.
        epoch: The epoch open then; None between epochs.
        oom_kills: By how much the memory cgroup's OOM-kill counter rose since the tracker
            started or since the last death it noted (``machine.oom_kill_count``); None:
            not readable.
        memory_total_bytes: The machine's memory (``MemTotal``); None: not read.
        memory_available_bytes: ``MemAvailable`` as the death was noted; None: not read.
        shm_total_bytes: Size of ``/dev/shm``; None: no limit, or not read.
        shm_used_peak_bytes: Its highest use seen in the epoch, up to the death.
        rss_bytes_birth: Its resident memory as it started (a worker's birth report).
        rss_bytes_last: Its resident memory at the last read before it died.
        stack: What its faulthandler wrote as it crashed (the Python stack of every
            thread), where a worker's policy pointed it into the mailbox; None: nothing.

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

    Attributes:
        epoch: The epoch that stalled.
        waited_s: Seconds since its last batch (or its start) when the stacks were taken.
        at_s: When, on the tracker's clock.
        stacks: The Python stacks of every thread of the loop's process and of each worker
            (NOTE [hang watch] in hang.py), as text.

    """

    epoch: int | None
    waited_s: float
    at_s: float
    stacks: str


@dataclass(frozen=True)
class TrackerCost:
    """What a tracker has cost so far: its own time, for overhead budgets and benchmarks.

    Attributes:
        samples: Samples taken (sampler ticks, epoch ends, explicit ``sample()`` calls).
        sample_wall_s: Wall seconds spent inside samples, whichever thread took them.
        sampler_cpu_s: CPU seconds the background sampler thread used. On a machine with a
            spare core this is the most it can delay the training thread (it competes for
            the interpreter lock at most while it runs).
        caller_wall_s: Wall seconds the calling threads spent inside the tracker's methods
            (epoch begin and end, worker registration, samples, reports, ``close()`` with
            its grace wait): time the user's loop pays in full.
        nvml_wall_s: Wall seconds of the samples' NVML memory and process-list reads,
            whichever thread took them, waits for locks included (not the telemetry read at
            epoch ends). While the GPU is busy these reads hold a driver lock that the job's
            own driver calls may wait for, a cost the other fields do not see; the sampler
            keeps its share small (NOTE [nvml pacing] in track/pacing.py).
        nvml_cpu_s: CPU seconds of the same reads, in the threads that made them: mostly the
            driver's work, during which the NVML binding (ctypes) releases the interpreter
            lock, so it delays no Python thread where a core is spare. Part of
            ``sampler_cpu_s`` for the sampler's reads; it shows how much of that is spent
            in NVML rather than in leakcheck's own Python.
        host_read_cpu_s: CPU seconds the sampler thread spent on the host-memory reads
            after epoch ends (USS and PSS of the parent and persistent workers: a page-table
            walk per process) and inside epochs (forked workers' copies: NOTE [host pacing]),
            with filing their results in the epoch's record. Part of
            ``sampler_cpu_s``. A tracker's first epoch end always reads; later ones are paced
            (NOTE [host pacing] in track/pacing.py), so a short-lived tracker pays more of
            it for its time than a long one.

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

    Taken when the tracker closes, and by every ``report()`` before that (then ``closed``
    is False: the work may go on).
    """

    time_s: float
    devices: tuple[DeviceState, ...]
    processes: tuple[ProcessEpoch, ...]
    parent_allocated_gpu_bytes: int | None = None
    """Bytes the parent's torch allocator still holds; None when CUDA was never
    initialised in the parent (leakcheck never initialises it)."""
    others_gpu_bytes: Mapping[int, int] = field(default_factory=dict)
    """GPU bytes per device of the job's processes that another tracker in this process
    owns (another loader's workers): they explain device memory, and are never judged
    here."""
    closed: bool = True
    """The tracker was closed (False: a report asked for while the work goes on)."""
    pending_pids: tuple[int, ...] = ()
    """Processes alive now whose survival is not decided yet: born in an epoch that ended,
    and not yet seen more than the grace after its end (a report before ``close()``; empty
    once closed)."""
    open_epoch: int | None = None
    """The epoch open when this state was read (a report in the middle of one): the copy
    fields of its processes (``ProcessEpoch.copied_bytes_peak`` and the rest) are that
    epoch's so far. None: no epoch was open."""


@dataclass(frozen=True)
class ShmFile:
    """A file the watched work left in the shared-memory directory (``/dev/shm``).

    Attributes:
        name: File name inside the directory.
        size_bytes: Its size.
        holder_pid: A process of the job that still holds it open or mapped, if any.
        holder_role: That process's role.
        scope: What created it when not the work itself (a pytest fixture scope).
        attributable: False when nothing ties it to the work (nobody of the work holds it
            and its name does not say who made it) and others may have made it (other
            jobs, pytest-xdist workers): then it is reported, not blamed.
        in_use: Its holder is a process of the job whose work goes on (a tracker closed
            before its job ended): it may still be in use, so it is reported, not blamed.
        made_by_older: The PID its naming scheme names as its maker (torch's and CUDA IPC's
            files), where that process is older than the work and not of it: another
            process's file, reported, not blamed.

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
    """GPU memory the parent (the test process) keeps after the work, beyond its start.

    The pytest plugin fills it, net of what still-active fixture scopes hold; watched
    training loops do not (their parent keeps its model on purpose).

    Attributes:
        kept_tensor_bytes: torch allocator bytes above the start, per device, after a
            garbage collection and an emptied cache.
        driver_bytes: NVML bytes above the start beyond the allocator's growth, per device
            that already had a context at the start (a first context is a baseline).
        torch_in_use: torch's CUDA is initialised here: the driver's growth may be libraries
            loading kernels on first use, not a leak.
        scopes: Fixture scopes that ended now and owned allocations (for the wording).

    """

    kept_tensor_bytes: Mapping[int, int] = field(default_factory=dict)
    driver_bytes: Mapping[int, int] = field(default_factory=dict)
    torch_in_use: bool = False
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timeline:
    """All that a tracker observed; the only input of the leak rules."""

    session_id: str
    root: ProcessKey
    started_unix_s: float
    attribution: Attribution
    attribution_reason: str
    baseline_devices: tuple[DeviceState, ...]
    baseline_gpu_bytes: Mapping[int, int]
    """Used GPU bytes per device when tracking started of what the final state counts as the
    job's beside its lineage: the root's own, and other trackers' or ranks' processes."""
    epochs: tuple[EpochRecord, ...]
    final: FinalState | None = None
    failures: tuple[str, ...] = ()
    """Leakcheck's own failures while sampling: reported, never raised."""
    teardowns: tuple[TeardownRecord, ...] = ()
    """Worker teardowns reported through the mailbox, in arrival order."""
    shm_files: tuple[ShmFile, ...] = ()
    """Files the work left in ``/dev/shm``."""
    parent_memory: ParentMemory | None = None
    """The parent's own GPU memory after the work (pytest plugin only)."""
    boot_unix_s: float | None = None
    """The machine's boot time (``btime``) as the tracker read it at its start: only to show
    start ticks as Unix times (``create_time`` in JSON), never for identity (NOTE [process
    identity] in procs.py). None where not read."""
    rank_devices: Mapping[int, int] = field(default_factory=dict)
    """Rank -> the GPU (NVML index) it trains on, where a rank recorded it (its
    ``torch.cuda.set_device``): wins over what a process's environment says."""
    deaths: tuple[Death, ...] = ()
    """Processes of the job that a signal ended, as an adapter saw their exit status."""
    stalls: tuple[Stall, ...] = ()
    """Epochs that waited ``hang_after`` seconds for a batch, with the stacks then."""


@dataclass(frozen=True)
class Finding:
    """One judged fact: a leak, or information worth acting on.

    Attributes:
        rule: Which rule fired (docs/ARCHITECTURE.md, Rules).
        severity: ``leak`` fails a check; ``info`` is advice.
        message: One line that names the culprit and what it holds.
        remedy: One line on what to do about it.
        pid: Culprit PID, if the finding is about one process.
        start_ticks: With ``pid``, the identity of the culprit: its start in clock ticks
            since boot (NOTE [process identity] in procs.py).
        create_time: Its start as a Unix time, for people only (never compared); None
            where unknown.
        role: Culprit role.
        cmdline: Culprit command line.
        gpu_bytes: GPU bytes involved (held, leaked, or unexplained).
        epoch: Epoch index where it was judged, if any.
        device_index: Device involved, if one.
        bytes_per_epoch: For growth: fitted slope.
        nvidia_fds: Open ``/dev/nvidia*`` descriptors of the culprit, if known.
        scope: What started the culprit when not the work itself (a fixture scope).
        shm_name: For shm: the file name in ``/dev/shm``.
        size_bytes: For shm: the file's size (capacity pressure: the filesystem's use).
        host_bytes: For host-growth: the rise of host memory over the judged epochs; for
            copy-on-read: what the loader's workers copied of their parent's memory, in all
            (one epoch's workers, for workers started each epoch).
        rank: The distributed rank of the culprit, where known.
        stack: For died: the Python stack its faulthandler wrote as it crashed; for hang:
            the stacks of the loop's process and of its workers.

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
        host_tolerance_bytes: Host memory growth below this is noise (the host-growth
            rule). Higher than the GPU's: a Python process's heap moves by more than the
            CUDA allocator does without leaking (pymalloc and glibc arenas kept after a
            peak, modules imported on first use, torch's pinned-memory cache, batches in
            flight), while copy-on-read copies tens to hundreds of MiB per worker and epoch,
            far above it within a few epochs.
        fd_pressure_fraction: Open descriptors at or above this share of a process's
            ``RLIMIT_NOFILE`` at an epoch end is pressure (the fd-pressure rule): the next
            ``open``, socket or tensor received through the file_descriptor strategy fails.
        shm_pressure_fraction: ``/dev/shm`` use at or above this fraction of its size during
            an epoch is capacity pressure (the shm rule): workers die of a bus error when
            it is full, and a peak sampled a few times a second undershoots the true one.
        copy_tolerance_bytes: What a forked worker may copy of its parent's memory (the
            copy-on-read rule, NOTE [copy on read] in hostmem.py). Whatever the dataset, the
            interpreter's objects a worker touches (modules, functions) copy a few MiB, and
            a full garbage collection in it, which writes the header of every object it
            inherited, copies their pages (36 MiB with torch imported, measured: what
            ``gc.freeze()`` in the parent avoids); a dataset of Python objects copies tens
            to hundreds of MiB per worker.

    """

    tolerance_bytes: int = 16 * MIB
    warmup_epochs: int = 1
    grace_s: float = 2.0
    high_clock_fraction: float = 0.8
    host_tolerance_bytes: int = 64 * MIB
    shm_pressure_fraction: float = 0.8
    fd_pressure_fraction: float = 0.8
    copy_tolerance_bytes: int = 64 * MIB
