"""The built-in workload of ``leakcheck sweep``: a DataLoader whose workers touch the GPU.

A newcomer runs ``leakcheck sweep`` with no arguments and sees the tool work at once, so the
sweep needs a loader of its own. It is a ``torch.utils.data.DataLoader`` over a synthetic
dataset; each batch allocates a tensor, multiplies it and returns the result on the CPU.
The work happens on the GPU when one is present and on the CPU otherwise.

Scenarios (``--scenario``):

- ``clean``: nothing is kept; with the teardown policy, every worker gives its context back.
- ``persistent-cache``: persistent workers keep one new tensor alive per epoch (64 MiB on a
  GPU), so each worker grows by that much per epoch; with 0 workers the parent caches.
- ``orphan``: each worker starts a grandchild (a ``python -c`` process that holds GPU memory
  when it can and sleeps, for at most two minutes) that outlives the loader.
- ``copy-on-read``: the classic (pytorch/pytorch#13246): persistent workers, forked (where the
  platform can), over a dataset that also holds ``cor_bytes`` of Python objects, built once in
  the parent and read whole by every worker in every epoch: each copies it in epoch 0 and
  stays flat after (NOTE [copy-on-read scenario]).
- ``copy-on-read-growing``: the same workers reading a new region of the objects each epoch:
  each worker's private host memory (USS) grows by ``cor_bytes_per_epoch`` per epoch, while
  its RSS stays flat.
- ``fd-pressure``: persistent workers that lower their own soft ``RLIMIT_NOFILE`` to
  ``FD_PRESSURE_LIMIT`` and hold 90% of it open (the fd-pressure rule's information; a
  loader's descriptor sharing strategy meets it as "Too many open files"). With 0 workers
  nothing is held: the sweep's own process keeps its limit.

NOTE [copy-on-read scenario]: the dataset holds Python ints in lists, built in the parent
before the workers fork, so that the workers share their pages. Reading an object writes its
reference count: the kernel copies each page a worker visits into that worker. In the classic
scenario each worker reads all ``cor_bytes`` of them in every epoch: the first read copies
them, the later ones find them copied already, so its copy is flat from epoch 0 on (the
copy-on-read rule's shape, which no growth rule sees). In the growing one, the objects are
``cor_regions`` regions, and in epoch ``e`` each worker reads region ``e`` (modulo
``cor_regions``) once.
It reads it at its first batch of the epoch's last round (a batch index among the last
``num_workers``), not its first: the copies are made by the time the epoch ends, and the
next epoch's first batches, prefetched as soon as it begins, copy nothing, so a read of the
workers' memory just after an epoch end sees that epoch's copies and no more. Each batch
also waits as if it read its sample from storage, so that an epoch lasts about
``cor_epoch_s`` whatever the worker count: the tracker reads every worker's USS at each
epoch end, and those reads (a few milliseconds per worker here) must end before the next
epoch does. Sized for a small machine: 8 regions of 40 MiB (320 MiB in the parent), at most
40 MiB per worker and epoch; the growth stops after 8 epochs, when every region was read.

NOTE [CUDA in the parent]: the parent decides whether a GPU exists through NVML
(``leakcheck.observe.nvml.availability``), which never initialises CUDA. ``torch.cuda`` is touched
only where the work runs: in a worker, or in the parent when it runs the batches itself
(0 workers) and NVML said a GPU exists. A parent that initialised CUDA would break forked
workers and keep a context of its own for the rest of the sweep.

NOTE [epoch numbers in the worker]: a persistent worker cannot see epoch boundaries, yet the
cache must grow by exactly one tensor per epoch per worker. The sampler runs in the parent
and is iterated afresh each epoch, so it hands ``(epoch, batch)`` pairs to the dataset; a
worker caches one tensor the first time it meets a new epoch number.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from leakcheck.core.model import MIB

Scenario = Literal[
    "clean", "persistent-cache", "orphan", "copy-on-read", "copy-on-read-growing", "fd-pressure"
]
SCENARIOS: tuple[Scenario, ...] = (
    "clean",
    "persistent-cache",
    "orphan",
    "copy-on-read",
    "copy-on-read-growing",
    "fd-pressure",
)
FD_PRESSURE_LIMIT = 256
"""The soft descriptor limit an ``fd-pressure`` worker sets itself (never raised)."""
COPY_ON_READ: tuple[Scenario, ...] = ("copy-on-read", "copy-on-read-growing")
START_METHODS: tuple[str, ...] = ("spawn", "fork", "forkserver")

ORPHAN_READY = "leakcheck-orphan-ready"
"""The line an orphan prints once it holds its memory (its starter waits for it)."""

# The grandchild of the ``orphan`` scenario. argv: bytes, device, lifetime_s, use_cuda.
# It holds its memory, says so, and sleeps; the lifetime cap keeps a forgotten one from
# living for ever.
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
print("READY", flush=True)
try:
    sys.stdout.close()
except OSError:
    pass
time.sleep(lifetime_s)
""".replace("READY", ORPHAN_READY)

# Started by the parent itself (0 workers): a middle process starts the sleeper and exits
# at once, so the sleeper is reparented away exactly like a worker's grandchild.
_LAUNCHER_CODE = """\
# leakcheck sweep --scenario orphan: launcher (exits at once)
import subprocess, sys
subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, close_fds=True)
"""


@dataclass(frozen=True)
class WorkloadSpec:
    """What the built-in loader does.

    Attributes:
        scenario: ``clean``, ``persistent-cache`` or ``orphan``.
        batches: Batches per epoch.
        batch_size: Rows per batch.
        features: Columns per row (the matrix multiplied is features x features).
        start_method: Multiprocessing start method of the workers.
        persistent: Keep workers alive across epochs (always on for ``persistent-cache``).
        device_index: The CUDA device the work runs on, when there is a GPU.
        gpu: NVML found a GPU (decided in the parent without initialising CUDA).
        cache_bytes_per_epoch: What a ``persistent-cache`` process keeps per epoch.
        orphan_bytes: What an ``orphan`` grandchild holds on the GPU.
        orphan_lifetime_s: Hard cap on an orphan's life.
        cor_bytes: Python objects the ``copy-on-read`` dataset holds, each worker's copy.
        cor_bytes_per_epoch: Python objects a ``copy-on-read-growing`` worker reads per epoch
            (about what it copies).
        cor_regions: Regions of objects the ``copy-on-read-growing`` dataset holds (one per
            epoch).
        cor_epoch_s: About how long a copy-on-read epoch lasts (its batches wait).

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
        """Whether workers live across epochs (the cache and copy-on-read scenarios need it)."""
        return self.persistent or self.scenario in (
            "persistent-cache",
            "fd-pressure",
            *COPY_ON_READ,
        )

    @property
    def effective_start_method(self) -> str:
        """How workers start: ``fork`` for copy-on-read where the platform has it.

        A spawned worker unpickles its own copy of the dataset: nothing shared, nothing
        copied on read.
        """
        if self.scenario in COPY_ON_READ and "fork" in multiprocessing.get_all_start_methods():
            return "fork"
        return self.start_method


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
    """Map-style dataset: item ``(epoch, batch)`` is one whole batch (a CPU tensor).

    Args:
        spec: The workload.

    """

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
            # Only ask torch where NVML already said a GPU exists: NOTE [CUDA in the parent].
            # A forked child of a parent that used CUDA cannot use it again.
            bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
            self._use_cuda = bool(self.spec.gpu and not bad_fork() and torch.cuda.is_available())
        if self._use_cuda:
            return torch.device("cuda", self.spec.device_index)
        return torch.device("cpu")

    def __getitem__(self, index: tuple[int, int]) -> Any:
        import torch

        epoch, batch = index
        device = self._device()
        if self.spec.scenario == "persistent-cache" and epoch not in self._cached_epochs:
            self._cached_epochs.add(epoch)
            self._cache.append(self._keep(device))
        if self.spec.scenario == "fd-pressure" and not self._cache:
            self._cache = hold_descriptors()
        if self.spec.scenario == "orphan" and not self._orphan_started:
            self._orphan_started = True
            start_orphan(self.spec, use_cuda=device.type == "cuda")
        if self._objects:
            workers = _worker_count()
            if epoch in self._cached_epochs:
                pass
            elif self.spec.scenario == "copy-on-read":
                self._cached_epochs.add(epoch)  # read whole at its first batch of each epoch
                _read_objects(self._objects[0])
            elif batch >= self.spec.batches - workers:
                self._cached_epochs.add(epoch)
                _read_objects(self._objects[epoch % len(self._objects)])
            time.sleep(self.spec.cor_epoch_s * workers / self.spec.batches)
        generator = torch.Generator().manual_seed(epoch * 100_003 + batch)
        rows = torch.randn(self.spec.batch_size, self.spec.features, generator=generator)
        weights = torch.randn(self.spec.features, self.spec.features, generator=generator)
        result = torch.tanh(rows.to(device) @ weights.to(device))
        return result.to("cpu")

    def _keep(self, device: Any) -> Any:
        import torch

        tensor = torch.empty(self.spec.cache_bytes_per_epoch, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            # Touch it, so that the memory is really used, not only reserved.
            tensor.fill_(1)
        # On the CPU the pages stay untouched: the host has no per-process GPU memory to
        # show, and committing gigabytes of RAM would only slow the machine down.
        return tensor


_INT_BYTES = 36
"""A Python int above 256 is its own 28-byte object, plus its 8-byte slot in a list."""
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


def _worker_count() -> int:
    """The loader's workers, seen from one of them; 1 where the parent does the work."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return info.num_workers if info is not None else 1


def _read_objects(region: list[list[int]]) -> int:
    """Read every object of a region: each visit writes its reference count."""
    return sum(sum(values) for values in region)


def start_orphan(spec: WorkloadSpec, *, use_cuda: bool) -> int | None:
    """Start the ``orphan`` scenario's sleeper and wait until it holds its memory.

    From a worker the sleeper is a direct child (it becomes an orphan when the worker
    exits); from the parent it goes through a launcher that exits at once.

    Returns:
        The launcher's or the sleeper's PID, or None if it could not be started.

    """
    sleeper = [
        sys.executable,
        "-c",
        _ORPHAN_CODE,
        str(spec.orphan_bytes),
        str(spec.device_index),
        str(spec.orphan_lifetime_s),
        "1" if use_cuda else "0",
    ]
    import torch.utils.data

    in_worker = torch.utils.data.get_worker_info() is not None
    argv = sleeper if in_worker else [sys.executable, "-c", _LAUNCHER_CODE, *sleeper]
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            close_fds=True,
            text=True,
        )
    except OSError:
        return None
    assert process.stdout is not None
    # Wait until the sleeper holds its memory: otherwise the tracker could take the final
    # state before the leak exists. EOF (a crash) ends the wait too.
    process.stdout.readline()
    process.stdout.close()
    if not in_worker:
        process.wait()  # the launcher has exited: reap it, no zombie in the parent
    return process.pid


def hold_descriptors() -> list[Any]:
    """In a loader's worker: a soft limit of ``FD_PRESSURE_LIMIT``, 90% of it held open."""
    import resource

    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        return []  # the sweep's own process (0 workers): its limit is the sweep's
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > FD_PRESSURE_LIMIT:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_PRESSURE_LIMIT, hard))
        soft = FD_PRESSURE_LIMIT
    held: list[Any] = []
    while len(os.listdir("/proc/self/fd")) < 0.9 * soft:
        held.append(open(os.devnull, "rb"))  # noqa: SIM115 - held open on purpose
    return held


def make_loader(spec: WorkloadSpec, num_workers: int) -> Iterable[Any]:
    """Build the built-in DataLoader for one configuration.

    Args:
        spec: The workload.
        num_workers: DataLoader workers (0: the parent does the work).

    Returns:
        A ``torch.utils.data.DataLoader``; each ``iter()`` is one epoch.

    """
    from torch.utils.data import DataLoader

    options: dict[str, Any] = {}
    if num_workers > 0:
        options["multiprocessing_context"] = spec.effective_start_method
        options["persistent_workers"] = spec.persistent_workers
    # No worker_init_fn: the sweep chains leakcheck's into every DataLoader, this one too
    # (NOTE [the watch() code path] in sweep.py).
    return DataLoader(
        SyntheticDataset(spec),  # type: ignore[arg-type]  # torch stays a lazy import
        batch_size=None,
        sampler=EpochSampler(spec.batches),
        num_workers=num_workers,
        **options,
    )


def builtin_factory(spec: WorkloadSpec) -> Callable[[int], Iterable[Any]]:
    """A loader factory (``FACTORY(num_workers)``) for the built-in workload."""

    def factory(num_workers: int) -> Iterable[Any]:
        return make_loader(spec, num_workers)

    factory.__qualname__ = f"builtin[{spec.scenario}]"
    return factory


def with_gpu(spec: WorkloadSpec, gpu: bool) -> WorkloadSpec:
    """The same spec with the parent's decision about the GPU."""
    return replace(spec, gpu=gpu)


def describe(spec: WorkloadSpec) -> str:
    """One line for the report header."""
    where = f"cuda:{spec.device_index}" if spec.gpu else "cpu"
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
