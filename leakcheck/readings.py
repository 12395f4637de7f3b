"""What one read of /proc or NVML returns: process identities and device samples.

Apart from ``model.py`` (which names them too) because ``leakcheck snapshot`` needs only
these: every frozen dataclass costs its creation at import, and a snapshot is a command
people run by hand and in loops (NOTE [lean start] in cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MIB",
    "AccountedProcess",
    "DeviceState",
    "GpuProcess",
    "ProcInfo",
    "ProcessKey",
    "Role",
]

Role = Literal["parent", "worker", "descendant", "orphan", "foreign"]
"""Where a process stands relative to the watched job (see DESIGN.md, attribution model)."""

MIB = 1024 * 1024


@dataclass(frozen=True, order=True)
class ProcessKey:
    """A process identity that survives PID reuse.

    Attributes:
        pid: The process ID in this PID namespace.
        create_time: Start time in seconds since the Unix epoch, computed like
            ``psutil.Process.create_time()`` so both sources compare equal.

    """

    pid: int
    create_time: float


@dataclass(frozen=True)
class ProcInfo:
    """One process as read from /proc at one moment."""

    key: ProcessKey
    ppid: int
    name: str
    cmdline: str
    tagged: bool = False
    """True when its environment carries this session's ``LEAKCHECK_SESSION`` tag."""


@dataclass(frozen=True)
class GpuProcess:
    """One process on one device as NVML reports it.

    ``used_gpu_bytes`` is None when the driver does not say (MIG, some vGPUs, permissions),
    never 0 or the 2**64-1 sentinel.
    """

    pid: int
    device_index: int
    used_gpu_bytes: int | None
    kind: Literal["compute", "graphics", "both"] = "compute"


@dataclass(frozen=True)
class DeviceState:
    """Memory and thermal state of one device at one moment.

    Telemetry fields are None when the device does not report them or when only memory
    was read.
    """

    index: int
    name: str
    uuid: str
    used_bytes: int
    total_bytes: int
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    power_w: float | None = None
    performance_state: int | None = None
    throttle_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class AccountedProcess:
    """NVML accounting record: kept by the driver even after the process exited."""

    pid: int
    device_index: int
    max_memory_bytes: int | None
    time_ms: int | None
    is_running: bool
