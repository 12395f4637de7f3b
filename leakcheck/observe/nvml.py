"""NVML access: who holds GPU memory and how each device is doing, without touching CUDA.

The only caller of NVML, through ``nvml_lib`` (looked up at call time: tests stand
``tests/fake_pynvml.py`` in for it). NVML unusable raises ``NVMLUnavailable`` (one line with a
hint); a call failing on a device a ``LeakCheckError`` naming both; a bad index a
``UsageError``; unreported telemetry is None.

NOTE [fork]: NVML handles are per process: in a forked child every public method calls
``nvmlInit`` again and drops every cached handle first; the locks are replaced in the child.

NOTE [descriptors]: ``nvmlInit`` and the first device calls open ``/dev/nvidia*`` nodes a CUDA
context opens too, which forked children inherit (pinning no context); ``own_descriptors()``
names them, so that the tracker does not count them as what a child inherited from the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from leakcheck.core.errors import LeakCheckError, NVMLUnavailable, UsageError
from leakcheck.core.readings import AccountedProcess, DeviceState, GpuProcess
from leakcheck.observe import procs
from leakcheck.observe.nvml_lib import (
    NVML_CLOCK_SM,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_FEATURE_ENABLED,
    NVML_SUCCESS,
    NVML_TEMPERATURE_GPU,
)

_Listed = Literal["compute", "graphics"]
_NOT_AVAILABLE = (2**64 - 1, 2**32 - 1)

_REASON_BITS = ("gpu_idle", "applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost",
                "sw_thermal", "hw_thermal", "hw_power_brake", "display_clocks")  # fmt: skip
THROTTLE_REASON_NAMES = tuple((1 << bit, name) for bit, name in enumerate(_REASON_BITS))
"""Clock-event (throttle) reason bits of ``nvmlDeviceGetCurrentClocksEventReasons``."""

_SUFFIX = "GPU memory is not checked, process checks still run"
_INIT_HINTS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)",
    NVML_ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded (does `nvidia-smi` work?)"
    ),
    NVML_ERROR_NO_PERMISSION: (
        "no permission to open /dev/nvidia* (check the device files or the container's "
        "device mounts)"
    ),
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "libnvidia-ml and the kernel driver versions differ (reboot, or reload the "
        "nvidia kernel module)"
    ),
}


def _failed(name: str, device: int, exc: BaseException) -> LeakCheckError:
    return LeakCheckError(
        f"NVML {name} failed on device {device}: {_one_line(exc) or type(exc).__name__}"
    )


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """The names of the set clock-event reason bits, in bit order (unnamed bits left out)."""
    return tuple(name for bit, name in THROTTLE_REASON_NAMES if mask & bit)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _known(value: Any) -> int | None:
    """An NVML counter as int; None for "not available" (None or all-ones)."""
    if value is None:
        return None
    number = int(value)
    return None if number < 0 or number in _NOT_AVAILABLE else number


# NOTE [process lists]: pynvml's ``nvmlDevice*RunningProcesses`` asks the driver twice per call
# and builds an object per entry; the sampler reads the lists many times a second. So the C
# function (``_v3``, else ``_v2``: one entry layout) is called once with a buffer kept from the
# last call; a short one is grown to the count the driver fills in, at most twice.
class _RawProcessList:
    """A running-process list of one device read through a reused buffer (NOTE [process lists])."""

    def __init__(self, function: Any, entry_type: Any, error_type: type[BaseException]) -> None:
        self._function = function
        self._entry_type = entry_type
        self._error_type = error_type
        self._buffer: Any = (entry_type * 32)()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, lib: Any, name: str) -> _RawProcessList | None:
        """The reader of list ``name``; None where the driver has neither ``_v3`` nor ``_v2``."""
        for version in ("_v3", "_v2"):
            with contextlib.suppress(lib.NVMLError):
                function = lib._nvmlGetFunctionPointer(f"{name}{version}")
                return cls(function, lib.c_nvmlProcessInfo_v3_t, lib.NVMLError)
        return None

    def read(self, handle: Any) -> list[tuple[int, int | None]]:
        """(pid, used bytes or None) per entry; raises the binding's ``NVMLError``."""
        with self._lock:
            for _ in range(3):
                count = ctypes.c_uint(len(self._buffer))
                code = self._function(handle, ctypes.byref(count), self._buffer)
                if code != NVML_ERROR_INSUFFICIENT_SIZE:
                    break
                self._buffer = (self._entry_type * (count.value * 2 + 8))()
            if code != NVML_SUCCESS:
                raise self._error_type(code)
            return [(int(e.pid), _known(e.usedGpuMemory)) for e in self._buffer[: count.value]]


@dataclass
class _Device:
    """What one session keeps of a device: read once (NOTE [fork]: dropped in a child)."""

    handle: Any
    name_uuid: tuple[str, str] | None = None  # only once both were really read
    max_sm_clock: tuple[int | None] | None = None  # (MHz or unknown,) once asked
    readers: dict[str, _RawProcessList | None] = field(default_factory=dict)  # None: no call
    unsupported: set[str] = field(default_factory=set)  # list calls the device refused


class Nvml:
    """One process's NVML session, from :func:`get`; handles, names and UUIDs cached.

    Thread-safe and fork-tolerant (NOTE [fork]). Devices are NVML indices (PCI bus order,
    whatever ``CUDA_VISIBLE_DEVICES`` says).
    """

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._error: type[BaseException] = lib.NVMLError
        self._lock = threading.Lock()
        self._pid = -1
        self._count = 0
        self._devices: dict[int, _Device] = {}

    def _ensure(self) -> None:
        """``nvmlInit`` and the device count, first or again in a forked child (NOTE [fork]).

        Every handle is opened too, so that what NVML opens counts as its own (NOTE
        [descriptors]).
        """
        if self._pid == os.getpid():
            return
        before = _nvidia_fd_numbers()
        with self._lock:
            if self._pid == os.getpid():
                return
            self._devices.clear()
            try:
                self._lib.nvmlInit()
            except self._error as exc:
                code = getattr(exc, "value", None)
                reason = _INIT_HINTS.get(code) if isinstance(code, int) else None
                reason = reason or f"nvmlInit failed: {_one_line(exc) or type(exc).__name__}"
                raise NVMLUnavailable(f"NVML unavailable: {reason}; {_SUFFIX}") from exc
            try:
                self._count = int(self._lib.nvmlDeviceGetCount())
                reason = "the driver is loaded but sees no NVIDIA GPU (nvmlDeviceGetCount() == 0)"
            except self._error as exc:
                self._count, reason = 0, f"nvmlDeviceGetCount failed: {_one_line(exc)}"
            if self._count <= 0:
                self._quiet_shutdown()
                raise NVMLUnavailable(f"NVML unavailable: {reason}; {_SUFFIX}")
            self._pid = os.getpid()
        with contextlib.suppress(LeakCheckError):
            self.processes()
        global _own_fds
        _own_fds = _own_fds | (_nvidia_fd_numbers() - before)

    def _quiet_shutdown(self) -> None:
        with contextlib.suppress(self._error):
            self._lib.nvmlShutdown()

    def _query(
        self, name: str, *args: Any, device: int | None = None, absent: int | None = None
    ) -> Any:
        """Call NVML ``name``; None on code ``absent``, or on any failure with no ``device``."""
        try:
            return getattr(self._lib, name)(*args)
        except self._error as exc:
            if device is not None and (absent is None or getattr(exc, "value", None) != absent):
                raise _failed(name, device, exc) from exc
        except AttributeError:
            if device is not None:
                raise
        return None

    def _select(self, devices: Sequence[int] | None) -> tuple[int, ...]:
        if devices is None:
            return tuple(range(self._count))
        for index in devices:
            if not isinstance(index, int) or isinstance(index, bool):
                raise UsageError(f"NVML device index must be an int, got {index!r}")
            if not 0 <= index < self._count:
                raise UsageError(
                    f"NVML device index {index} out of range: this machine has "
                    f"{self._count} device(s) (0..{self._count - 1})"
                )
        return tuple(dict.fromkeys(devices))  # in order, each once

    def _device(self, index: int) -> _Device:
        """The device's record, its handle opened under the lock the first time."""
        device = self._devices.get(index)
        if device is None:
            with self._lock:
                device = self._devices.get(index)
                if device is None:
                    handle = self._query(
                        "nvmlDeviceGetHandleByIndex", *self._select((index,)), device=index
                    )
                    device = self._devices[index] = _Device(handle)
        return device

    def _running(
        self, index: int, device: _Device, name: str, *, optional: bool
    ) -> list[tuple[int, int | None]]:
        """One running-process list (NOTE [process lists]); unsupported and optional: empty."""
        if name in device.unsupported:
            return []
        if name not in device.readers:  # threads racing here open equal readers: either does
            device.readers[name] = _RawProcessList.open(self._lib, name)
        reader = device.readers[name]
        try:
            if reader is None:  # a driver older than R450
                raise self._lib.NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            return reader.read(device.handle)
        except self._error as exc:
            if optional and getattr(exc, "value", None) == NVML_ERROR_NOT_SUPPORTED:
                device.unsupported.add(name)
                return []
            raise _failed(name, index, exc) from exc

    def device_count(self) -> int:
        """The number of NVIDIA devices NVML sees (at least 1)."""
        self._ensure()
        return self._count

    def driver_version(self) -> str | None:
        """The driver's version string; None when NVML does not say."""
        self._ensure()
        version = self._query("nvmlSystemGetDriverVersion")
        return None if version is None else str(version)

    def processes(
        self, devices: Sequence[int] | None = None, *, graphics: bool = True
    ) -> tuple[GpuProcess, ...]:
        """Processes with a context on the devices (None: all), one per (pid, device), sorted.

        Compute and graphics lists are merged (``kind``): a process in both counts its bytes
        once (the larger known); entries of one list for one pid (MIG) are summed. Each list
        holds the driver's global lock while read: ``graphics=False`` leaves that list out.
        """
        self._ensure()
        found: list[GpuProcess] = []
        for index in self._select(devices):
            device = self._device(index)
            by_pid: dict[int, dict[_Listed, int | None]] = {}  # pid -> list -> its bytes
            kinds: tuple[_Listed, ...] = ("compute", "graphics") if graphics else ("compute",)
            for kind in kinds:
                call = f"nvmlDeviceGet{kind.title()}RunningProcesses"
                for pid, used in self._running(index, device, call, optional=kind == "graphics"):
                    lists = by_pid.setdefault(pid, {})
                    before = lists.get(kind, 0)
                    lists[kind] = None if before is None or used is None else before + used
            for pid, lists in sorted(by_pid.items()):
                known = [used for used in lists.values() if used is not None]
                shown = "both" if len(lists) == 2 else next(iter(lists))
                found.append(GpuProcess(pid, index, max(known) if known else None, shown))
        return tuple(found)

    def memory(self, devices: Sequence[int] | None = None) -> tuple[DeviceState, ...]:
        """Used and total memory, name and UUID of each device (None: all); the cheap read."""
        self._ensure()
        states: list[DeviceState] = []
        for index in self._select(devices):
            device = self._device(index)
            handle = device.handle
            name, uuid = device.name_uuid or (
                self._query("nvmlDeviceGetName", handle),
                self._query("nvmlDeviceGetUUID", handle),
            )
            if name is not None and uuid is not None:
                device.name_uuid = (name, uuid)
            info = self._query("nvmlDeviceGetMemoryInfo", handle, device=index)
            used, total = int(info.used), int(info.total)
            states.append(DeviceState(index, name or f"GPU {index}", uuid or "", used, total))
        return tuple(states)

    def devices(self, devices: Sequence[int] | None = None) -> tuple[DeviceState, ...]:
        """Memory plus telemetry of each device (None: all).

        Telemetry: temperature, SM clock and its max, power, P-state and clock-event reasons;
        a call the device does not support leaves only that field None (the reasons empty).
        """
        states: list[DeviceState] = []
        for state in self.memory(devices):
            device = self._device(state.index)
            handle = device.handle
            if device.max_sm_clock is None:  # a property of the board: read once
                clock = self._query("nvmlDeviceGetMaxClockInfo", handle, NVML_CLOCK_SM)
                device.max_sm_clock = (_known(clock),)
            power_mw = _known(self._query("nvmlDeviceGetPowerUsage", handle))
            pstate = _known(self._query("nvmlDeviceGetPerformanceState", handle))
            reasons = self._query("nvmlDeviceGetCurrentClocksEventReasons", handle)
            if reasons is None:  # older drivers only have the deprecated name
                reasons = self._query("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
            temperature = self._query("nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU)
            sm_clock = self._query("nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM)
            states.append(
                state._replace(
                    temperature_c=_known(temperature),
                    sm_clock_mhz=_known(sm_clock),
                    sm_clock_max_mhz=device.max_sm_clock[0],
                    power_w=power_mw / 1000.0 if power_mw is not None else None,
                    performance_state=None if pstate == 32 else pstate,  # 32: unknown
                    throttle_reasons=throttle_reason_names(int(reasons)) if reasons else (),
                )
            )
        return tuple(states)

    def accounting(self, device: int) -> tuple[AccountedProcess, ...]:
        """The per-PID records the driver keeps in accounting mode, exited processes included.

        ``()`` when accounting mode is off: leakcheck never switches it on (a device-wide
        setting that needs root). The driver's buffer is circular: old PIDs drop out.
        """
        if not self.accounting_enabled(device):
            return ()
        handle = self._device(device).handle
        records: list[AccountedProcess] = []
        for pid in map(int, self._query("nvmlDeviceGetAccountingPids", handle, device=device)):
            stats = self._query(
                "nvmlDeviceGetAccountingStats",
                handle,
                pid,
                device=device,
                absent=NVML_ERROR_NOT_FOUND,
            )
            if stats is not None:  # else dropped from the circular buffer since the list
                records.append(
                    AccountedProcess(
                        pid,
                        device,
                        _known(stats.maxMemoryUsage),
                        _known(stats.time),
                        bool(stats.isRunning),
                    )
                )
        return tuple(records)

    def accounting_enabled(self, device: int) -> bool:
        """Whether the driver's accounting mode is on for ``device`` (False if unsupported)."""
        self._ensure()
        mode = self._query(
            "nvmlDeviceGetAccountingMode",
            self._device(device).handle,
            device=device,
            absent=NVML_ERROR_NOT_SUPPORTED,
        )
        return mode is not None and int(mode) == NVML_FEATURE_ENABLED


_lock = threading.Lock()
_instance: Nvml | None = None
_own_fds: frozenset[int] = frozenset()
# (pid, message) of a failed start: not retried in that process (a driver does not appear
# mid-run, and a failing dlopen on every sample would cost time).
_failure: tuple[int, str] | None = None


def get() -> Nvml:
    """The process-wide :class:`Nvml`, started on first use (thread-safe, once).

    Raises:
        NVMLUnavailable: NVML cannot be used here; remembered for this process.

    """
    global _instance, _failure
    instance = _instance
    if instance is not None and instance._pid == os.getpid():
        return instance
    with _lock:
        pid = os.getpid()
        if _failure is not None and _failure[0] == pid:
            raise NVMLUnavailable(_failure[1])
        if _instance is not None:
            _instance._ensure()
            return _instance
        session = Nvml(importlib.import_module("leakcheck.observe.nvml_lib"))
        try:
            session._ensure()
        except NVMLUnavailable as exc:
            _failure = (pid, str(exc))
            raise
        except BaseException:
            session._quiet_shutdown()  # never published: its nvmlInit is undone
            raise
        # Published only now, its descriptors known: another thread's get() takes no lock.
        _instance = session
        return session


def gpu_bytes_by_pid(
    processes: Iterable[GpuProcess],
) -> tuple[dict[int, dict[int, int]], set[int]]:
    """Used bytes per device for each PID where known, and the PIDs listed without a count."""
    by_pid: dict[int, dict[int, int]] = {}
    unknown: set[int] = set()
    for pid, index, used, _ in processes:
        per_device = by_pid.setdefault(pid, {})
        if used is None:
            unknown.add(pid)
        else:
            per_device[index] = per_device.get(index, 0) + used
    return by_pid, unknown


def own_descriptors() -> frozenset[int]:
    """The ``/dev/nvidia*`` descriptors NVML opened in this process (NOTE [descriptors])."""
    return _own_fds


def _nvidia_fd_numbers() -> set[int]:
    return set(procs.nvidia_fds(os.getpid()) or ())


def start_in_background() -> None:
    """Begin NVML's start on a thread, unless begun (NOTE [overlapped start] in snapshot.py)."""
    if _instance is not None or _failure is not None:
        return
    starter = threading.Thread(target=availability, name="leakcheck-nvml-start", daemon=True)
    with contextlib.suppress(RuntimeError):  # no thread to be had: get() starts it then
        starter.start()


def availability() -> tuple[bool, str]:
    """``(True, "")`` where NVML can be used, else ``(False, reason)``; starts :func:`get`'s."""
    try:
        get()
    except LeakCheckError as exc:
        return False, _one_line(exc)
    except Exception as exc:  # "never raises": any surprise is a reason
        return False, _one_line(f"NVML unavailable: {type(exc).__name__}: {exc}; {_SUFFIX}")
    return True, ""


def _after_fork_in_child() -> None:
    # A lock held by another thread at fork time stays held forever in the child.
    global _lock
    _lock = threading.Lock()
    if _instance is not None:
        _instance._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
