"""The built-in workload of ``leakcheck sweep``: a DataLoader whose workers touch the GPU.

A ``torch.utils.data.DataLoader`` over a synthetic dataset whose batches multiply a matrix,
on the GPU when there is one, so that ``leakcheck sweep`` works with no arguments. The
scenarios (``--scenario``) are told in docs/REFERENCE.md; with 0 workers the parent does what
a worker would (``persistent-cache``, ``orphan``), the ``orphan``'s grandchild sleeping at most
two minutes.

NOTE [copy-on-read scenario]: Python ints in lists are built in the parent before the
workers fork, so they share their pages; reading an object writes its reference count, so
the kernel copies each page a worker visits. ``copy-on-read`` reads them all each epoch: all
is copied in epoch 0, nothing later. ``copy-on-read-growing`` reads region
``e % cor_regions`` in epoch ``e``, at the worker's first batch among the epoch's last
``num_workers`` (the next epoch's first batches, prefetched at once, copy nothing, so a read
just after an epoch end sees that epoch's copies only). Each batch waits, so that an epoch
lasts about ``cor_epoch_s`` whatever the worker count: the USS reads at each epoch end must
end before the next epoch.

NOTE [failure stagings]: ``stage`` puts the sweep's own process (the whole job, no other
process) under what the failure needs, and undoes it after: ``oom`` moves it into a new child
of its memory cgroup (v1 or v2) limited to ``OOM_LIMIT_BYTES``; ``shm-full`` gives it a
private mount namespace with a ``SHM_BYTES`` tmpfs on /dev/shm (the machine's is never
touched); where neither can be made (not root, no writable cgroup) a usage error says so. In
epoch 0, at batch ``STAGE_BATCH``, a worker then grows its host memory until the OOM killer
ends it (its ``oom_score_adj`` raised, so that the kernel picks it, never the sweep; capped at
twice the limit), or blocks until the hang watch wrote its stack or ``HANG_CAP_S`` passed;
with ``shm-full`` every batch carries ``SHM_BATCH_BYTES`` of shared memory. With 0 workers
nothing is staged. They fork and compute on the CPU, so that a GPU machine stages them alike
(a CUDA context per worker would count against the memory limit).

NOTE [CUDA in the parent]: the parent learns whether a GPU exists from NVML
(``nvml.availability``), never initialising CUDA: that would break forked workers and keep a
context for the rest of the sweep. ``torch.cuda`` is touched only where the work runs: in a
worker, or in the parent with 0 workers where NVML saw a GPU.

NOTE [epoch numbers in the worker]: a persistent worker cannot see epoch boundaries; the
sampler, iterated afresh in the parent each epoch, hands it ``(epoch, batch)`` pairs, and it
caches one tensor the first time it meets an epoch number.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

from leakcheck.core.errors import UsageError
from leakcheck.core.model import MIB
from leakcheck.observe import machine, mailbox, procs

Scenario = Literal["clean", "persistent-cache", "orphan", "copy-on-read", "copy-on-read-growing",
                   "fd-pressure", "oom", "shm-full", "hang"]  # fmt: skip
SCENARIOS: tuple[Scenario, ...] = get_args(Scenario)
COPY_ON_READ: tuple[Scenario, ...] = ("copy-on-read", "copy-on-read-growing")
PERSISTENT: tuple[Scenario, ...] = ("persistent-cache", "fd-pressure", *COPY_ON_READ)
"""The scenarios whose workers must live across epochs."""
FAILURES: tuple[Scenario, ...] = ("oom", "shm-full", "hang")
"""The stagings whose loader fails or stalls (NOTE [failure stagings])."""
STAGE_BATCH = 2
OOM_LIMIT_BYTES = 1024 * MIB
SHM_BYTES = 16 * MIB
SHM_BATCH_BYTES = 7 * MIB
HANG_AFTER_S = 3.0
HANG_CAP_S = 60.0
START_METHODS: tuple[str, ...] = ("spawn", "fork", "forkserver")
FD_PRESSURE_LIMIT = 256
"""The soft descriptor limit an ``fd-pressure`` worker sets itself (never raised)."""

# The ``orphan`` scenario's grandchild (argv: bytes, device, lifetime_s, use_cuda): it holds
# its memory, says so, and sleeps; the lifetime cap ends a forgotten one.
_ORPHAN_CODE = """\
# leakcheck sweep --scenario orphan: a grandchild that outlives the loader
import sys, time
nbytes, device, lifetime_s, use_cuda = (
    int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1")
held = None
if use_cuda:
    try:
        import torch
        held = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize(device)
    except Exception as exc:
        print(f"orphan could not allocate GPU memory: {exc}", file=sys.stderr)
print("leakcheck-orphan-ready", flush=True)
try:
    sys.stdout.close()
except OSError:
    pass
time.sleep(lifetime_s)
"""

# From the parent itself (0 workers): a middle process starts the sleeper and exits at once,
# so the sleeper is reparented away exactly like a worker's grandchild.
_LAUNCHER_CODE = """\
# leakcheck sweep --scenario orphan: launcher (exits at once)
import subprocess, sys
subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, close_fds=True)
"""


@dataclass(frozen=True)
class WorkloadSpec:
    """What the built-in loader does (the module docstring tells the scenarios).

    Each batch is ``batch_size`` rows of ``features`` columns, multiplied by a square matrix;
    ``gpu``: NVML found a GPU (NOTE [CUDA in the parent]); ``cor_*``: NOTE [copy-on-read
    scenario].
    """

    scenario: Scenario = "clean"
    batches: int = 16
    batch_size: int = 64
    features: int = 256
    start_method: str = "spawn"
    persistent: bool = False
    device_index: int = 0
    gpu: bool = False
    cache_bytes_per_epoch: int = 64 * MIB
    orphan_bytes: int = 256 * MIB
    orphan_lifetime_s: float = 120.0
    cor_bytes: int = 128 * MIB
    cor_bytes_per_epoch: int = 40 * MIB
    cor_regions: int = 8
    cor_epoch_s: float = 0.5

    @property
    def persistent_workers(self) -> bool:
        """Whether workers live across epochs (asked for, or the scenario needs it)."""
        return self.persistent or self.scenario in PERSISTENT

    @property
    def effective_start_method(self) -> str:
        """``fork`` for copy-on-read (a spawned worker unpickles a copy) and the failures."""
        return "fork" if self.scenario in (*COPY_ON_READ, *FAILURES) else self.start_method


class EpochSampler:
    """Yields ``(epoch, batch)`` pairs; a new epoch number each time it is iterated."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.epoch = -1

    def __iter__(self) -> Iterator[tuple[int, int]]:
        self.epoch += 1
        epoch = self.epoch
        for batch in range(self.batches):
            yield epoch, batch

    def __len__(self) -> int:
        return self.batches


class SyntheticDataset:
    """Map-style dataset: item ``(epoch, batch)`` is one whole batch (a CPU tensor)."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._use_cuda: bool | None = None
        self._cache: list[Any] = []
        self._cached_epochs: set[int] = set()
        self._orphan_started = False
        self._objects: list[list[list[int]]] = []
        if spec.scenario == "copy-on-read":
            self._objects = python_objects(spec.cor_bytes, 1)
        elif spec.scenario == "copy-on-read-growing":
            self._objects = python_objects(spec.cor_bytes_per_epoch, spec.cor_regions)

    def __getstate__(self) -> dict[str, Any]:
        # A worker starts from a clean state: no cache, no orphan, CUDA not yet decided.
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"])  # type: ignore[misc]

    def __len__(self) -> int:
        return self.spec.batches

    def _device(self) -> Any:
        import torch

        if self._use_cuda is None:
            # NOTE [CUDA in the parent]; a forked child of a parent that used CUDA cannot.
            bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
            gpu = self.spec.gpu and self.spec.scenario not in FAILURES  # NOTE [failure stagings]
            self._use_cuda = bool(gpu and not bad_fork() and torch.cuda.is_available())
        if self._use_cuda:
            return torch.device("cuda", self.spec.device_index)
        return torch.device("cpu")

    def __getitem__(self, index: tuple[int, int]) -> Any:
        import torch

        epoch, batch = index
        spec = self.spec
        device = self._device()
        if spec.scenario == "persistent-cache" and epoch not in self._cached_epochs:
            self._cached_epochs.add(epoch)
            kept = torch.empty(spec.cache_bytes_per_epoch, dtype=torch.uint8, device=device)
            # Touched on a GPU, so that it is used, not only reserved; on the CPU, untouched:
            # the host has no per-process GPU memory to show, and RAM would only slow it.
            self._cache.append(kept.fill_(1) if device.type == "cuda" else kept)
        if spec.scenario == "fd-pressure" and not self._cache:
            self._cache = hold_descriptors()
        if spec.scenario == "orphan" and not self._orphan_started:
            self._orphan_started = True
            start_orphan(spec, use_cuda=device.type == "cuda")
        if self._objects:  # NOTE [copy-on-read scenario]
            workers = max(_workers(), 1)
            last_round = spec.scenario == "copy-on-read" or batch >= spec.batches - workers
            if last_round and epoch not in self._cached_epochs:
                self._cached_epochs.add(epoch)
                region = self._objects[epoch % len(self._objects)]
                sum(sum(values) for values in region)  # each visit writes a reference count
            time.sleep(spec.cor_epoch_s * workers / spec.batches)
        if index == (0, STAGE_BATCH) and spec.scenario in ("oom", "hang") and _workers():
            _stage_in_worker(spec.scenario)
        generator = torch.Generator().manual_seed(epoch * 100_003 + batch)
        rows = torch.randn(spec.batch_size, spec.features, generator=generator)
        weights = torch.randn(spec.features, spec.features, generator=generator)
        out = torch.tanh(rows.to(device) @ weights.to(device)).to("cpu")
        if spec.scenario == "shm-full" and _workers():
            # As default_collate does in a worker: the batch is made in shared memory.
            shared = torch.ones(SHM_BATCH_BYTES, dtype=torch.uint8)
            return [out, shared.share_memory_()]  # type: ignore[no-untyped-call]
        return out


_INT_BYTES = 36  # a Python int above 256 is its own 28-byte object, plus its list slot
_INTS_PER_LIST = 1000


def python_objects(bytes_per_region: int, regions: int) -> list[list[list[int]]]:
    """``regions`` regions of Python ints in lists, about ``bytes_per_region`` each."""
    per_region = max(bytes_per_region // _INT_BYTES, _INTS_PER_LIST)
    return [
        [
            list(range(start, start + _INTS_PER_LIST))
            for start in range(region * per_region, (region + 1) * per_region, _INTS_PER_LIST)
        ]
        for region in range(regions)
    ]


def _workers() -> int:
    """The loader's worker count, seen from one of its workers; 0 in the sweep's own process."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return info.num_workers if info is not None else 0


def _stage_in_worker(scenario: Scenario) -> None:
    """In a worker: grow until the OOM killer ends it, or block (NOTE [failure stagings])."""
    if scenario == "oom":
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
        held: list[bytearray] = []
        while len(held) * 32 * MIB < 2 * OOM_LIMIT_BYTES:
            held.append(bytearray(32 * MIB))  # zeroed: every page touched
            time.sleep(0.02)  # a few reads of its growth before the kill
        return
    key, folder = procs.process_key(os.getpid()), os.environ.get(mailbox.MAILBOX_ENV)
    path = mailbox.stack_path(folder, key) if key and folder else ""

    def written() -> float:
        with contextlib.suppress(OSError):
            return os.stat(path).st_mtime
        return 0.0

    # Blocked here (the stack the hang watch shows) until the file has changed and then been
    # still for a second: its dump, written from any thread, is out whole.
    before, changed_s, deadline = written(), 0.0, time.monotonic() + HANG_CAP_S
    while time.monotonic() < deadline and not (changed_s and time.monotonic() - changed_s > 1):
        if written() != before:
            before, changed_s = written(), time.monotonic()
        time.sleep(0.05)


def start_orphan(spec: WorkloadSpec, *, use_cuda: bool) -> None:
    """Start the ``orphan`` scenario's sleeper and wait until it holds its memory.

    From a worker the sleeper is a direct child (an orphan once the worker exits); from the
    parent a launcher that exits at once starts it.
    """
    sleeper = [sys.executable, "-c", _ORPHAN_CODE, str(spec.orphan_bytes)]
    sleeper += [str(spec.device_index), str(spec.orphan_lifetime_s), "1" if use_cuda else "0"]
    in_worker = _workers() > 0
    argv = sleeper if in_worker else [sys.executable, "-c", _LAUNCHER_CODE, *sleeper]
    try:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True, text=True
        )
    except OSError:
        return
    assert process.stdout is not None
    # Until it holds its memory, the tracker could take the final state before the leak
    # exists; EOF (a crash) ends the wait too.
    process.stdout.readline()
    process.stdout.close()
    if not in_worker:
        process.wait()  # the launcher has exited: reap it


def hold_descriptors() -> list[Any]:
    """In a loader's worker: a soft limit of ``FD_PRESSURE_LIMIT``, 90% of it held open."""
    import resource

    if not _workers():
        return []  # the sweep's own process (0 workers) keeps its limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > FD_PRESSURE_LIMIT:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_PRESSURE_LIMIT, hard))
        soft = FD_PRESSURE_LIMIT
    held: list[Any] = []
    while len(os.listdir("/proc/self/fd")) < 0.9 * soft:
        held.append(open(os.devnull, "rb"))  # noqa: SIM115 - held open on purpose
    return held


def builtin_factory(spec: WorkloadSpec) -> Callable[[int], Iterable[Any]]:
    """The built-in DataLoader's factory (``FACTORY(num_workers)``; 0: the parent works)."""

    def factory(num_workers: int) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        options: dict[str, Any] = {
            "multiprocessing_context": spec.effective_start_method,
            "persistent_workers": spec.persistent_workers,
        }
        # No worker_init_fn: the sweep chains leakcheck's into every DataLoader (NOTE [the
        # watch() code path] in sweep.py).
        return DataLoader(
            SyntheticDataset(spec),  # type: ignore[arg-type]  # torch stays a lazy import
            batch_size=None,
            sampler=EpochSampler(spec.batches),
            num_workers=num_workers,
            **(options if num_workers else {}),
        )

    factory.__qualname__ = f"builtin[{spec.scenario}]"
    return factory


def describe(spec: WorkloadSpec) -> str:
    """One line for the report header."""
    where = f"cuda:{spec.device_index}" if spec.gpu and spec.scenario not in FAILURES else "cpu"
    parts = [
        f"built-in workload, scenario {spec.scenario}",
        f"{spec.batches} batches of {spec.batch_size}x{spec.features} per epoch on {where}",
        f"start method {spec.effective_start_method}",
        "persistent workers" if spec.persistent_workers else "workers per epoch",
    ]
    if spec.scenario == "copy-on-read":
        parts.append(f"{spec.cor_bytes // MIB} MiB of Python objects read whole every epoch")
    elif spec.scenario == "copy-on-read-growing":
        parts.append(
            f"{spec.cor_regions} x {spec.cor_bytes_per_epoch // MIB} MiB of Python objects, "
            f"one region read per worker and epoch"
        )
    return ", ".join(parts)


def stage(spec: WorkloadSpec | None) -> contextlib.AbstractContextManager[None]:
    """The sweep's process under its failure staging while it runs (NOTE [failure stagings]).

    Nothing for the other scenarios. Entering it raises ``UsageError`` (one line: why) where
    the staging cannot be made here.
    """
    scenario = spec.scenario if spec is not None else None
    if scenario == "oom":
        return _memory_limit(OOM_LIMIT_BYTES)
    return _private_shm(SHM_BYTES) if scenario == "shm-full" else contextlib.nullcontext()


def _write(path: str, value: int | str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write(str(value))


@contextlib.contextmanager
def _memory_limit(limit_bytes: int) -> Iterator[None]:
    """Moves this process into a new child of its memory cgroup of ``limit_bytes``, then back."""
    try:
        found = machine.own_memory_cgroup()
        if found is None:
            raise OSError("no memory cgroup in /proc/self/cgroup")
        own, v2 = found
        child = os.path.join(own, f"leakcheck-oom-{os.getpid()}")
        os.mkdir(child)
    except OSError as exc:
        raise UsageError(f"--scenario oom: no writable memory cgroup here ({exc})") from None
    memory, swap = ("max", "swap.max") if v2 else ("limit_in_bytes", "memsw.limit_in_bytes")
    try:
        _write(os.path.join(child, f"memory.{memory}"), limit_bytes)
        with contextlib.suppress(FileNotFoundError):  # no swap accounting: no swap to use
            _write(os.path.join(child, f"memory.{swap}"), 0 if v2 else limit_bytes)
        _write(os.path.join(child, "cgroup.procs"), os.getpid())
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(child)
        raise UsageError(f"--scenario oom: cannot limit a memory cgroup here ({exc})") from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            _write(os.path.join(own, "cgroup.procs"), os.getpid())
        deadline = time.monotonic() + 30  # until the last worker of the sweep has gone
        while os.path.isdir(child) and time.monotonic() < deadline:
            try:
                os.rmdir(child)
            except OSError:
                time.sleep(0.1)


@contextlib.contextmanager
def _private_shm(size_bytes: int) -> Iterator[None]:
    """Moves this process (and what it starts) to a private mount namespace and /dev/shm."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps: tuple[Callable[[], int], ...] = (
        lambda: libc.unshare(0x00020000),  # CLONE_NEWNS
        lambda: libc.mount(None, b"/", None, 0x4000 | 0x40000, None),  # MS_REC | MS_PRIVATE
        lambda: libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size_bytes}".encode()),
    )
    for step in steps:
        if step() != 0:
            reason = os.strerror(ctypes.get_errno())
            raise UsageError(f"--scenario shm-full: cannot give the job a /dev/shm ({reason})")
    try:
        yield
    finally:
        libc.umount2(b"/dev/shm", 2)  # MNT_DETACH; this namespace's only
