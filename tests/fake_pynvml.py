"""A small fake of leakcheck's NVML binding (``leakcheck.observe.nvml_lib``, in pynvml's shape).

Only the names leakcheck.observe.nvml uses exist. A ``FakePynvml`` instance *is* the module: tests
put it in ``sys.modules["leakcheck.observe.nvml_lib"]``. Error codes and error class names match
pynvml's.

What it models:
- devices with memory, compute and graphics process lists (a process may be in both; used
  memory may be None or the 2**64-1 "not available" sentinel, as raw NVML reports it);
- telemetry where any field set to None raises ``NVMLError_NotSupported``;
- init failures (library not found, driver not loaded, ...), optionally slow init;
- handles that go stale after a re-init (as after fork), so reuse of a cached handle fails;
- a lost GPU (every device call raises ``NVMLError_GpuIsLost``);
- accounting mode and records; only ``nvmlDeviceSetAccountingMode`` switches it on;
- the C-level running-process functions and entry layout that leakcheck reads through a
  reused buffer: the count-and-fill protocol of NVML, with ``NVML_ERROR_INSUFFICIENT_SIZE``
  when the caller's buffer is short. Their calls are counted under the public names.
"""

from __future__ import annotations

import ctypes
import threading
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NOT_AVAILABLE = 2**64 - 1

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _TEXT.get(self.value, f"NVML Error with code {self.value}")


def _subclass(name: str, code: int) -> Callable[[], NVMLError]:
    """An error class of one code (a class of ``NVMLError``, built without arguments)."""

    def init(self: NVMLError) -> None:
        NVMLError.__init__(self, code)

    cls: Callable[[], NVMLError] = type(name, (NVMLError,), {"__init__": init})
    return cls


NVMLError_Uninitialized = _subclass("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _subclass("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _subclass("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _subclass("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _subclass("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _subclass("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _subclass("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _subclass("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _subclass("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)

_BY_CODE: dict[int, Callable[[], NVMLError]] = {
    cls().value: cls
    for cls in (
        NVMLError_Uninitialized,
        NVMLError_InvalidArgument,
        NVMLError_NotSupported,
        NVMLError_NoPermission,
        NVMLError_NotFound,
        NVMLError_DriverNotLoaded,
        NVMLError_LibraryNotFound,
        NVMLError_FunctionNotFound,
        NVMLError_GpuIsLost,
    )
}


def error(code: int) -> NVMLError:
    """The exception the real binding raises for ``code`` (its subclass when one exists)."""
    cls = _BY_CODE.get(code)
    return cls() if cls is not None else NVMLError(code)


@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = NOT_AVAILABLE & 0xFFFFFFFF
    computeInstanceId: int = NOT_AVAILABLE & 0xFFFFFFFF


class FakeProcessInfo(ctypes.Structure):
    """The C layout of ``nvmlProcessInfo_v3_t``."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


def _spin(cpu_s: float) -> None:
    """Work ``cpu_s`` seconds of this thread's CPU time."""
    spin_until_s = time.thread_time() + cpu_s
    while time.thread_time() < spin_until_s:
        pass


@dataclass
class FakeDevice:
    """One fake GPU. Telemetry fields set to None raise NVMLError_NotSupported."""

    name: str = "NVIDIA Fake H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total_bytes: int = 140 * 2**30
    used_bytes: int = 2**30
    compute: list[FakeProcess] = field(default_factory=list)
    graphics: list[FakeProcess] | None = field(default_factory=list)
    """None: the graphics list is not supported on this device."""
    temperature_c: int | None = 35
    sm_clock_mhz: int | None = 345
    sm_clock_max_mhz: int | None = 1980
    power_mw: int | None = 75_500
    performance_state: int | None = 0
    clock_event_reasons: int | None = 0x1
    accounting_supported: bool = True
    accounting_mode: bool = False
    accounting: dict[int, tuple[int | None, int, bool]] = field(default_factory=dict)
    """pid -> (max memory bytes or NOT_AVAILABLE, time ms, is running)."""
    accounting_vanishing_pids: tuple[int, ...] = ()
    """Listed by nvmlDeviceGetAccountingPids, then NotFound in nvmlDeviceGetAccountingStats."""
    lost: bool = False
    list_failures: int = 0
    """The next this-many running-process list calls raise ``NVMLError_GpuIsLost``."""
    list_cpu_s: float = 0.0
    """CPU seconds each running-process list call works (a busy GPU's lists are costly)."""
    list_wait_s: float = 0.0
    """Seconds each running-process list call waits, idle (a lock another process holds)."""
    memory_cpu_s: float = 0.0
    """CPU seconds each memory info call works."""


@dataclass(frozen=True)
class FakeHandle:
    index: int
    generation: int


class FakePynvml(types.ModuleType):
    """Stands in for the ``pynvml`` module; counts calls for assertions."""

    def __init__(
        self,
        devices: list[FakeDevice] | None = None,
        *,
        init_error: int | None = None,
        init_delay_s: float = 0.0,
        has_event_reasons: bool = True,
        root: bool = False,
    ) -> None:
        super().__init__("pynvml")
        self.devices = devices if devices is not None else [FakeDevice()]
        self.init_error = init_error
        self.init_delay_s = init_delay_s
        self.root = root
        self.calls: Counter[str] = Counter()
        self.init_calls = 0
        self.shutdown_calls = 0
        self.generation = 0
        self._counter_lock = threading.Lock()
        for name, value in globals().items():
            if name.startswith(("NVML_", "NVMLError")):
                setattr(self, name, value)
        self.NVML_TEMPERATURE_GPU = 0
        self.NVML_CLOCK_SM = 1
        self.NVML_FEATURE_DISABLED = 0
        self.NVML_FEATURE_ENABLED = 1
        self.has_event_reasons = has_event_reasons
        self.c_nvmlProcessInfo_v3_t: type[ctypes.Structure] = FakeProcessInfo

    # -- plumbing --------------------------------------------------------------------------

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        """The C function ``name`` (only the two ``_v3`` process lists exist)."""
        lists = {
            "nvmlDeviceGetComputeRunningProcesses_v3": False,
            "nvmlDeviceGetGraphicsRunningProcesses_v3": True,
        }
        if name not in lists:
            raise error(NVML_ERROR_FUNCTION_NOT_FOUND)
        graphics = lists[name]

        def call(handle: Any, count_ref: Any, buffer: Any) -> int:
            try:
                device = self._device(handle, name.removesuffix("_v3"))
            except NVMLError as exc:
                return exc.value
            entries = device.graphics if graphics else device.compute
            if entries is None:
                return NVML_ERROR_NOT_SUPPORTED
            count = count_ref._obj  # what ctypes.byref() wraps
            if count.value < len(entries):
                count.value = len(entries)
                return NVML_ERROR_INSUFFICIENT_SIZE
            for slot, entry in zip(buffer, entries, strict=False):
                slot.pid = entry.pid
                used = entry.usedGpuMemory
                slot.usedGpuMemory = NOT_AVAILABLE if used is None else used
            count.value = len(entries)
            return NVML_SUCCESS

        return call

    def _count(self, name: str) -> None:
        with self._counter_lock:
            self.calls[name] += 1

    def _device(self, handle: Any, name: str) -> FakeDevice:
        self._count(name)
        if self.generation == 0:
            raise error(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeHandle) or handle.generation != self.generation:
            # A handle from before a re-init (e.g. inherited over fork) is not valid.
            raise error(NVML_ERROR_INVALID_ARGUMENT)
        device = self.devices[handle.index]
        if device.lost:
            raise error(NVML_ERROR_GPU_IS_LOST)
        if "RunningProcesses" in name:
            if device.list_wait_s:
                time.sleep(device.list_wait_s)
            _spin(device.list_cpu_s)
            if device.list_failures:
                device.list_failures -= 1
                raise error(NVML_ERROR_GPU_IS_LOST)
        elif name == "nvmlDeviceGetMemoryInfo":
            _spin(device.memory_cpu_s)
        return device

    @staticmethod
    def _value(value: int | None) -> int:
        if value is None:
            raise error(NVML_ERROR_NOT_SUPPORTED)
        return value

    # -- library ---------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_delay_s:
            time.sleep(self.init_delay_s)  # Widens the window for a racing second init.
        if self.init_error is not None:
            raise error(self.init_error)
        with self._counter_lock:
            self.init_calls += 1
            self.generation += 1

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlDeviceGetCount(self) -> int:
        self._count("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._count("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise error(NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index, self.generation)

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._device(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._device(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> Any:
        device = self._device(handle, "nvmlDeviceGetMemoryInfo")
        return types.SimpleNamespace(
            total=device.total_bytes,
            used=device.used_bytes,
            free=device.total_bytes - device.used_bytes,
        )

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._value(self._device(handle, "nvmlDeviceGetTemperature").temperature_c)

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return self._value(self._device(handle, "nvmlDeviceGetClockInfo").sm_clock_mhz)

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return self._value(self._device(handle, "nvmlDeviceGetMaxClockInfo").sm_clock_max_mhz)

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._value(self._device(handle, "nvmlDeviceGetPowerUsage").power_mw)

    def nvmlDeviceGetPerformanceState(self, handle: FakeHandle) -> int:
        return self._value(self._device(handle, "nvmlDeviceGetPerformanceState").performance_state)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        if not self.has_event_reasons:
            # An older driver: only the deprecated name exists in libnvidia-ml.
            self._count("nvmlDeviceGetCurrentClocksEventReasons")
            raise error(NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._value(
            self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_event_reasons
        )

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._value(
            self._device(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_event_reasons
        )

    def nvmlDeviceGetAccountingMode(self, handle: FakeHandle) -> int:
        device = self._device(handle, "nvmlDeviceGetAccountingMode")
        if not device.accounting_supported:
            raise error(NVML_ERROR_NOT_SUPPORTED)
        return 1 if device.accounting_mode else 0

    def nvmlDeviceSetAccountingMode(self, handle: FakeHandle, mode: int) -> None:
        device = self._device(handle, "nvmlDeviceSetAccountingMode")
        if not self.root:
            raise error(NVML_ERROR_NO_PERMISSION)
        device.accounting_mode = mode == 1

    def nvmlDeviceGetAccountingPids(self, handle: FakeHandle) -> list[int]:
        device = self._device(handle, "nvmlDeviceGetAccountingPids")
        if not device.accounting_mode:
            raise error(NVML_ERROR_NOT_SUPPORTED)
        return [*device.accounting, *device.accounting_vanishing_pids]

    def nvmlDeviceGetAccountingStats(self, handle: FakeHandle, pid: int) -> Any:
        device = self._device(handle, "nvmlDeviceGetAccountingStats")
        if pid not in device.accounting:
            raise error(NVML_ERROR_NOT_FOUND)
        max_memory, time_ms, running = device.accounting[pid]
        return types.SimpleNamespace(
            maxMemoryUsage=max_memory, time=time_ms, isRunning=int(running)
        )


def reset_nvml() -> None:
    """Make leakcheck's NVML layer forget its singleton and a remembered failure, unopened."""
    from leakcheck.observe import nvml

    with nvml._lock:
        nvml._instance = None
        nvml._failure = None
        nvml._own_fds = frozenset()
