"""A small ctypes binding of the NVML calls leakcheck makes, in pynvml's shape.

Importing ``pynvml`` would cost ``leakcheck snapshot`` much of its start-up goal
(benchmarks/results/snapshot-start-h200.md); this loads ``libnvidia-ml.so.1`` only in
:func:`nvmlInit`. Tests stand ``tests/fake_pynvml.py`` in for it.
"""

from __future__ import annotations

import ctypes
import threading

TYPE_CHECKING = False  # typing is not imported at run time: this module is on a hot start
if TYPE_CHECKING:
    from collections.abc import Callable
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

# Texts for codes that can come before the library is loaded (nvmlErrorString needs it).
_OFFLINE_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
}


class NVMLError(Exception):
    """An NVML call returned ``value`` (an ``nvmlReturn_t``, the driver's code), not success."""

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
    """The C function ``name`` of the loaded library (``NVMLError`` before ``nvmlInit``)."""
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


def _out(name: str, kind: type[Any] | int) -> Callable[..., Any]:
    """``name(arguments..., kind *out)`` as a function returning ``out`` (ints as C uints).

    An int ``kind`` is the size of a text buffer: ``name([handle,] char *out, unsigned size)``.
    """

    def get(*args: object) -> Any:
        if isinstance(kind, int):
            buffer = ctypes.create_string_buffer(kind)
            _call(name, *args, buffer, ctypes.c_uint(kind))
            return buffer.value.decode(errors="replace")
        out = kind()
        c_args = (ctypes.c_uint(arg) if isinstance(arg, int) else arg for arg in args)
        _call(name, *c_args, ctypes.byref(out))
        return out.value if kind in (ctypes.c_uint, ctypes.c_ulonglong) else out

    get.__name__ = name
    return get


def nvmlInit() -> None:
    """Load ``libnvidia-ml.so.1`` (once) and initialise NVML (``nvmlInit_v2``)."""
    global _lib
    with _load_lock:
        if _lib is None:
            try:
                _lib = ctypes.CDLL("libnvidia-ml.so.1")
            except OSError:
                raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from None
    _call("nvmlInit_v2")


def nvmlShutdown() -> None:
    """Release this process's NVML session."""
    _call("nvmlShutdown")


nvmlDeviceGetCount = _out("nvmlDeviceGetCount_v2", ctypes.c_uint)
nvmlDeviceGetHandleByIndex = _out("nvmlDeviceGetHandleByIndex_v2", ctypes.c_void_p)
nvmlDeviceGetMemoryInfo = _out("nvmlDeviceGetMemoryInfo", c_nvmlMemory_t)  # v1, as pynvml's
nvmlDeviceGetAccountingStats = _out("nvmlDeviceGetAccountingStats", c_nvmlAccountingStats_t)
# Buffer sizes: NVML_DEVICE_NAME_V2_BUFFER_SIZE, ..._UUID_V2_..., NVML_SYSTEM_DRIVER_VERSION_...
nvmlDeviceGetName = _out("nvmlDeviceGetName", 96)
nvmlDeviceGetUUID = _out("nvmlDeviceGetUUID", 96)
nvmlSystemGetDriverVersion = _out("nvmlSystemGetDriverVersion", 80)
nvmlDeviceGetTemperature = _out("nvmlDeviceGetTemperature", ctypes.c_uint)  # (handle, sensor)
nvmlDeviceGetClockInfo = _out("nvmlDeviceGetClockInfo", ctypes.c_uint)  # (handle, clock): MHz
nvmlDeviceGetMaxClockInfo = _out("nvmlDeviceGetMaxClockInfo", ctypes.c_uint)
nvmlDeviceGetPowerUsage = _out("nvmlDeviceGetPowerUsage", ctypes.c_uint)  # milliwatts
nvmlDeviceGetPerformanceState = _out("nvmlDeviceGetPerformanceState", ctypes.c_uint)
nvmlDeviceGetAccountingMode = _out("nvmlDeviceGetAccountingMode", ctypes.c_uint)
_accounting_buffer_size = _out("nvmlDeviceGetAccountingBufferSize", ctypes.c_uint)
nvmlDeviceGetCurrentClocksEventReasons = _out(
    "nvmlDeviceGetCurrentClocksEventReasons", ctypes.c_ulonglong
)
# The same bits under the deprecated name older drivers have.
nvmlDeviceGetCurrentClocksThrottleReasons = _out(
    "nvmlDeviceGetCurrentClocksThrottleReasons", ctypes.c_ulonglong
)


def nvmlDeviceGetAccountingPids(handle: ctypes.c_void_p) -> list[int]:
    """PIDs with accounting records (exited ones included)."""
    size = _accounting_buffer_size(handle)
    count = ctypes.c_uint(size)
    pids = (ctypes.c_uint * max(size, 1))()
    _call("nvmlDeviceGetAccountingPids", handle, ctypes.byref(count), pids)
    return [int(pid) for pid in pids[: count.value]]
