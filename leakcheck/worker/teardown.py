"""Teardown policy: children free, the parent leaves to the runtime at exit.

NOTE [teardown policy]: a DataLoader worker that touched CUDA holds a whole context
(~0.5 GiB) until the kernel reaps it, and a worker whose parent died may never exit at all.
:class:`WorkerInit` (the chained ``worker_init_fn``) installs in each worker:

1. ``PR_SET_PDEATHSIG``: the kernel sends the worker SIGTERM when its parent dies.
2. The worker posts its identity ``(pid, start_ticks)`` to the mailbox (NOTE [worker
   mailbox] in mailbox.py) with its birth reading: its own host memory and whether it was
   forked, the baseline of what it copies later (NOTE [copy on read] in hostmem.py).
3. At worker exit (a ``multiprocessing.util.Finalize`` hook: workers leave through
   multiprocessing's bootstrap, which runs finalizers, not ``atexit``) it reads its own host
   memory and, only where CUDA was initialised in it, joins every registered side stream
   into the current stream (never free memory a side stream may still use: the cuDNN dgrad
   race), synchronises, drops registered streams and events, calls registered callables,
   collects garbage, empties the allocator cache and releases the context
   (``cudaDeviceReset``). Then it waits for NVML to drop its PID and posts a ``teardown``
   record of what it held and freed. A teardown never raises: a failing step is one line of
   the record and the worker exits normally.
4. In the parent nothing is destroyed at interpreter shutdown: once it is exiting (our
   ``atexit`` hook ran, or ``sys.is_finalizing()``), registered resources are leaked to the
   CUDA runtime: destroying a stream or event after the runtime tore the context down is how
   processes segfault at exit.
5. The worker's ``faulthandler`` writes into its own file in the mailbox
   (``mailbox.stack_path``): a native crash leaves its Python stacks there for the ``died``
   finding, and ``mailbox.STACK_SIGNAL`` writes them there and goes on (NOTE [hang watch] in
   hang.py). A normal exit removes the file.

The kernel sends the death signal when the *thread* that started the worker exits: a
persistent worker started from a short-lived thread would be killed under its loader, so
:func:`leakcheck.watch` asks for it only from the main thread (``WorkerInit.death_signal``).
Without it a worker still exits when its parent dies: DataLoader workers watch its PID.

After ``cudaDeviceReset`` the process must not use CUDA again: torch still holds handles
(cuBLAS, cuDNN, streams) tied to the old context.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from leakcheck.core.errors import LeakCheckError, UsageError
from leakcheck.core.model import MIB, ProcessKey, TeardownRecord
from leakcheck.core.records import to_jsonable
from leakcheck.observe import hostmem, mailbox, procs
from leakcheck.observe.torch_state import clear_library_workspaces, initialized_cuda

__all__ = [
    "ReleaseResult",
    "WorkerInit",
    "register_resource",
    "release_device",
    "unregister_resource",
    "worker_init_fn",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Higher runs first: before the worker's queues are flushed and its children joined.
_EXIT_PRIORITY = 100
_CHILD_TERM_TIMEOUT_S = 1.0
_NVML_POLL_S = 1.0
"""How long to wait for NVML to drop the PID after the reset (it takes ~ms)."""
_HOST_FIELDS = ("uss", "pss", "rss", "rss_peak", "shared_dirty", "private_dirty")
_BIRTH_HOST_FIELDS = ("uss", "rss", "shared_dirty", "private_dirty")

ResourceKind = Literal["stream", "event", "callable"]


@dataclass(frozen=True)
class _Registered:
    owner_pid: int
    kind: ResourceKind
    resource: Any


_registry: list[_Registered] = []
_registry_lock = threading.Lock()
_shutting_down = False


def _after_fork_in_child() -> None:
    # A lock held by another thread at fork time would stay held forever in the child.
    global _registry_lock
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _kind_of(resource: object) -> ResourceKind | None:
    # Duck-typed so that registering never imports torch.
    if hasattr(resource, "record_event") and hasattr(resource, "wait_event"):
        return "stream"
    if hasattr(resource, "record") and hasattr(resource, "synchronize"):
        return "event"
    return "callable" if callable(resource) else None


def _mark_shutdown() -> None:
    """``atexit`` hook: leave every registered resource alive (NOTE [teardown policy], 4).

    Each gets a reference never dropped, so that no destructor runs after the runtime.
    """
    global _shutting_down
    _shutting_down = True
    with _registry_lock:
        for entry in _registry:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry.resource))
        _registry.clear()


atexit.register(_mark_shutdown)


def register_resource(resource: object) -> None:
    """Hand a CUDA stream, CUDA event or callable to the teardown policy.

    A worker's teardown (or :func:`release_device` in the parent) joins registered streams,
    drops streams and events and calls callables before emptying the cache and releasing
    the context; at interpreter shutdown nothing is released (NOTE [teardown policy]). The
    registry holds a strong reference until then.

    Raises:
        UsageError: The resource is none of these.

    """
    kind = _kind_of(resource)
    if kind is None:
        raise UsageError(
            "register_resource: expected a CUDA stream, a CUDA event or a callable, "
            f"got {type(resource).__name__}"
        )
    with _registry_lock:
        _registry.append(_Registered(os.getpid(), kind, resource))
    # Re-registered last, the hook runs first among atexit hooks (torch's among them).
    atexit.unregister(_mark_shutdown)
    atexit.register(_mark_shutdown)


def unregister_resource(resource: object) -> bool:
    """Remove a resource registered by this process; True when it was registered."""
    with _registry_lock:
        for index, entry in enumerate(_registry):
            if entry.resource is resource and entry.owner_pid == os.getpid():
                del _registry[index]
                return True
    return False


def _take_registered() -> list[_Registered]:
    """Remove and return this process's entries; a forked child skips its parent's."""
    pid = os.getpid()
    with _registry_lock:
        mine = [entry for entry in _registry if entry.owner_pid == pid]
        _registry[:] = [entry for entry in _registry if entry.owner_pid != pid]
    return mine


# --- CUDA steps -------------------------------------------------------------------------


@dataclass
class _Freed:
    streams_joined: int = 0
    resources_released: int = 0
    freed_cache_bytes: int = 0
    context_released: bool = False
    errors: list[str] = field(default_factory=list)

    def fail(self, step: str, exc: BaseException) -> None:
        self.errors.append(f"{step}: {_one_line(exc)}")

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a step; what it raises is one line of the record, never the caller's."""
        try:
            yield
        except Exception as exc:
            self.fail(name, exc)

    @property
    def error(self) -> str | None:
        return "; ".join(self.errors) or None


def _release_registered(entries: list[_Registered], devices: set[int], freed: _Freed) -> None:
    """Join side streams, synchronise, drop streams and events, call callables."""
    import torch

    for entry in entries:
        if entry.kind != "stream":
            continue
        with freed.step("join stream"):
            stream = entry.resource
            torch.cuda.current_stream(stream.device).wait_event(stream.record_event())
            devices.add(int(stream.device.index or 0))
            freed.streams_joined += 1
    for index in sorted(devices):
        with freed.step(f"synchronize cuda:{index}"):
            torch.cuda.synchronize(index)
    callables = [entry.resource for entry in entries if entry.kind == "callable"]
    freed.resources_released += len(entries)
    entries.clear()  # the last references to streams and events: dropped once synchronised
    for release in callables:
        with freed.step("callable"):
            release()


def _empty_cache(devices: set[int], freed: _Freed) -> None:
    import torch

    gc.collect()
    with freed.step("empty_cache"):
        freed.freed_cache_bytes = sum(int(torch.cuda.memory_reserved(i)) for i in devices)
        torch.cuda.empty_cache()


_DeviceReset = Callable[[int, bool], int]
"""``reset(index, switch)``: release a device's context, first making it current if asked."""
_reset_fn: _DeviceReset | None = None


def _mapped_library(stem: str) -> ctypes.CDLL | None:
    """A shared library already mapped into this process (``libcudart.so``), or None."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if os.path.basename(path).startswith(stem):
                # RTLD_NOLOAD: bind to the copy torch loaded, never load a second one.
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    return None


def _runtime_reset(set_device: Callable[[int], Any], reset: Callable[[], Any]) -> _DeviceReset:
    def device_reset(index: int, switch: bool) -> int:
        code = int(set_device(index) or 0) if switch else 0
        return code or int(reset() or 0)

    return device_reset


def _device_reset_fn() -> _DeviceReset:
    """How to release a device's context, in order of preference.

    ``torch.cuda.cudart()`` where it has ``cudaDeviceReset``, else the ``libcudart`` torch
    mapped (pip wheels), else the driver's ``cuDevicePrimaryCtxReset`` (a static runtime).
    """
    global _reset_fn
    if _reset_fn is not None:
        return _reset_fn
    import torch

    cudart_of: Callable[[], Any] = torch.cuda.cudart  # untyped in torch
    try:
        cudart = cudart_of()
    except Exception:
        cudart = None
    if hasattr(cudart, "cudaDeviceReset") and hasattr(cudart, "cudaSetDevice"):
        _reset_fn = _runtime_reset(cudart.cudaSetDevice, cudart.cudaDeviceReset)
    elif (runtime := _mapped_library("libcudart.so")) is not None:
        set_device = runtime.cudaSetDevice
        _reset_fn = _runtime_reset(
            lambda index: set_device(ctypes.c_int(index)), runtime.cudaDeviceReset
        )
    else:
        driver = _mapped_library("libcuda.so")
        if driver is None:
            raise LeakCheckError("no CUDA runtime or driver library is mapped in this process")
        reset = getattr(driver, "cuDevicePrimaryCtxReset_v2", None)
        reset = reset or driver.cuDevicePrimaryCtxReset

        def via_driver(index: int, switch: bool) -> int:
            device = ctypes.c_int()
            code = int(driver.cuDeviceGet(ctypes.byref(device), ctypes.c_int(index)))
            return code or int(reset(device))

        _reset_fn = via_driver
    return _reset_fn


def _reset_devices(devices: set[int], current: int, freed: _Freed) -> None:
    """Release the primary context of each device, the current device last.

    Switching to a device whose context is gone would create a new one (CUDA 12's
    ``cudaSetDevice``), hence the order; the runtime's reset acts on the thread's current
    device, so once another was reset, the current one is switched back to first.
    """
    try:
        reset = _device_reset_fn()
    except Exception as exc:
        freed.fail("find cudaDeviceReset", exc)
        return
    ok = True
    order = sorted(devices - {current}) + ([current] if current in devices else [])
    switched = False
    for index in order:
        switch = switched or index != current
        try:
            code = reset(index, switch)
        except Exception as exc:
            freed.fail(f"reset cuda:{index}", exc)
            ok = False
            continue
        switched = switch
        if code:
            freed.fail(f"reset cuda:{index}", LeakCheckError(f"CUDA error {code}"))
            ok = False
    freed.context_released = ok
    if current not in devices and order:
        # The current device keeps its context: point the thread back at it.
        import torch

        with freed.step(f"set_device cuda:{current}"):
            torch.cuda.set_device(current)


def _used_devices() -> tuple[int, set[int]]:
    """The current device and the devices on which this process has a context."""
    import torch

    current = int(torch.cuda.current_device())
    # memory_reserved reads allocator bookkeeping: no context is created for it.
    count = int(torch.cuda.device_count())
    return current, {current} | {i for i in range(count) if torch.cuda.memory_reserved(i) > 0}


# --- NVML -------------------------------------------------------------------------------


def _nvml_state(pid: int, device: int | None = None) -> tuple[bool, dict[int, int]] | None:
    """(NVML lists the PID, its known bytes per device); None: NVML cannot be read."""
    from leakcheck.observe import nvml

    try:
        entries = nvml.get().processes(None if device is None else [device])
    except LeakCheckError:
        return None
    by_pid, _unknown = nvml.gpu_bytes_by_pid(entries)
    return pid in by_pid, dict(by_pid.get(pid, {}))


def _wait_left_nvml(pid: int, device: int | None = None) -> tuple[bool, dict[int, int]] | None:
    """Poll NVML until the PID is gone (or ``_NVML_POLL_S`` passed)."""
    deadline = time.monotonic() + _NVML_POLL_S
    while True:
        state = _nvml_state(pid, device)
        if state is None or not state[0] or time.monotonic() >= deadline:
            return state
        time.sleep(0.01)


def _total(per_device: dict[int, int] | None) -> int | None:
    return sum(per_device.values()) if per_device else None


# --- worker side ------------------------------------------------------------------------


def _set_parent_death_signal() -> None:
    # A parent that died before prctl sends nothing; workers also watch its PID themselves.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _terminate_descendants() -> None:
    """SIGTERM, then SIGKILL, this process's live descendants.

    psutil refuses to signal a PID reused since it listed the child: only those listed here
    are ever signalled.
    """
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=_CHILD_TERM_TIMEOUT_S)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _host_fields(host: hostmem.HostMemory | None, names: tuple[str, ...]) -> dict[str, Any]:
    """``host_uss_bytes`` and the rest, as the mailbox records name them."""
    return {f"host_{name}_bytes": getattr(host, f"{name}_bytes", None) for name in names}


def _worker_teardown(policy: WorkerInit, key: ProcessKey, worker_id: int) -> None:
    """Run at worker exit (NOTE [teardown policy], point 3); never raises.

    First the worker's report of what it holds (NOTE [worker reports] in track/book.py),
    then, with ``release``, the release.
    """
    if os.getpid() != key.pid:
        return  # a process forked from the worker inherited the finalizer
    started = time.perf_counter()
    freed = _Freed()
    cuda = False
    held: dict[int, int] | None = None
    peak_reserved: int | None = None
    measured_s: float | None = None
    left_nvml: bool | None = None
    host: hostmem.HostMemory | None = None
    try:
        if policy.terminate_children:
            with freed.step("terminate children"):
                _terminate_descendants()
        torch_cuda = initialized_cuda()
        cuda = torch_cuda is not None
        measured_s = time.monotonic()
        with freed.step("host memory"):  # what it held, before anything is released
            host = hostmem.read_host_memory(key.pid)
        held = {}  # no context: nothing on any device
        if torch_cuda is not None:
            nvml_state = _nvml_state(key.pid)
            held = None if nvml_state is None else nvml_state[1]
            with contextlib.suppress(Exception):
                peak_reserved = sum(
                    int(torch_cuda.max_memory_reserved(i))
                    for i in range(int(torch_cuda.device_count()))
                )
            if policy.release:
                current, devices = _used_devices()
                _release_registered(_take_registered(), devices, freed)
                _empty_cache(devices, freed)
                _reset_devices(devices, current, freed)
        duration_s = time.perf_counter() - started
        if cuda and policy.release and held:
            after = _wait_left_nvml(key.pid)
            left_nvml = None if after is None else not after[0]
    except BaseException as exc:  # a teardown must let the worker exit
        freed.fail("teardown", exc)
        duration_s = time.perf_counter() - started
    record = TeardownRecord(
        key=key,
        worker_id=worker_id,
        cuda_initialized=cuda,
        streams_joined=freed.streams_joined,
        resources_released=freed.resources_released,
        freed_cache_bytes=freed.freed_cache_bytes,
        context_released=freed.context_released,
        gpu_bytes_before=_total(held),
        left_nvml=left_nvml,
        duration_s=duration_s,
        error=freed.error,
        gpu_bytes_by_device=held,
        peak_reserved_bytes=peak_reserved,
        monotonic_s=measured_s,
        released=policy.release,
        **_host_fields(host, _HOST_FIELDS),
    )
    _close_stack_file()
    fields = to_jsonable(record)
    del fields["key"]
    mailbox.post(
        "teardown",
        {"pid": key.pid, "start_ticks": key.start_ticks, **fields},
        directory=policy.mailbox_dir,
    )


_stack_file: Any = None
"""The worker's open faulthandler file (NOTE [teardown policy], point 5)."""


def _open_stack_file(path: str) -> bool:
    """Point the worker's faulthandler at ``path``; True when it also dumps on a signal.

    The signal is taken only where nothing handles it yet: its default ends the process, and
    a handler of the user's is theirs. Never raises.
    """
    global _stack_file
    try:
        # Appending: the tracker empties the file after reading a dump, in place.
        handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
        # Not enabled yet, enable() chains to torch's worker handlers: the stack, then
        # torch's message. Enabled already (inherited: pytest, -X faulthandler), torch's
        # handlers, installed since, would run instead of it; disabled first, it restores
        # the parent's over torch's: the stack is written, torch's message lost.
        if faulthandler.is_enabled():
            faulthandler.disable()
        faulthandler.enable(file=handle, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        return False
    _stack_file = handle
    try:
        if signal.getsignal(mailbox.STACK_SIGNAL) != signal.SIG_DFL:
            return False
        faulthandler.register(mailbox.STACK_SIGNAL, file=handle, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        return False
    return True


def _close_stack_file() -> None:
    """A normal exit: nothing crashed, so the file goes."""
    global _stack_file
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return  # a thread holds the exit: its stacks stay askable (NOTE [exit watch] in hang.py)
    handle, _stack_file = _stack_file, None
    if handle is None:
        return
    with contextlib.suppress(Exception):
        faulthandler.unregister(mailbox.STACK_SIGNAL)
        # Unregistered, the signal would end the process: a dump sent before the watch
        # sees this worker gone must not kill it on its way out.
        signal.signal(mailbox.STACK_SIGNAL, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        faulthandler.disable()
        handle.close()
        os.unlink(handle.name)


def _birth_fields(pid: int, *, forked: bool) -> dict[str, Any]:
    """A worker's birth reading for its ``worker`` record (NOTE [copy on read] in hostmem.py).

    Never raises: an unreadable one posts none.
    """
    try:
        host = hostmem.read_host_memory(pid)
    except Exception:
        host = None
    fields: dict[str, Any] = {"forked": forked, "monotonic_s": time.monotonic()}
    if host is not None and host.uss_bytes is not None:
        fields.update(_host_fields(host, _BIRTH_HOST_FIELDS))
    return fields


class WorkerInit:
    """A picklable ``worker_init_fn`` that installs the teardown policy in each worker.

    Build it with :func:`worker_init_fn`; a class, not a closure, so that ``spawn`` and
    ``forkserver`` workers can unpickle it.
    """

    def __init__(
        self,
        user_fn: Callable[[int], object] | None = None,
        *,
        terminate_children: bool = False,
        release: bool = True,
        persistent: bool | None = None,
        mailbox_dir: str | None = None,
        session_id: str | None = None,
    ) -> None:
        self.user_fn = user_fn
        self.terminate_children = terminate_children
        self.release = release
        self.persistent = persistent
        self.mailbox_dir = mailbox_dir
        self.session_id = session_id
        self.death_signal = True
        """Set ``PR_SET_PDEATHSIG`` (with ``release``); ``watch`` clears it for workers
        started from a thread other than the main thread (NOTE [teardown policy])."""
        self._home_pid = os.getpid()
        """The process whose memory holds this object: a worker that finds another one was
        forked; spawn and forkserver unpickle it anew."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._home_pid = os.getpid()

    def __repr__(self) -> str:
        return (
            f"leakcheck.worker_init_fn({self.user_fn!r}, release={self.release}, "
            f"terminate_children={self.terminate_children})"
        )

    def __call__(self, worker_id: int) -> None:
        """Run in the worker: policy first, then the user's own ``worker_init_fn``."""
        # A forkserver worker inherits the server's environment, not the trainer's: carry
        # the session and mailbox, exported for the worker's own children too.
        if self.session_id:
            os.environ[procs.SESSION_ENV] = self.session_id
        if self.mailbox_dir:
            os.environ[mailbox.MAILBOX_ENV] = self.mailbox_dir
        if self.release and self.death_signal:
            _set_parent_death_signal()
        pid = os.getpid()
        key = procs.process_key(pid)
        if key is not None:
            folder = self.mailbox_dir or os.environ.get(mailbox.MAILBOX_ENV)
            # Before the record: the tracker signals only a worker whose record says so.
            dumps = bool(folder) and _open_stack_file(mailbox.stack_path(folder or "", key))
            mailbox.post(
                "worker",
                {
                    "pid": pid,
                    "start_ticks": key.start_ticks,
                    "ppid": os.getppid(),
                    "worker_id": worker_id,
                    "persistent": self.persistent,
                    "stack_signal": int(mailbox.STACK_SIGNAL) if dumps else None,
                    **(_birth_fields(pid, forked=self._home_pid != pid) if folder else {}),
                },
                directory=self.mailbox_dir,
            )
            if self.release or self.terminate_children or folder:
                # Reported even without the release (NOTE [worker reports] in track/book.py).
                import multiprocessing.util

                multiprocessing.util.Finalize(
                    None, _worker_teardown, args=(self, key, worker_id), exitpriority=_EXIT_PRIORITY
                )
        if self.user_fn is not None:
            self.user_fn(worker_id)


def worker_init_fn(
    user_fn: Callable[[int], object] | None = None,
    *,
    terminate_children: bool = False,
    release: bool = True,
    persistent: bool | None = None,
) -> WorkerInit:
    """Return a ``worker_init_fn`` for ``torch.utils.data.DataLoader`` with the policy.

    Use it without :func:`leakcheck.watch` to get the teardown policy alone::

        loader = DataLoader(ds, num_workers=4, worker_init_fn=leakcheck.worker_init_fn(seed))

    In each worker it sets ``PR_SET_PDEATHSIG``, reports the worker to a running tracker (if
    any) and at exit releases its CUDA resources (NOTE [teardown policy]); then it calls
    ``user_fn(worker_id)``.

    Args:
        user_fn: Your own ``worker_init_fn``; it still runs, after the policy is installed.
        terminate_children: At worker exit, SIGTERM (then SIGKILL after 1 s) the worker's
            own live descendants, so none outlives the loader.
        release: Release CUDA resources at worker exit (False: only report).
        persistent: The loader uses ``persistent_workers`` (None: unknown).

    Returns:
        A picklable callable (works with fork, spawn and forkserver).

    """
    return WorkerInit(
        user_fn, terminate_children=terminate_children, release=release, persistent=persistent
    )


# --- parent side: explicit release -------------------------------------------------------


@dataclass(frozen=True)
class ReleaseResult:
    """What :func:`release_device` freed.

    Attributes:
        device_index: The CUDA device released (None when nothing was done).
        freed_cache_bytes: Bytes the allocator had reserved before its cache was emptied.
        context_released: The device's context was released (``cudaDeviceReset``).
        gpu_bytes_before: NVML's used bytes of this process before (None: unknown).
        gpu_bytes_after: Its bytes after (0: it left the device list; None: unknown).
        duration_s: Seconds it took.
        note: One line on what happened, e.g. why there was nothing to free.
        error: One line if a step failed.

    """

    device_index: int | None
    freed_cache_bytes: int
    context_released: bool
    gpu_bytes_before: int | None
    gpu_bytes_after: int | None
    duration_s: float
    note: str = ""
    error: str | None = None


def _device_index(device: object) -> int:
    import torch

    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, bool):
        raise UsageError(f"release_device: expected a CUDA device index, got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        try:
            parsed = torch.device(device)  # type: ignore[call-overload]
        except (RuntimeError, TypeError) as exc:
            raise UsageError(
                f"release_device: expected a CUDA device such as 0 or 'cuda:0', got {device!r}"
            ) from exc
        if parsed.type != "cuda":
            raise UsageError(f"release_device: expected a CUDA device, got {device!r}")
        index = int(parsed.index) if parsed.index is not None else int(torch.cuda.current_device())
    count = int(torch.cuda.device_count())
    if not 0 <= index < count:
        raise UsageError(
            f"release_device: CUDA device {index} out of range (this process sees {count})"
        )
    return index


# Threads that cannot use a device: multiprocessing's queue feeders only write to pipes, and
# a finished loader's pin-memory thread waits on an empty queue.
_DEVICE_FREE_THREADS = ("QueueFeederThread", "_pin_memory_loop")


def _other_threads() -> list[str]:
    """Live threads that might use the device: not this one, leakcheck's or device-free."""
    current = threading.current_thread()
    return [
        thread.name
        for thread in threading.enumerate()
        if thread is not current
        and not (thread.daemon and thread.name.startswith("leakcheck"))
        and not any(marker in thread.name for marker in _DEVICE_FREE_THREADS)
    ]


def _live_tensors_text(index: int) -> str:
    """The largest live CUDA tensors on ``cuda:index``, for a refusal's message."""
    import torch

    sizes: dict[str, list[int]] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or not obj.is_cuda or obj.device.index != index:
                continue
            shape = "x".join(str(d) for d in obj.shape) or "scalar"
            key = f"{str(obj.dtype).removeprefix('torch.')}[{shape}]"
            sizes.setdefault(key, []).append(obj.untyped_storage().nbytes())
        except Exception:
            continue
    largest = sorted(sizes.items(), key=lambda kv: -sum(kv[1]))[:3]
    return ", ".join(
        f"{len(found)} x {name} ({sum(found) / MIB:.1f} MiB)" for name, found in largest
    )


def _nvml_index(cuda_index: int) -> int | None:
    """NVML index of a CUDA device (NVML ignores ``CUDA_VISIBLE_DEVICES``); None: unknown."""
    import torch

    from leakcheck.observe import nvml

    try:
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid).removeprefix("GPU-")
        for state in nvml.get().memory():
            if state.uuid.removeprefix("GPU-") == uuid:
                return state.index
    except Exception:
        return None
    return None


def _nothing_done(note: str) -> ReleaseResult:
    return ReleaseResult(None, 0, False, None, None, 0.0, note=note)


def release_device(device: object = None, *, force: bool = False) -> ReleaseResult:
    """Release this process's CUDA context on one device, and report what was freed.

    For a benchmark or a job that must let the GPU go before it exits (to let it cool and
    clock down between measured runs), or a long-lived process done with its GPU work: a
    context holds ~0.5 GiB and keeps the clocks high until it is gone.

    The steps of a worker's teardown (NOTE [teardown policy]). Do not use CUDA in this
    process afterwards. It never initialises CUDA, and during interpreter shutdown does
    nothing (the runtime releases everything); the result's note says so.

    Args:
        device: CUDA device index, ``"cuda:N"`` or ``torch.device``; None: the current one.
        force: Release even while tensors are allocated or other threads may use the
            device (their tensors become invalid).

    Raises:
        LeakCheckError: Tensors are still allocated on the device, or other threads are
            alive, and ``force`` is False. The message says which.
        UsageError: ``device`` is not a CUDA device of this process.

    """
    if _shutting_down or sys.is_finalizing():
        return _nothing_done("interpreter is exiting: left to the runtime")
    if initialized_cuda() is None:
        return _nothing_done("nothing to free: CUDA was never initialised in this process")
    import torch

    index = _device_index(device)
    if not force:
        gc.collect()  # tensors kept only by garbage cycles are not the caller's
        clear_library_workspaces()
        allocated = int(torch.cuda.memory_allocated(index))
        if allocated > 0:
            tensors = _live_tensors_text(index)
            which = f" (largest: {tensors})" if tensors else ""
            raise LeakCheckError(
                f"release_device: this process still holds {allocated / MIB:.1f} MiB of "
                f"tensors on cuda:{index}{which}; delete them first, or pass force=True"
            )
        others = _other_threads()
        if others:
            raise LeakCheckError(
                f"release_device: other threads may use cuda:{index} "
                f"({', '.join(others[:5])}); stop them first, or pass force=True"
            )
    started = time.perf_counter()
    nvml_index = _nvml_index(index)
    pid = os.getpid()
    before = _nvml_state(pid, nvml_index) if nvml_index is not None else None
    freed = _Freed()
    _release_registered(_take_registered(), {index}, freed)
    _empty_cache({index}, freed)
    _reset_devices({index}, int(torch.cuda.current_device()), freed)
    duration_s = time.perf_counter() - started
    after = _wait_left_nvml(pid, nvml_index) if before is not None and before[0] else None
    return ReleaseResult(
        device_index=index,
        freed_cache_bytes=freed.freed_cache_bytes,
        context_released=freed.context_released,
        gpu_bytes_before=_total(before[1]) if before is not None else None,
        gpu_bytes_after=(_total(after[1]) if after[0] else 0) if after is not None else None,
        duration_s=duration_s,
        note="context released" if freed.context_released else "context not released",
        error=freed.error,
    )
