"""Teardown policy: children free, the parent leaves to the runtime at exit.

NOTE [teardown policy]: a DataLoader worker that touched CUDA holds a whole context (~0.5 GiB)
until the kernel reaps it, and a worker whose parent died may never exit at all.
:class:`WorkerInit` (the chained ``worker_init_fn``) installs in each worker:

1. ``PR_SET_PDEATHSIG``: SIGTERM when the parent dies. The kernel sends it when the *thread*
   that started the worker exits, so :func:`leakcheck.watch` asks for it only from the main
   thread (``WorkerInit.death_signal``); without it DataLoader workers still watch its PID.
2. A ``worker`` record in the mailbox (NOTE [worker mailbox] in mailbox.py): its identity,
   birth reading and whether it was forked (NOTE [copy on read] in hostmem.py).
3. Its ``faulthandler`` writes into its own mailbox file (``mailbox.stack_path``): a native
   crash leaves its stacks there for the ``died`` finding, and ``mailbox.STACK_SIGNAL`` dumps
   them there and goes on (NOTE [hang watch] in hang.py). A normal exit removes the file.
4. At exit (a ``multiprocessing.util.Finalize`` hook: workers run finalizers, not ``atexit``)
   it reads its host memory and, with CUDA, joins registered side streams into the current
   stream (never free what a side stream may still use: the cuDNN dgrad race), synchronises,
   drops registered streams and events, calls registered callables, collects garbage, empties
   the allocator cache and resets the context; then it waits for NVML to drop its PID and
   posts a ``teardown`` record, which says whether a SIGINT reached it (a handler in place of
   Python's own notes it; NOTE [exit watch] in hang.py). A failing step is one line of the
   record, never raised. After the reset it must not use CUDA: torch still holds handles of
   the old context.
5. The parent destroys nothing at interpreter shutdown: once it is exiting (our ``atexit``
   hook ran, or ``sys.is_finalizing()``), registered resources are leaked to the runtime:
   destroying a stream or event after the context is gone segfaults at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import functools
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from leakcheck.core.errors import LeakCheckError, UsageError, one_line
from leakcheck.core.model import MIB, ProcessKey, TeardownRecord
from leakcheck.core.records import to_jsonable
from leakcheck.observe import hostmem, mailbox, procs
from leakcheck.observe.torch_state import clear_library_workspaces, initialized_cuda

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_EXIT_PRIORITY = 100  # higher runs first: before the worker's queues are flushed
_LAST_PRIORITY = -(2**31)  # after every other finalizer and the children's joins
_NVML_POLL_S = 1.0  # how long NVML may take to drop the PID after the reset (it takes ms)
_EXIT_HOST_FIELDS = tuple(n for n in TeardownRecord.__dataclass_fields__ if n.startswith("host_"))
# Threads that cannot use a device: multiprocessing's queue feeders only write to pipes, and
# a finished loader's pin-memory thread waits on an empty queue.
_DEVICE_FREE_THREADS = ("QueueFeederThread", "_pin_memory_loop")

_registry: list[tuple[int, Any]] = []  # (owner PID, resource): a forked child skips its parent's
_registry_lock = threading.Lock()
_shutting_down = False
_stack_file: Any = None  # the worker's open faulthandler file (NOTE [teardown policy], 3)


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()  # one held by another thread at the fork stays held


os.register_at_fork(after_in_child=_after_fork_in_child)


def _kind_of(resource: object) -> str | None:
    # Duck-typed so that registering never imports torch.
    if hasattr(resource, "record_event") and hasattr(resource, "wait_event"):
        return "stream"
    if hasattr(resource, "record") and hasattr(resource, "synchronize"):
        return "event"
    return "callable" if callable(resource) else None


def _mark_shutdown() -> None:
    # NOTE [teardown policy], 5: a reference never dropped: no destructor after the runtime's.
    global _shutting_down
    _shutting_down = True
    with _registry_lock:
        for _pid, resource in _registry:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(resource))
        _registry.clear()


atexit.register(_mark_shutdown)


def register_resource(resource: object) -> None:
    """Hand a CUDA stream, CUDA event or callable to the teardown policy (held strongly).

    A release (a worker's, or :func:`release_device`) joins and drops streams and events and
    calls callables first (NOTE [teardown policy]).

    Raises:
        UsageError: The resource is none of these.

    """
    if _kind_of(resource) is None:
        raise UsageError(
            "register_resource: expected a CUDA stream, a CUDA event or a callable, "
            f"got {type(resource).__name__}"
        )
    with _registry_lock:
        _registry.append((os.getpid(), resource))
    # Re-registered last, the hook runs first among atexit hooks (torch's among them).
    atexit.unregister(_mark_shutdown)
    atexit.register(_mark_shutdown)


def unregister_resource(resource: object) -> bool:
    """Remove a resource registered by this process; True when it was registered."""
    with _registry_lock:
        for index, (pid, registered) in enumerate(_registry):
            if registered is resource and pid == os.getpid():
                del _registry[index]
                return True
    return False


# --- the release (NOTE [teardown policy], 4) ----------------------------------------------


@dataclass
class _Freed:
    """What a release freed; a failing step is one line of ``errors``, never raised."""

    streams_joined: int = 0
    resources_released: int = 0
    freed_cache_bytes: int = 0
    context_released: bool = False
    errors: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self.errors.append(f"{name}: {one_line(exc)}")

    def fields(self) -> dict[str, Any]:
        """Its counts and ``error`` as ``TeardownRecord`` names them."""
        counts = {name: value for name, value in vars(self).items() if name != "errors"}
        return counts | {"error": "; ".join(self.errors) or None}


def _release(freed: _Freed, device: int | None = None) -> None:
    """Release registered resources, the allocator cache and contexts (None: every device used)."""
    import torch

    current = int(torch.cuda.current_device())
    if device is None:
        # memory_reserved reads allocator bookkeeping: no context is created for it.
        count = int(torch.cuda.device_count())
        devices = {i for i in range(count) if torch.cuda.memory_reserved(i) > 0} | {current}
    else:
        devices = {device}
    pid = os.getpid()
    with _registry_lock:
        mine = [resource for owner, resource in _registry if owner == pid]
        _registry[:] = [entry for entry in _registry if entry[0] != pid]
    synced = set(devices)
    for stream in mine:
        if _kind_of(stream) == "stream":
            with freed.step("join stream"):
                torch.cuda.current_stream(stream.device).wait_event(stream.record_event())
                synced.add(int(stream.device.index or 0))
                freed.streams_joined += 1
    for index in sorted(synced):
        with freed.step(f"synchronize cuda:{index}"):
            torch.cuda.synchronize(index)
    freed.resources_released += len(mine)
    callables = [resource for resource in mine if _kind_of(resource) == "callable"]
    mine.clear()  # the last references to streams and events: dropped once synchronised
    for release in callables:
        with freed.step("callable"):
            release()
    devices = synced if device is None else devices
    gc.collect()
    with freed.step("empty_cache"):
        freed.freed_cache_bytes = sum(int(torch.cuda.memory_reserved(i)) for i in devices)
        torch.cuda.empty_cache()
    # The current device last: switching to a device whose context is gone would create a
    # new one (CUDA 12's cudaSetDevice); the runtime's reset acts on the thread's current
    # device, so once another was reset, the current one is switched back to first.
    order = sorted(devices - {current}) + ([current] if current in devices else [])
    failed = len(freed.errors)
    with freed.step("find cudaDeviceReset"):
        reset = _device_reset()
        switched = False
        for index in order:
            with freed.step(f"reset cuda:{index}"):
                switch = switched or index != current
                code = reset(index, switch)
                switched = switch
                if code:
                    raise LeakCheckError(f"CUDA error {code}")
        freed.context_released = len(freed.errors) == failed
        if current not in devices and order:
            with freed.step(f"set_device cuda:{current}"):  # it keeps its context: point back
                torch.cuda.set_device(current)


@functools.cache
def _device_reset() -> Callable[[int, bool], int]:
    """``reset(index, switch to it first)``: a CUDA error code, 0 on success.

    The ``libcudart`` torch mapped (torch's own bindings have no ``cudaDeviceReset``), else
    the driver's ``cuDevicePrimaryCtxReset`` (a static runtime). RTLD_NOLOAD binds to the copy
    torch loaded, never a second one.
    """
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = [line.rstrip("\n").split(maxsplit=5)[-1] for line in maps]
    runtime_path, driver_path = (
        next((path for path in paths if os.path.basename(path).startswith(stem)), None)
        for stem in ("libcudart.so", "libcuda.so")
    )
    if runtime_path is not None:
        runtime = ctypes.CDLL(runtime_path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)

        def via_runtime(index: int, switch: bool) -> int:
            code = int(runtime.cudaSetDevice(index) or 0) if switch else 0
            return code or int(runtime.cudaDeviceReset() or 0)

        return via_runtime
    if driver_path is None:
        raise LeakCheckError("no CUDA runtime or driver library is mapped in this process")
    driver = ctypes.CDLL(driver_path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    primary_reset = getattr(driver, "cuDevicePrimaryCtxReset_v2", None)
    primary_reset = primary_reset or driver.cuDevicePrimaryCtxReset

    def via_driver(index: int, switch: bool) -> int:
        device = ctypes.c_int()
        code = int(driver.cuDeviceGet(ctypes.byref(device), ctypes.c_int(index)))
        return code or int(primary_reset(device))

    return via_driver


def _nvml_state(
    pid: int, device: int | None = None, *, wait_gone: bool = False
) -> tuple[bool, dict[int, int]] | None:
    """(NVML lists ``pid``, its bytes per device), ``wait_gone``: polled; None: unreadable."""
    from leakcheck.observe import nvml

    deadline = time.monotonic() + (_NVML_POLL_S if wait_gone else 0.0)
    while True:
        try:
            entries = nvml.get().processes(None if device is None else [device])
        except LeakCheckError:
            return None
        by_pid, _unknown = nvml.gpu_bytes_by_pid(entries)
        if pid not in by_pid or time.monotonic() >= deadline:
            return pid in by_pid, by_pid.get(pid, {})
        time.sleep(0.01)


def _total(per_device: dict[int, int] | None) -> int | None:
    return sum(per_device.values()) if per_device else None


# --- worker side --------------------------------------------------------------------------


def _terminate_descendants() -> None:
    """SIGTERM, then SIGKILL after 1 s, the descendants listed (psutil refuses reused PIDs)."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=1.0)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


_interrupted = False


def _note_interrupt(signum: int, frame: object) -> None:
    """The worker's SIGINT, as Python's own handler, noted for its teardown record."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _worker_teardown(policy: WorkerInit, key: ProcessKey, worker_id: int) -> None:
    """At worker exit (NOTE [teardown policy], 4; NOTE [worker reports] in track/book.py)."""
    if os.getpid() != key.pid:
        return  # a process forked from the worker inherited the finalizer
    started = time.perf_counter()
    freed = _Freed()
    fields: dict[str, Any] = {
        "cuda_initialized": False, "released": policy.release, "interrupted": _interrupted,
    }  # fmt: skip
    try:
        if policy.terminate_children:
            with freed.step("terminate children"):
                _terminate_descendants()
        cuda = initialized_cuda()
        fields |= {"cuda_initialized": cuda is not None, "monotonic_s": time.monotonic()}
        with freed.step("host memory"):  # what it held, before anything is released
            fields |= mailbox.host_fields(hostmem.read_host_memory(key.pid), _EXIT_HOST_FIELDS)
        held: dict[int, int] | None = {}  # no context: nothing on any device
        if cuda is not None:
            state = _nvml_state(key.pid)
            held = None if state is None else state[1]
            with contextlib.suppress(Exception):
                count = int(cuda.device_count())
                peak_reserved = sum(int(cuda.max_memory_reserved(i)) for i in range(count))
                fields["peak_reserved_bytes"] = peak_reserved
        fields |= {"gpu_bytes_by_device": held, "gpu_bytes_before": _total(held)}
        if cuda is not None and policy.release:
            _release(freed)
        fields["duration_s"] = time.perf_counter() - started
        if cuda is not None and policy.release and held:
            after = _nvml_state(key.pid, wait_gone=True)
            fields["left_nvml"] = None if after is None else not after[0]
    except BaseException as exc:  # a teardown must let the worker exit
        freed.errors.append(f"teardown: {one_line(exc)}")
        fields["duration_s"] = time.perf_counter() - started
    record = TeardownRecord(key, worker_id, **fields, **freed.fields())
    fields = {"pid": key.pid, "start_ticks": key.start_ticks, **to_jsonable(record)}
    del fields["key"]
    mailbox.post("teardown", fields, directory=policy.mailbox_dir)


def _open_stack_file(path: str) -> bool:
    """Point the worker's faulthandler at ``path``; True when it also dumps on a signal."""
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
        _stack_file = handle
        if signal.getsignal(mailbox.STACK_SIGNAL) != signal.SIG_DFL:
            return False  # a user's handler is theirs
        faulthandler.register(mailbox.STACK_SIGNAL, file=handle, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        return False
    return True


def _close_stack_file(pid: int) -> None:
    """A normal exit's last step: nothing crashed, so the file goes (NOTE [exit watch])."""
    global _stack_file
    if os.getpid() != pid:
        return  # a process forked from the worker inherited the finalizer
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


@dataclass(eq=False, repr=False)
class WorkerInit:
    """A picklable ``worker_init_fn`` that installs the teardown policy in each worker.

    Build it with :func:`worker_init_fn`; a class, not a closure, so that ``spawn`` and
    ``forkserver`` workers can unpickle it.
    """

    user_fn: Callable[[int], object] | None = None
    _: KW_ONLY
    terminate_children: bool = False
    release: bool = True
    persistent: bool | None = None
    mailbox_dir: str | None = None
    session_id: str | None = None
    death_signal: bool = True  # with release; off from other threads (NOTE [teardown policy])
    # The process whose memory holds this object: a worker that finds another one was
    # forked; spawn and forkserver unpickle it anew.
    _home_pid: int = field(default_factory=os.getpid, init=False)

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
            # A parent that died before prctl sends nothing; workers also watch its PID.
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        pid = os.getpid()
        key = procs.process_key(pid)
        if key is not None:
            folder = self.mailbox_dir or os.environ.get(mailbox.MAILBOX_ENV)
            # Before the record: the tracker signals only a worker whose record says so.
            dumps = bool(folder) and _open_stack_file(mailbox.stack_path(folder or "", key))
            fields: dict[str, Any] = {
                "pid": pid,
                "start_ticks": key.start_ticks,
                "ppid": os.getppid(),
                "worker_id": worker_id,
                "persistent": self.persistent,
                "stack_signal": int(mailbox.STACK_SIGNAL) if dumps else None,
            }
            if folder:  # its birth reading (NOTE [copy on read] in hostmem.py)
                fields |= {"forked": self._home_pid != pid, "monotonic_s": time.monotonic()}
                with contextlib.suppress(Exception):
                    fields |= mailbox.host_fields(hostmem.read_host_memory(pid))
            mailbox.post("worker", fields, directory=self.mailbox_dir)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a user's is theirs
                signal.signal(signal.SIGINT, _note_interrupt)
            import multiprocessing.util

            if self.release or self.terminate_children or folder:
                # Reported even without the release (NOTE [worker reports] in track/book.py).
                multiprocessing.util.Finalize(
                    None, _worker_teardown, args=(self, key, worker_id), exitpriority=_EXIT_PRIORITY
                )
            if dumps:
                multiprocessing.util.Finalize(
                    None, _close_stack_file, args=(pid,), exitpriority=_LAST_PRIORITY
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

    Without :func:`leakcheck.watch`, the teardown policy alone (NOTE [teardown policy])::

        loader = DataLoader(ds, num_workers=4, worker_init_fn=leakcheck.worker_init_fn(seed))

    Args:
        user_fn: Your own ``worker_init_fn``; it still runs, after the policy is installed.
        terminate_children: At worker exit, SIGTERM (then SIGKILL after 1 s) the worker's
            own live descendants, so none outlives the loader.
        release: Release CUDA resources at worker exit (False: only report).
        persistent: The loader uses ``persistent_workers`` (None: unknown).

    """
    return WorkerInit(
        user_fn, terminate_children=terminate_children, release=release, persistent=persistent
    )


# --- parent side: explicit release --------------------------------------------------------


@dataclass(frozen=True)
class ReleaseResult:
    """What :func:`release_device` freed.

    Attributes:
        device_index: The CUDA device released (None when nothing was done).
        freed_cache_bytes: Bytes the allocator had reserved before its cache was emptied.
        gpu_bytes_before: NVML's used bytes of this process before; ``gpu_bytes_after`` after
            (0: it left the device list). None: unknown.
        note: One line on what happened, e.g. why there was nothing to free.

    """

    device_index: int | None = None
    freed_cache_bytes: int = 0
    context_released: bool = False
    gpu_bytes_before: int | None = None
    gpu_bytes_after: int | None = None
    duration_s: float = 0.0
    note: str = ""
    error: str | None = None


def _device_index(device: object) -> int:
    import torch

    if device is None:
        return int(torch.cuda.current_device())
    index = device if isinstance(device, int) and not isinstance(device, bool) else None
    if index is None:
        parsed = None
        if not isinstance(device, bool):
            with contextlib.suppress(RuntimeError, TypeError):
                parsed = torch.device(device)  # type: ignore[call-overload]
        if parsed is None or parsed.type != "cuda":
            raise UsageError(
                f"release_device: expected a CUDA device such as 0 or 'cuda:0', got {device!r}"
            )
        index = int(torch.cuda.current_device()) if parsed.index is None else int(parsed.index)
    count = int(torch.cuda.device_count())
    if not 0 <= index < count:
        raise UsageError(
            f"release_device: CUDA device {index} out of range (this process sees {count})"
        )
    return index


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


def _refuse_while_in_use(index: int) -> None:
    """Raise while tensors live on ``cuda:index`` or other threads may use it."""
    import torch

    gc.collect()  # tensors kept only by garbage cycles are not the caller's
    clear_library_workspaces()
    allocated = int(torch.cuda.memory_allocated(index))
    if allocated > 0:
        sizes: dict[str, list[int]] = {}
        for obj in gc.get_objects():
            with contextlib.suppress(Exception):
                if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.device.index == index:
                    shape = "x".join(str(d) for d in obj.shape) or "scalar"
                    name = f"{str(obj.dtype).removeprefix('torch.')}[{shape}]"
                    sizes.setdefault(name, []).append(obj.untyped_storage().nbytes())
        largest = sorted(sizes.items(), key=lambda kv: -sum(kv[1]))[:3]
        text = ", ".join(f"{len(n)} x {name} ({sum(n) / MIB:.1f} MiB)" for name, n in largest)
        which = f" (largest: {text})" if text else ""
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


def _nvml_index(cuda_index: int) -> int | None:
    """NVML index of a CUDA device (NVML ignores ``CUDA_VISIBLE_DEVICES``); None: unknown."""
    import torch

    from leakcheck.observe import nvml

    with contextlib.suppress(Exception):
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid).removeprefix("GPU-")
        for state in nvml.get().memory():
            if state.uuid.removeprefix("GPU-") == uuid:
                return state.index
    return None


def release_device(device: object = None, *, force: bool = False) -> ReleaseResult:
    """Release this process's CUDA context on one device, and report what was freed.

    For a job that must let the GPU go before it exits (to cool and clock down between
    measured runs), or a long-lived process done with its GPU work: a context holds ~0.5 GiB
    and keeps the clocks high. The steps of a worker's teardown (NOTE [teardown policy]). Do
    not use CUDA in this process afterwards. It never initialises CUDA, and during
    interpreter shutdown does nothing (the runtime releases everything); the note says so.

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
        return ReleaseResult(note="interpreter is exiting: left to the runtime")
    if initialized_cuda() is None:
        return ReleaseResult(note="nothing to free: CUDA was never initialised in this process")
    index = _device_index(device)
    if not force:
        _refuse_while_in_use(index)
    started = time.perf_counter()
    nvml_index = _nvml_index(index)
    pid = os.getpid()
    before = _nvml_state(pid, nvml_index) if nvml_index is not None else None
    freed = _Freed()
    _release(freed, index)
    duration_s = time.perf_counter() - started
    after = _nvml_state(pid, nvml_index, wait_gone=True) if before and before[0] else None
    return ReleaseResult(
        device_index=index,
        freed_cache_bytes=freed.freed_cache_bytes,
        context_released=freed.context_released,
        gpu_bytes_before=_total(before[1]) if before is not None else None,
        gpu_bytes_after=(_total(after[1]) if after[0] else 0) if after is not None else None,
        duration_s=duration_s,
        note="context released" if freed.context_released else "context not released",
        error=freed.fields()["error"],
    )
