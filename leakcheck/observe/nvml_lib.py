"""A small ctypes binding of the NVML calls leakcheck makes, in pynvml's shape.

``nvml.py`` is its one user, calling these by pynvml's names, so that tests can stand a fake
in for this module (``sys.modules["leakcheck.observe.nvml_lib"]``). It exists because
importing ``pynvml`` (thousands of structures built at import) cost ``leakcheck snapshot``
about 90 ms of its start: this loads ``libnvidia-ml.so.1`` only in :func:`nvmlInit`, and
defines only what is used. Errors raise :class:`NVMLError` with the driver's code in
``value``. Running-process lists are read by ``nvml.py`` through
:func:`_nvmlGetFunctionPointer` and :data:`c_nvmlProcessInfo_v3_t` (NOTE [process lists]).
"""

from __future__ import annotations

import ctypes
import threading

TYPE_CHECKING = False  # typing is not imported at run time: this module is on a hot start
if TYPE_CHECKING:
    from typing import Any

# nvmlReturn_t codes (nvml.h), a stable C ABI.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_FEATURE_ENABLED = 1

_LIBRARY = "libnvidia-ml.so.1"
_NAME_BUFFER = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
_UUID_BUFFER = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE
_DRIVER_VERSION_BUFFER = 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE

# Texts for codes that can come before the library is loaded (nvmlErrorString needs it).
_OFFLINE_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
}


class NVMLError(Exception):
    """An NVML call returned ``value`` (an ``nvmlReturn_t``) instead of success."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        text = _OFFLINE_TEXT.get(self.value)
        if text is None and _lib is not None:
            function = _lib.nvmlErrorString
            function.restype = ctypes.c_char_p
            raw = function(self.value)
            text = raw.decode(errors="replace") if raw else None
        return text or f"NVML Error with code {self.value}"


class c_nvmlMemory_t(ctypes.Structure):
    """``nvmlMemory_t``: bytes on the board."""

    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class c_nvmlProcessInfo_v3_t(ctypes.Structure):
    """``nvmlProcessInfo_v2_t``, the entry of the ``_v2`` and ``_v3`` process lists (24 bytes)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class c_nvmlAccountingStats_t(ctypes.Structure):
    """``nvmlAccountingStats_t``: what accounting mode keeps of one process."""

    _fields_ = [
        ("gpuUtilization", ctypes.c_uint),
        ("memoryUtilization", ctypes.c_uint),
        ("maxMemoryUsage", ctypes.c_ulonglong),
        ("time", ctypes.c_ulonglong),
        ("startTime", ctypes.c_ulonglong),
        ("isRunning", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 5),
    ]


_lib: ctypes.CDLL | None = None
_load_lock = threading.Lock()
_functions: dict[str, Any] = {}


def _nvmlGetFunctionPointer(name: str) -> Any:
    """The C function ``name`` of the loaded library (returning ``nvmlReturn_t``).

    Raises:
        NVMLError: ``NVML_ERROR_UNINITIALIZED`` before :func:`nvmlInit` loaded the library;
            ``NVML_ERROR_FUNCTION_NOT_FOUND`` when this driver lacks the function.

    """
    function = _functions.get(name)
    if function is not None:
        return function
    if _lib is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    try:
        function = getattr(_lib, name)
    except AttributeError:
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND) from None
    function.restype = ctypes.c_int
    _functions[name] = function
    return function


def _call(name: str, *args: object) -> None:
    code = _nvmlGetFunctionPointer(name)(*args)
    if code != NVML_SUCCESS:
        raise NVMLError(code)


def _uint(name: str, handle: object, *args: object) -> int:
    value = ctypes.c_uint()
    _call(name, handle, *args, ctypes.byref(value))
    return value.value


def _ulonglong(name: str, handle: object) -> int:
    value = ctypes.c_ulonglong()
    _call(name, handle, ctypes.byref(value))
    return value.value


def _string(name: str, size: int, *handle: object) -> str:
    buffer = ctypes.create_string_buffer(size)
    _call(name, *handle, buffer, ctypes.c_uint(size))
    return buffer.value.decode(errors="replace")


def nvmlInit() -> None:
    """Load ``libnvidia-ml.so.1`` (once) and initialise NVML (``nvmlInit_v2``).

    Raises:
        NVMLError: ``NVML_ERROR_LIBRARY_NOT_FOUND`` when the library cannot be loaded, else
            the driver's code.

    """
    global _lib
    with _load_lock:
        if _lib is None:
            try:
                _lib = ctypes.CDLL(_LIBRARY)
            except OSError:
                raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from None
    _call("nvmlInit_v2")


def nvmlShutdown() -> None:
    """Release this process's NVML session (``nvmlShutdown``)."""
    _call("nvmlShutdown")


def nvmlDeviceGetCount() -> int:
    """Number of devices NVML sees."""
    count = ctypes.c_uint()
    _call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    return count.value


def nvmlDeviceGetHandleByIndex(index: int) -> ctypes.c_void_p:
    """The device handle of NVML index ``index``."""
    handle = ctypes.c_void_p()
    _call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
    return handle


def nvmlDeviceGetName(handle: ctypes.c_void_p) -> str:
    """The device's product name."""
    return _string("nvmlDeviceGetName", _NAME_BUFFER, handle)


def nvmlDeviceGetUUID(handle: ctypes.c_void_p) -> str:
    """The device's UUID (``GPU-...``)."""
    return _string("nvmlDeviceGetUUID", _UUID_BUFFER, handle)


def nvmlSystemGetDriverVersion() -> str:
    """The driver's version string."""
    return _string("nvmlSystemGetDriverVersion", _DRIVER_VERSION_BUFFER)


def nvmlDeviceGetMemoryInfo(handle: ctypes.c_void_p) -> c_nvmlMemory_t:
    """Total, free and used bytes (``nvmlDeviceGetMemoryInfo``, the v1 call pynvml makes)."""
    memory = c_nvmlMemory_t()
    _call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory))
    return memory


def nvmlDeviceGetTemperature(handle: ctypes.c_void_p, sensor: int) -> int:
    """Degrees Celsius of ``sensor``."""
    return _uint("nvmlDeviceGetTemperature", handle, ctypes.c_int(sensor))


def nvmlDeviceGetClockInfo(handle: ctypes.c_void_p, clock: int) -> int:
    """Current MHz of clock domain ``clock``."""
    return _uint("nvmlDeviceGetClockInfo", handle, ctypes.c_int(clock))


def nvmlDeviceGetMaxClockInfo(handle: ctypes.c_void_p, clock: int) -> int:
    """Maximum MHz of clock domain ``clock``."""
    return _uint("nvmlDeviceGetMaxClockInfo", handle, ctypes.c_int(clock))


def nvmlDeviceGetPowerUsage(handle: ctypes.c_void_p) -> int:
    """Milliwatts drawn now."""
    return _uint("nvmlDeviceGetPowerUsage", handle)


def nvmlDeviceGetPerformanceState(handle: ctypes.c_void_p) -> int:
    """P-state (0 fastest; 32 unknown)."""
    return _uint("nvmlDeviceGetPerformanceState", handle)


def nvmlDeviceGetCurrentClocksEventReasons(handle: ctypes.c_void_p) -> int:
    """Clock-event (throttle) reason bits."""
    return _ulonglong("nvmlDeviceGetCurrentClocksEventReasons", handle)


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: ctypes.c_void_p) -> int:
    """The same bits under the deprecated name older drivers have."""
    return _ulonglong("nvmlDeviceGetCurrentClocksThrottleReasons", handle)


def nvmlDeviceGetAccountingMode(handle: ctypes.c_void_p) -> int:
    """``NVML_FEATURE_ENABLED`` or ``NVML_FEATURE_DISABLED``."""
    return _uint("nvmlDeviceGetAccountingMode", handle)


def nvmlDeviceGetAccountingPids(handle: ctypes.c_void_p) -> list[int]:
    """PIDs with accounting records (exited ones included)."""
    size = _uint("nvmlDeviceGetAccountingBufferSize", handle)
    count = ctypes.c_uint(size)
    pids = (ctypes.c_uint * max(size, 1))()
    _call("nvmlDeviceGetAccountingPids", handle, ctypes.byref(count), pids)
    return [int(pid) for pid in pids[: count.value]]


def nvmlDeviceGetAccountingStats(handle: ctypes.c_void_p, pid: int) -> c_nvmlAccountingStats_t:
    """The accounting record of ``pid``."""
    stats = c_nvmlAccountingStats_t()
    _call("nvmlDeviceGetAccountingStats", handle, ctypes.c_uint(pid), ctypes.byref(stats))
    return stats
