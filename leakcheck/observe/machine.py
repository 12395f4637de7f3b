"""What the machine says about a death: the memory cgroup's OOM kills and its free memory.

A SIGKILL does not say who sent it; the OOM killer, its usual sender, leaves evidence: the
memory cgroup counts its kills (v2 ``memory.events``, v1 ``memory.oom_control``), and the
machine-wide one kills when ``MemAvailable`` is nearly 0. Only this evidence names it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"  # tests point it elsewhere

_PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(65536)
    except OSError:
        return None


def _memory_cgroups() -> list[tuple[str, bool]]:
    """The memory cgroup paths of ``/proc/self/cgroup``, in their order; with ``v2``."""
    found: list[tuple[str, bool]] = []
    for line in (_read_text(_PROC_SELF_CGROUP) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        number, controllers, path = parts
        v2 = number == "0" and not controllers
        if v2 or "memory" in controllers.split(","):
            found.append((path.strip().lstrip("/"), v2))
    return found


def own_memory_cgroup() -> tuple[str, bool] | None:
    """The memory cgroup folder of this process and whether it is v2 (None: none found)."""
    found = sorted(_memory_cgroups(), key=lambda item: item[1])  # v1's first
    if not found:
        return None
    path, v2 = found[0]
    return os.path.join(CGROUP_ROOT, *(() if v2 else ("memory",)), path), v2


def oom_kill_count() -> int | None:
    """How many processes the OOM killer killed in this process's memory cgroup (None: unknown)."""
    for path, v2 in _memory_cgroups():
        base = CGROUP_ROOT if v2 else os.path.join(CGROUP_ROOT, "memory")
        # Its own folder, then the mount's root: in a container the path may name the host's
        # hierarchy while the container's own cgroup is at the root.
        for folder in [os.path.join(base, path), base] if path else [base]:
            name = "memory.events" if v2 else "memory.oom_control"
            for line in (_read_text(os.path.join(folder, name)) or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    return None


@dataclass(frozen=True)
class MachineMemory:
    """``/proc/meminfo``'s total and available memory of the machine (or container)."""

    total_bytes: int
    available_bytes: int


def machine_memory() -> MachineMemory | None:
    """The machine's total and available memory; None where ``/proc/meminfo`` is unreadable."""
    values: dict[str, int] = {}
    for line in (_read_text("/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * 1024  # kB
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    return None if total is None or available is None else MachineMemory(total, available)
