"""NVML access: who holds GPU memory, and how each device is doing, without touching CUDA.

This is the only module that calls NVML, through leakcheck's own small ctypes binding
(``nvml_lib.py``, in pynvml's shape; importing the whole ``pynvml`` binding cost a command's
start tens of milliseconds). NVML talks to the driver directly, so nothing here creates a
CUDA context in the calling process: torch is never imported, and
``torch.cuda.is_initialized()`` stays False however much this is used.

Use :func:`get` for the process-wide :class:`Nvml` handle and :func:`availability` to ask,
without an exception, whether NVML can be used at all.

Errors:
    * NVML cannot be used here (no ``libnvidia-ml.so.1``, driver not loaded, no permission,
      no GPU): :class:`~leakcheck.core.errors.NVMLUnavailable`, one line with a hint. Callers
      degrade to host-side checks.
    * One NVML call fails on one device at run time (GPU lost, driver hiccup): a plain
      :class:`~leakcheck.core.errors.LeakCheckError` whose one-line message names the call and the
      device. Callers (the tracker) record it as a sampling failure; it is never retried here.
    * A bad device index: :class:`~leakcheck.core.errors.UsageError`.
    * A telemetry field the device does not report (``NVMLError`` on that one call) is None in
      :class:`~leakcheck.core.model.DeviceState`; it is not an error.

NOTE [fork]: NVML handles are per process. A forked child inherits the parent's ``Nvml``
object, but its handles and the library's init state are not to be trusted there. Every
public method compares ``os.getpid()`` with the PID that initialised the handle and, in a
child, calls ``nvmlInit`` again and drops every cached device handle before going on. The
module and instance locks are replaced in the child (``os.register_at_fork``), so a lock held
by another thread at fork time cannot deadlock the child.

NOTE [descriptors]: ``nvmlInit`` and the first device calls open ``/dev/nvidiactl``,
``/dev/nvidia<N>``, ``/dev/nvidia-uvm`` and capability nodes in this process: nodes a CUDA
context opens too, so they alone cannot tell CUDA from NVML. Children forked after it inherit
those descriptors, just as they inherit a CUDA parent's, but NVML's pin no CUDA context.
``get()`` records the numbers NVML opened (``own_descriptors()``), so the tracker can leave
them out when it counts what a forked child inherited from the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from leakcheck.core.errors import LeakCheckError, NVMLUnavailable, UsageError
from leakcheck.core.readings import AccountedProcess, DeviceState, GpuProcess

__all__ = [
    "THROTTLE_REASON_NAMES",
    "Nvml",
    "availability",
    "get",
    "start_in_background",
    "throttle_reason_names",
]

# NVML's "value not available" for unsigned 64-bit fields (NVML_VALUE_NOT_AVAILABLE). The
# binding already maps it to None for process memory, but not everywhere and not in every
# version, so both spellings are handled.
_NOT_AVAILABLE_U64 = 2**64 - 1
_NOT_AVAILABLE_U32 = 2**32 - 1
_PSTATE_UNKNOWN = 32  # NVML_PSTATE_UNKNOWN

# Error codes (nvmlReturn_t), a stable C ABI. Read from the module when it has them.
_SUCCESS = 0
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_INSUFFICIENT_SIZE = 7
_ERR_DRIVER_NOT_LOADED = 9
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_LIB_RM_VERSION_MISMATCH = 18

_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_CLOCK_SM = 1  # NVML_CLOCK_SM
_FEATURE_ENABLED = 1  # NVML_FEATURE_ENABLED

THROTTLE_REASON_NAMES: tuple[tuple[int, str], ...] = (
    (0x0001, "gpu_idle"),
    (0x0002, "applications_clocks"),
    (0x0004, "sw_power_cap"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal"),
    (0x0040, "hw_thermal"),
    (0x0080, "hw_power_brake"),
    (0x0100, "display_clocks"),
)
"""Clock-event (throttle) reason bits of ``nvmlDeviceGetCurrentClocksEventReasons`` and
their short names, in bit order."""

_SUFFIX = "GPU memory is not checked, process checks still run"


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """Decode a clock-event reason bit mask into short names.

    Args:
        mask: Value of ``nvmlDeviceGetCurrentClocksEventReasons`` (or its older name
            ``...ThrottleReasons``).

    Returns:
        Names of the set bits, in bit order; bits without a name here are left out.

    """
    return tuple(name for bit, name in THROTTLE_REASON_NAMES if mask & bit)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _err_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _known(value: Any) -> int | None:
    """Return an NVML counter as int, or None for "not available" (None or all-ones)."""
    if value is None:
        return None
    number = int(value)
    if number < 0 or number in (_NOT_AVAILABLE_U64, _NOT_AVAILABLE_U32):
        return None
    return number


def _text(value: Any) -> str:
    # Old bindings return bytes for strings.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


_BINDING = "leakcheck.observe.nvml_lib"


def _binding() -> Any:
    # Looked up in sys.modules at call time, so that tests can put a fake module in its
    # place (the NVML boundary: tests/fake_pynvml.py).
    return importlib.import_module(_BINDING)


def _init_failure(lib: Any, exc: BaseException) -> NVMLUnavailable:
    """Turn an ``nvmlInit`` error into a one-line ``NVMLUnavailable`` with a hint."""
    code = _err_code(exc)
    hints = {
        getattr(lib, "NVML_ERROR_LIBRARY_NOT_FOUND", _ERR_LIBRARY_NOT_FOUND): (
            "libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"
        ),
        getattr(lib, "NVML_ERROR_DRIVER_NOT_LOADED", _ERR_DRIVER_NOT_LOADED): (
            "the NVIDIA kernel driver is not loaded (does `nvidia-smi` work?)"
        ),
        getattr(lib, "NVML_ERROR_NO_PERMISSION", _ERR_NO_PERMISSION): (
            "no permission to open /dev/nvidia* (check the device files or the container's "
            "device mounts)"
        ),
        getattr(lib, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", _ERR_LIB_RM_VERSION_MISMATCH): (
            "libnvidia-ml and the kernel driver versions differ (reboot, or reload the "
            "nvidia kernel module)"
        ),
    }
    reason = hints.get(code) if code is not None else None
    if reason is None:
        reason = f"nvmlInit failed: {_one_line(exc) or type(exc).__name__}"
    return NVMLUnavailable(f"NVML unavailable: {reason}; {_SUFFIX}")


# NOTE [process lists]: pynvml's ``nvmlDevice*RunningProcesses`` asks the driver twice per call
# (once for the count with no buffer, once to fill a new array) and builds a Python object
# per entry. The sampler reads the lists many times a second, so leakcheck calls the C
# function (``_v3``, else ``_v2``: the same entry layout) once with a buffer kept from the
# last call, sized with room to spare; the driver says when the buffer is short (it fills
# in the count it needs) and the call is repeated with a larger one (at most twice:
# processes may start in between). Entries are read straight from the C structures. This is
# the one reader of the lists: leakcheck's binding (nvml_lib.py) offers no other, and a
# pynvml-shaped binding without these names (a fake) is used through its public calls.
_RAW_ENTRY_BYTES = 24  # nvmlProcessInfo_v2/v3_t: pid, used bytes, GPU and compute instance
_RAW_FIRST_CAPACITY = 32
_RAW_TRIES = 3


class _RawProcessList:
    """A running-process list of one device read through a reused buffer.

    NOTE [process lists].
    """

    def __init__(self, function: Any, entry_type: Any, error_type: type[BaseException]) -> None:
        self._function = function
        self._entry_type = entry_type
        self._error_type = error_type
        self._buffer: Any = (entry_type * _RAW_FIRST_CAPACITY)()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, lib: Any, name: str) -> _RawProcessList | None:
        """The reader for ``name`` (e.g. ``nvmlDeviceGetComputeRunningProcesses``), or None.

        None when the binding lacks the C-level names, the entry layout is not the one
        expected, or the driver lacks both the ``_v3`` and ``_v2`` functions: the public
        call is used then.
        """
        get_pointer = getattr(lib, "_nvmlGetFunctionPointer", None)
        entry_type = getattr(lib, "c_nvmlProcessInfo_v3_t", None)
        error_type = getattr(lib, "NVMLError", None)
        if get_pointer is None or entry_type is None or not isinstance(error_type, type):
            return None
        try:
            if ctypes.sizeof(entry_type) != _RAW_ENTRY_BYTES:
                return None
        except Exception:  # Any failure here means: use the public call.
            return None
        for version in ("_v3", "_v2"):
            try:
                function = get_pointer(f"{name}{version}")
            except Exception:  # This driver lacks that version: try the next, else public.
                continue
            return cls(function, entry_type, error_type)
        return None

    def read(self, handle: Any) -> list[tuple[int, int | None]]:
        """Return (pid, used bytes or None) per entry.

        Raises:
            NVMLError: The driver's error, as the binding would raise it.

        """
        with self._lock:
            for _ in range(_RAW_TRIES):
                count = ctypes.c_uint(len(self._buffer))
                code = self._function(handle, ctypes.byref(count), self._buffer)
                if code == _SUCCESS:
                    return [
                        (int(entry.pid), _known(entry.usedGpuMemory))
                        for entry in self._buffer[: count.value]
                    ]
                if code != _ERR_INSUFFICIENT_SIZE:
                    break
                # Room for processes that start before the next call, as the binding does.
                self._buffer = (self._entry_type * (count.value * 2 + 8))()
            raise self._error_type(code)


class Nvml:
    """One process's NVML session: device handles, names and UUIDs cached after first use.

    Obtain it with :func:`get`; do not construct it directly. All methods are thread-safe
    (NVML itself is; the caches are filled under a lock) and fork-tolerant (see the module
    docstring). Device arguments are NVML indices, which follow PCI bus order and ignore
    ``CUDA_VISIBLE_DEVICES``.

    Raises (every public method):
        NVMLUnavailable: After :meth:`shutdown`, or when re-initialising in a forked child
            fails.
        LeakCheckError: An NVML call failed on a device; the message names call and device.
        UsageError: A device index out of range.
    """

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._pid = -1
        self._closed = False
        self._count = 0
        self._handles: dict[int, Any] = {}
        self._meta: dict[int, tuple[str, str]] = {}
        self._max_sm_clock: dict[int, int | None] = {}
        self._raw_readers: dict[tuple[int, str], _RawProcessList | None] = {}
        self._unsupported: set[tuple[int, str]] = set()
        nvml_error = getattr(lib, "NVMLError", None)
        soft: list[type[BaseException]] = []
        if isinstance(nvml_error, type) and issubclass(nvml_error, BaseException):
            soft.append(nvml_error)
        self._nvml_errors: tuple[type[BaseException], ...] = tuple(soft)
        self._start()

    # -- lifecycle -------------------------------------------------------------------------

    def _start(self) -> None:
        """Run ``nvmlInit`` and count devices: once per process (again in a forked child)."""
        self._handles.clear()
        self._meta.clear()
        self._max_sm_clock.clear()
        self._raw_readers.clear()
        self._unsupported.clear()
        try:
            self._lib.nvmlInit()
        except self._nvml_errors as exc:
            raise _init_failure(self._lib, exc) from exc
        except OSError as exc:
            raise NVMLUnavailable(
                f"NVML unavailable: loading libnvidia-ml failed: {_one_line(exc)}; {_SUFFIX}"
            ) from exc
        try:
            count = int(self._lib.nvmlDeviceGetCount())
        except self._nvml_errors as exc:
            self._quiet_shutdown()
            raise NVMLUnavailable(
                f"NVML unavailable: nvmlDeviceGetCount failed: {_one_line(exc)}; {_SUFFIX}"
            ) from exc
        if count <= 0:
            self._quiet_shutdown()
            raise NVMLUnavailable(
                "NVML unavailable: the driver is loaded but sees no NVIDIA GPU "
                f"(nvmlDeviceGetCount() == 0); {_SUFFIX}"
            )
        self._count = count
        self._pid = os.getpid()

    def _quiet_shutdown(self) -> None:
        # Best effort: the session is being abandoned anyway.
        with contextlib.suppress(*self._nvml_errors):
            self._lib.nvmlShutdown()

    def _ensure(self) -> bool:
        """Refuse a shut-down session; start NVML again in a forked child (True: started)."""
        if self._closed:
            raise NVMLUnavailable(
                "NVML unavailable: this handle was shut down; "
                "call leakcheck.observe.nvml.get() again"
            )
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    before = _nvidia_fd_numbers()
                    self._start()
                    _count_as_own(_nvidia_fd_numbers() - before)
                    return True
        return False

    def shutdown(self) -> None:
        """Release NVML for this process (``nvmlShutdown``); idempotent.

        Afterwards this object refuses every call with ``NVMLUnavailable``, and :func:`get`
        starts a new session. Only call it when no other thread still samples.
        """
        global _instance
        with _lock:
            if self._closed:
                return
            self._closed = True
            # A forked child never initialised this object's session; shutting it down would
            # decrement a reference count that is not its own.
            if self._pid == os.getpid():
                self._quiet_shutdown()
            if _instance is self:
                _instance = None

    # -- helpers ---------------------------------------------------------------------------

    def _call(self, name: str, device: int, *args: Any) -> Any:
        try:
            return getattr(self._lib, name)(*args)
        except self._nvml_errors as exc:
            raise LeakCheckError(
                f"NVML {name} failed on device {device}: {_one_line(exc) or type(exc).__name__}"
            ) from exc

    def _optional(self, name: str, *args: Any) -> Any:
        """Call an NVML function; None when it is absent from the binding or raises."""
        fn = getattr(self._lib, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._nvml_errors:
            return None

    def _select(self, devices: Sequence[int] | None) -> tuple[int, ...]:
        if devices is None:
            return tuple(range(self._count))
        chosen: list[int] = []
        for index in devices:
            if not isinstance(index, int) or isinstance(index, bool):
                raise UsageError(f"NVML device index must be an int, got {index!r}")
            if not 0 <= index < self._count:
                raise UsageError(
                    f"NVML device index {index} out of range: this machine has "
                    f"{self._count} device(s) (0..{self._count - 1})"
                )
            if index not in chosen:
                chosen.append(index)
        return tuple(chosen)

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            (index,) = self._select((index,))
            with self._lock:
                handle = self._handles.get(index)
                if handle is None:
                    handle = self._call("nvmlDeviceGetHandleByIndex", index, index)
                    self._handles[index] = handle
        return handle

    def _name_uuid(self, index: int, handle: Any) -> tuple[str, str]:
        meta = self._meta.get(index)
        if meta is None:
            name = self._optional("nvmlDeviceGetName", handle)
            uuid = self._optional("nvmlDeviceGetUUID", handle)
            meta = (
                _text(name) if name is not None else f"GPU {index}",
                _text(uuid) if uuid is not None else "",
            )
            if name is not None and uuid is not None:
                self._meta[index] = meta  # Only cache what was really read.
        return meta

    def _running(
        self, index: int, handle: Any, name: str, *, optional: bool
    ) -> list[tuple[int, int | None]]:
        """One running-process list as (pid, used bytes or None) pairs.

        Read through a reused buffer where the binding allows it (NOTE [process lists]);
        otherwise through the binding's public call (a binding without the C-level names).
        A graphics list the device does not support is empty, and not asked for again.
        """
        if (index, name) in self._unsupported:
            return []
        reader = self._raw_reader(index, name)
        try:
            if reader is not None:
                return reader.read(handle)
            entries = getattr(self._lib, name)(handle) or ()
            return [(int(e.pid), _known(getattr(e, "usedGpuMemory", None))) for e in entries]
        except self._nvml_errors as exc:
            not_supported = getattr(self._lib, "NVML_ERROR_NOT_SUPPORTED", _ERR_NOT_SUPPORTED)
            if optional and _err_code(exc) == not_supported:
                self._unsupported.add((index, name))
                return []
            raise LeakCheckError(
                f"NVML {name} failed on device {index}: {_one_line(exc) or type(exc).__name__}"
            ) from exc

    def _raw_reader(self, index: int, name: str) -> _RawProcessList | None:
        key = (index, name)
        if key not in self._raw_readers:
            with self._lock:
                if key not in self._raw_readers:
                    self._raw_readers[key] = _RawProcessList.open(self._lib, name)
        return self._raw_readers[key]

    # -- public API ------------------------------------------------------------------------

    def device_count(self) -> int:
        """Return the number of NVIDIA devices NVML sees (at least 1)."""
        self._ensure()
        return self._count

    def driver_version(self) -> str | None:
        """Return the driver's version string, or None when NVML does not say."""
        self._ensure()
        version = self._optional("nvmlSystemGetDriverVersion")
        return None if version is None else _text(version)

    def device_indices(self) -> tuple[int, ...]:
        """Return ``(0, ..., device_count() - 1)``."""
        self._ensure()
        return tuple(range(self._count))

    def processes(
        self, devices: Sequence[int] | None = None, *, graphics: bool = True
    ) -> tuple[GpuProcess, ...]:
        """List processes with a context on the devices, one entry per (pid, device).

        Compute and graphics lists are merged: ``kind`` is ``"compute"``, ``"graphics"`` or
        ``"both"``. When a process is in both lists its bytes are counted once (the larger
        known value); several entries of one list for one pid (MIG instances) are summed.
        ``used_gpu_bytes`` is None when NVML does not report it (never 0 for that).
        A device that does not support the graphics list contributes its compute list only.

        Args:
            devices: NVML indices to read; None for all.
            graphics: Also read the graphics list. Each list holds the driver's global lock
                while it is read, which stalls other processes' driver calls: a caller that
                knows no process has a graphics context can leave it out.

        Returns:
            Entries sorted by (device, pid). PIDs are as NVML reports them: in a container
            without the host PID namespace they are not this namespace's PIDs.

        """
        self._ensure()
        found: list[GpuProcess] = []
        for index in self._select(devices):
            handle = self._handle(index)
            merged: dict[int, tuple[int | None, bool, bool]] = {}
            lists = [("nvmlDeviceGetComputeRunningProcesses", False)]
            if graphics:
                lists.append(("nvmlDeviceGetGraphicsRunningProcesses", True))
            for call, is_graphics in lists:
                per_list: dict[int, int | None] = {}
                for pid, used in self._running(index, handle, call, optional=is_graphics):
                    if pid in per_list:
                        before = per_list[pid]
                        used = None if before is None or used is None else before + used
                    per_list[pid] = used
                for pid, used in per_list.items():
                    old_used, in_compute, in_graphics = merged.get(pid, (None, False, False))
                    known = [b for b in (old_used, used) if b is not None]
                    merged[pid] = (
                        max(known) if known else None,
                        in_compute or not is_graphics,
                        in_graphics or is_graphics,
                    )
            for pid in sorted(merged):
                used, in_compute, in_graphics = merged[pid]
                kind: Literal["compute", "graphics", "both"] = (
                    "both"
                    if in_compute and in_graphics
                    else "graphics"
                    if in_graphics
                    else "compute"
                )
                found.append(
                    GpuProcess(pid=pid, device_index=index, used_gpu_bytes=used, kind=kind)
                )
        return tuple(found)

    def _memory_state(self, index: int) -> tuple[DeviceState, Any]:
        handle = self._handle(index)
        name, uuid = self._name_uuid(index, handle)
        info = self._call("nvmlDeviceGetMemoryInfo", index, handle)
        state = DeviceState(
            index=index,
            name=name,
            uuid=uuid,
            used_bytes=int(info.used),
            total_bytes=int(info.total),
        )
        return state, handle

    def memory(self, devices: Sequence[int] | None = None) -> tuple[DeviceState, ...]:
        """Read used and total memory of each device, with name and UUID; no telemetry.

        The cheap call of the sampler (one ``nvmlDeviceGetMemoryInfo`` per device; handles,
        names and UUIDs are cached).

        Args:
            devices: NVML indices to read; None for all.

        """
        self._ensure()
        return tuple(self._memory_state(index)[0] for index in self._select(devices))

    def devices(self, devices: Sequence[int] | None = None) -> tuple[DeviceState, ...]:
        """Read memory plus telemetry of each device.

        Telemetry: temperature, SM clock and its max, power, P-state, and clock-event
        (throttle) reasons as short names.

        A telemetry call the device does not support leaves only that field None (the
        reasons empty); memory errors raise as in :meth:`memory`.

        Args:
            devices: NVML indices to read; None for all.

        """
        self._ensure()
        states: list[DeviceState] = []
        lib = self._lib
        for index in self._select(devices):
            state, handle = self._memory_state(index)
            temperature = self._optional(
                "nvmlDeviceGetTemperature",
                handle,
                getattr(lib, "NVML_TEMPERATURE_GPU", _TEMPERATURE_GPU),
            )
            clock_sm = getattr(lib, "NVML_CLOCK_SM", _CLOCK_SM)
            sm_clock = self._optional("nvmlDeviceGetClockInfo", handle, clock_sm)
            if index not in self._max_sm_clock:
                # The maximum is a property of the board: read once.
                self._max_sm_clock[index] = _known(
                    self._optional("nvmlDeviceGetMaxClockInfo", handle, clock_sm)
                )
            power_mw = _known(self._optional("nvmlDeviceGetPowerUsage", handle))
            pstate = _known(self._optional("nvmlDeviceGetPerformanceState", handle))
            reasons = self._optional("nvmlDeviceGetCurrentClocksEventReasons", handle)
            if reasons is None:
                # Older drivers and bindings only have the deprecated name.
                reasons = self._optional("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
            states.append(
                state._replace(
                    temperature_c=_known(temperature),
                    sm_clock_mhz=_known(sm_clock),
                    sm_clock_max_mhz=self._max_sm_clock[index],
                    power_w=power_mw / 1000.0 if power_mw is not None else None,
                    performance_state=None if pstate == _PSTATE_UNKNOWN else pstate,
                    throttle_reasons=(
                        throttle_reason_names(int(reasons)) if reasons is not None else ()
                    ),
                )
            )
        return tuple(states)

    def accounting_enabled(self, device: int) -> bool:
        """Tell whether the driver's accounting mode is on for ``device`` (False if unsupported)."""
        self._ensure()
        handle = self._handle(device)
        try:
            mode = self._lib.nvmlDeviceGetAccountingMode(handle)
        except self._nvml_errors as exc:
            if _err_code(exc) == getattr(self._lib, "NVML_ERROR_NOT_SUPPORTED", _ERR_NOT_SUPPORTED):
                return False
            raise LeakCheckError(
                f"NVML nvmlDeviceGetAccountingMode failed on device {device}: {_one_line(exc)}"
            ) from exc
        return int(mode) == int(getattr(self._lib, "NVML_FEATURE_ENABLED", _FEATURE_ENABLED))

    def accounting(self, device: int) -> tuple[AccountedProcess, ...]:
        """List the per-PID records the driver keeps in accounting mode, exited processes included.

        Returns ``()`` when accounting mode is off; leakcheck never switches it on (a
        device-wide setting that needs root). The driver's buffer is circular: old PIDs drop
        out.
        """
        if not self.accounting_enabled(device):
            return ()
        handle = self._handle(device)
        records: list[AccountedProcess] = []
        not_found = getattr(self._lib, "NVML_ERROR_NOT_FOUND", _ERR_NOT_FOUND)
        for pid in self._call("nvmlDeviceGetAccountingPids", device, handle):
            try:
                stats = self._lib.nvmlDeviceGetAccountingStats(handle, int(pid))
            except self._nvml_errors as exc:
                if _err_code(exc) == not_found:
                    continue  # Dropped from the circular buffer between the two calls.
                raise LeakCheckError(
                    f"NVML nvmlDeviceGetAccountingStats failed on device {device} "
                    f"for pid {pid}: {_one_line(exc)}"
                ) from exc
            records.append(
                AccountedProcess(
                    pid=int(pid),
                    device_index=device,
                    max_memory_bytes=_known(getattr(stats, "maxMemoryUsage", None)),
                    time_ms=_known(getattr(stats, "time", None)),
                    is_running=bool(getattr(stats, "isRunning", False)),
                )
            )
        return tuple(records)


# -- process-wide singleton ----------------------------------------------------------------

_lock = threading.Lock()
_instance: Nvml | None = None
_own_fds: frozenset[int] = frozenset()
_failure: tuple[int, str] | None = None
"""(pid, message) of a failed init: not retried in the same process (a driver does not
appear mid-run, and a failing dlopen on every sample would cost time)."""


def get() -> Nvml:
    """Return the process-wide :class:`Nvml`, initialised on first use (thread-safe, once).

    In a forked child the same object re-initialises NVML on its next use.

    Raises:
        NVMLUnavailable: No driver library, driver not loaded, no
            permission, or no GPU; a one-line message with a hint. The failure is remembered
            for this process.

    """
    global _instance, _failure, _own_fds
    instance = _instance
    if instance is not None and instance._pid == os.getpid():
        return instance
    with _lock:
        pid = os.getpid()
        if _failure is not None and _failure[0] == pid:
            raise NVMLUnavailable(_failure[1])
        if _instance is None:
            before = _nvidia_fd_numbers()
            try:
                session = Nvml(_binding())
            except NVMLUnavailable as exc:
                _failure = (pid, str(exc))
                raise
            try:
                # Open every device handle now, so all of NVML's descriptors exist by the
                # time they are told apart from the job's (NOTE [descriptors]).
                with contextlib.suppress(LeakCheckError):
                    session.processes()
            except BaseException:
                session._quiet_shutdown()  # never published: its nvmlInit is undone
                raise
            # Published only now: another thread's get() returns without the lock, and must
            # not find a session whose descriptors are not yet known as NVML's.
            _own_fds = frozenset(_nvidia_fd_numbers() - before)
            _instance = session
        elif _instance._pid != pid and _instance._ensure():
            # A forked child (NOTE [fork]): NVML started again (its descriptors counted as
            # NVML's there); its handles are opened now, and what they open is NVML's too.
            before = _nvidia_fd_numbers()
            with contextlib.suppress(LeakCheckError):
                _instance.processes()
            _count_as_own(_nvidia_fd_numbers() - before)
        return _instance


def _count_as_own(numbers: set[int]) -> None:
    """Add descriptor numbers NVML opened in this process to ``own_descriptors()``."""
    global _own_fds
    if numbers:
        _own_fds = _own_fds | numbers


def gpu_bytes_by_pid(
    processes: Iterable[GpuProcess],
) -> tuple[dict[int, dict[int, int]], set[int]]:
    """Group NVML's process list by PID.

    Returns:
        Used bytes per device index for each PID (the devices where its bytes are known), and
        the PIDs listed somewhere without a byte count.

    """
    by_pid: dict[int, dict[int, int]] = {}
    unknown: set[int] = set()
    for entry in processes:
        per_device = by_pid.setdefault(entry.pid, {})
        if entry.used_gpu_bytes is None:
            unknown.add(entry.pid)
        else:
            per_device[entry.device_index] = (
                per_device.get(entry.device_index, 0) + entry.used_gpu_bytes
            )
    return by_pid, unknown


def own_descriptors() -> frozenset[int]:
    """Descriptor numbers of ``/dev/nvidia*`` that NVML itself opened in this process.

    Children forked after NVML started inherit these numbers; they are leakcheck's, not the
    job's, and pin no CUDA context (NOTE [descriptors]). Empty before NVML started.
    """
    return _own_fds


def _nvidia_fd_numbers() -> set[int]:
    numbers: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return numbers
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/dev/nvidia"):
                numbers.add(int(name))
        except (OSError, ValueError):
            continue
    return numbers


def start_in_background() -> None:
    """Begin NVML's start on a thread, unless it has begun (NOTE [overlapped start] in snapshot.py).

    A one-shot command calls it first: the library load, ``nvmlInit`` and the device handles
    wait in the driver while it imports and reads /proc, and its own :func:`get` waits for
    this start instead of making another. Never raises: a failure is remembered, as
    :func:`get` remembers it.
    """
    if _instance is not None or _failure is not None:
        return
    starter = threading.Thread(target=availability, name="leakcheck-nvml-start", daemon=True)
    with contextlib.suppress(RuntimeError):  # no thread to be had: get() starts it then
        starter.start()


def availability() -> tuple[bool, str]:
    """Tell whether NVML can be used here; never raises.

    Initialises the singleton as a side effect (so a later :func:`get` is free).

    Returns:
        ``(True, "")``, or ``(False, reason)`` with a one-line reason and hint.

    """
    try:
        get()
    except LeakCheckError as exc:
        return False, _one_line(exc)
    except Exception as exc:  # The contract is "never raises": any surprise is a reason.
        return False, _one_line(f"NVML unavailable: {type(exc).__name__}: {exc}; {_SUFFIX}")
    return True, ""


def _reset_for_tests() -> None:
    """Forget the singleton and any remembered failure, without calling NVML.

    For tests that swap ``sys.modules["leakcheck.observe.nvml_lib"]`` for a fake.
    """
    global _instance, _failure
    with _lock:
        _instance = None
        _failure = None


def _after_fork_in_child() -> None:
    # A lock held by another thread at fork time stays held forever in the child.
    global _lock
    _lock = threading.Lock()
    if _instance is not None:
        _instance._lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # Not on Windows, where there is no fork.
    os.register_at_fork(after_in_child=_after_fork_in_child)
