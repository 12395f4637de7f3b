"""What one read of /proc or NVML returns: process identities and device samples.

Apart from ``model.py`` (12 ms to import), as ``leakcheck snapshot`` needs only these (NOTE
[lean start] in cli.py); named tuples, as frozen dataclasses cost several times more to create
(benchmarks/results/README.md) and to hash by the thousand.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["MIB", "AccountedProcess", "DeviceState", "GpuProcess", "ProcInfo", "ProcessKey", "Role"]

Role = Literal["parent", "worker", "descendant", "orphan", "foreign"]
"""Where a process stands in the watched job (docs/ARCHITECTURE.md, Roles and attribution)."""

MIB = 1024 * 1024


class ProcessKey(NamedTuple):
    """A process identity that survives PID reuse (NOTE [process identity] in procs.py)."""

    pid: int
    start_ticks: int


class ProcInfo(NamedTuple):
    """One process as read from /proc at one moment."""

    key: ProcessKey
    ppid: int
    name: str
    cmdline: str
    tagged: bool = False  # its environment carries this session's LEAKCHECK_SESSION tag


class GpuProcess(NamedTuple):
    """One process on one device as NVML reports it (bytes None where the driver won't say)."""

    pid: int
    device_index: int
    used_gpu_bytes: int | None
    kind: Literal["compute", "graphics", "both"] = "compute"


class DeviceState(NamedTuple):
    """Memory and thermal state of one device (telemetry None where not reported or read)."""

    # The field hides tuple's index() method, which nothing calls on a device state.
    index: int  # type: ignore[assignment]
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

    def to_dict(self) -> dict[str, object]:
        """JSON-able form: every field by name, the reasons as a list."""
        return self._asdict() | {"throttle_reasons": list(self.throttle_reasons)}


class AccountedProcess(NamedTuple):
    """NVML accounting record: kept by the driver even after the process exited."""

    pid: int
    device_index: int
    max_memory_bytes: int | None
    time_ms: int | None
    is_running: bool
