"""Who holds GPU memory right now, as process trees; orphans and descriptor holders flagged.

One call reads NVML once and /proc once: what ``leakcheck snapshot`` prints and
``Tracker.snapshot()`` returns; with a job's root, also its processes' host memory and a forked
worker's copies of its parent's (NOTE [copy on read] in hostmem.py).

NOTE [overlapped start]: NVML's start (library load, ``nvmlInit``, first handles) is most of
a fresh process's snapshot, and it waits in the driver with the GIL released. So the command
begins it on a thread before importing this module (``nvml.start_in_background``), and
``take_snapshot`` reads NVML on a thread while it scans /proc. Its own process is counted
last, without the descriptors NVML opened (``nvml.own_descriptors``): a snapshot does not flag
itself, while a tracked process's own CUDA descriptors still count.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from leakcheck.core import roles
from leakcheck.core.errors import LeakCheckError, NVMLUnavailable
from leakcheck.core.names import process_name
from leakcheck.core.readings import DeviceState, GpuProcess, ProcessKey, ProcInfo, Role
from leakcheck.core.units import format_mib
from leakcheck.observe import nvml, procs

if TYPE_CHECKING:
    # Not at run time: a plain snapshot needs neither (NOTE [lean start] in cli.py).
    from leakcheck.core.model import Attribution
    from leakcheck.observe.hostmem import HostMemory
    from leakcheck.observe.mailbox import Birth

SNAPSHOT_SCHEMA_VERSION = 1
_NAME_WIDTH = 72  # a process's name in the tree is cut to this many characters


class ProcessSnapshot(NamedTuple):
    """One process in a snapshot.

    ``role``: relative to the job root (NOTE [roles from outside] in roles.py). ``flags``:
    ``orphan`` (its session's root is gone or not its ancestor), ``descriptor-holder``
    (descriptors open, absent from NVML), ``helper`` (a runtime helper of the job).
    """

    info: ProcInfo
    role: Role | None
    gpu_bytes: Mapping[int, int]  # per device where NVML listed it
    gpu_bytes_unknown: bool = False
    nvidia_fds: int | None = None  # open /dev/nvidia* descriptors (None: not read)
    flags: tuple[str, ...] = ()
    session: str | None = None  # the LEAKCHECK_SESSION tag in its environment
    host: HostMemory | None = None  # for the job's processes
    copied_bytes: int | None = None  # a forked worker's copies of its parent's memory


class Snapshot(NamedTuple):
    """Processes that hold GPU memory or descriptors, with their ancestors for context."""

    taken_unix_s: float
    attribution: Attribution
    attribution_reason: str
    devices: tuple[DeviceState, ...]
    processes: tuple[ProcessSnapshot, ...]
    root_pid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form with a schema version."""
        return {
            "schema_version": SNAPSHOT_SCHEMA_VERSION,
            "taken_unix_s": self.taken_unix_s,
            "attribution": self.attribution,
            "attribution_reason": self.attribution_reason,
            "root_pid": self.root_pid,
            "devices": [device.to_dict() for device in self.devices],
            "processes": [_process_dict(entry) for entry in self.processes],
        }

    def format(self) -> str:
        """Process trees as indented text, one line per process."""
        lines: list[str] = []
        if self.attribution != "ok":
            lines.append(f"leakcheck snapshot: {self.attribution_reason}")
        lines.extend(_device_line(device) for device in self.devices)
        pids = {entry.info.key.pid for entry in self.processes}
        children: dict[int | None, list[ProcessSnapshot]] = {}  # None: the roots
        for entry in sorted(self.processes, key=lambda e: e.info.key.pid):
            ppid = entry.info.ppid
            shown = ppid if ppid in pids and ppid != entry.info.key.pid else None
            children.setdefault(shown, []).append(entry)

        def walk(parent: int | None, prefix: str) -> None:
            kids = children.get(parent, [])
            for position, kid in enumerate(kids):
                last = position == len(kids) - 1
                branch, indent = ("└─ ", "   ") if last else ("├─ ", "│  ")
                if parent is None:
                    branch = indent = ""
                lines.append(prefix + branch + _process_line(kid))
                walk(kid.info.key.pid, prefix + indent)

        walk(None, "  ")
        if not self.processes:
            checked = "GPU memory or " if self.attribution == "ok" else ""
            lines.append(f"  no process holds {checked}/dev/nvidia* descriptors")
        # A helper is said on its own line, and is no cause for concern: not "flagged".
        flagged = [
            f"PID {entry.info.key.pid} ({'/'.join(flags)})"
            for entry in self.processes
            if (flags := [flag for flag in entry.flags if flag != roles.HELPER_FLAG])
        ]
        if flagged:
            lines.append(f"{len(flagged)} flagged: " + ", ".join(flagged))
        return "\n".join(lines)


def _process_dict(entry: ProcessSnapshot) -> dict[str, Any]:
    info, host = entry.info, entry.host
    keys = ("uss_bytes", "pss_bytes", "rss_bytes", "rss_peak_bytes", "source", "shared_dirty_bytes")
    return {
        "pid": info.key.pid,
        "start_ticks": info.key.start_ticks,
        "create_time": procs.create_time_s(info.key.start_ticks),  # for people only
        "ppid": info.ppid,
        "name": info.name,
        "cmdline": info.cmdline,
        "role": entry.role,
        "gpu_bytes": {str(index): value for index, value in entry.gpu_bytes.items()},
        "gpu_bytes_unknown": entry.gpu_bytes_unknown,
        "nvidia_fds": entry.nvidia_fds,
        "flags": list(entry.flags),
        "session": entry.session,
        **{f"host_{name}": getattr(host, name) if host else None for name in keys},
        "copied_bytes": entry.copied_bytes,
    }


def _device_line(device: DeviceState) -> str:
    parts = [
        f"GPU{device.index} {device.name}: {format_mib(device.used_bytes)} / "
        f"{format_mib(device.total_bytes)} MiB used"
    ]
    if device.temperature_c is not None:
        parts.append(f"{device.temperature_c} C")
    if device.sm_clock_mhz is not None:
        clock_max = f"/{device.sm_clock_max_mhz}" if device.sm_clock_max_mhz else ""
        parts.append(f"SM {device.sm_clock_mhz}{clock_max} MHz")
    if device.power_w is not None:
        parts.append(f"{device.power_w:.0f} W")
    return ", ".join(parts)


def _host_text(host: HostMemory | None, copied_bytes: int | None) -> str | None:
    """``host USS 183 MiB (RSS 421 MiB, shared 216 MiB), copied 173 MiB of its parent's``."""
    if host is None or host.rss_bytes is None:
        return None
    if host.uss_bytes is None:
        return f"host RSS {format_mib(host.rss_bytes)} MiB"
    shared = ""
    if copied_bytes is not None and host.shared_dirty_bytes is not None:
        shared = f", shared {format_mib(host.shared_dirty_bytes)} MiB"
    text = (
        f"host USS {format_mib(host.uss_bytes)} MiB (RSS {format_mib(host.rss_bytes)} MiB{shared})"
    )
    if copied_bytes is not None:
        text += f", copied {format_mib(copied_bytes)} MiB of its parent's"
    return text


def _process_line(entry: ProcessSnapshot) -> str:
    memory = [
        f"GPU{index} {format_mib(value)} MiB" for index, value in sorted(entry.gpu_bytes.items())
    ]
    if entry.gpu_bytes_unknown:
        memory.append("size unknown")
    text = f"PID {entry.info.key.pid}"
    if entry.role:
        text += f" [{entry.role}]"
    # One line per process: a `python -c` script's newlines must not break the tree.
    text += f" {process_name(entry.info.cmdline, width=_NAME_WIDTH, empty=entry.info.name)}"
    details = [", ".join(memory)] if memory else []
    if entry.nvidia_fds:
        details.append(f"{entry.nvidia_fds} /dev/nvidia* fds")
    details.extend(entry.flags)
    host = _host_text(entry.host, entry.copied_bytes)
    if host:
        details.append(host)
    return text + ("  — " + "; ".join(details) if details else "")


_GpuRead = tuple["Attribution", str, tuple[DeviceState, ...], tuple[GpuProcess, ...]]


def read_gpu_processes(devices: Iterable[int] | None = None, *, telemetry: bool = True) -> _GpuRead:
    """Read NVML once: attribution status and its reason, device states, GPU processes.

    Never raises: NVML failures come back as the status and its one-line reason.
    """
    available, reason = nvml.availability()
    if not available:
        return "nvml-unavailable", reason, (), ()
    try:
        handle = nvml.get()
        wanted = list(devices) if devices is not None else None
        device_states = handle.devices(wanted) if telemetry else handle.memory(wanted)
        gpu_processes = handle.processes(wanted)
    except (NVMLUnavailable, LeakCheckError) as error:
        return "nvml-unavailable", str(error), (), ()
    if not device_states:
        return "no-gpu", "no NVIDIA GPU is visible to NVML", (), ()
    missing = [p.pid for p in gpu_processes if not procs.pid_exists_here(p.pid)]
    if missing and procs.pid_namespace_nested():
        return (
            "blind-namespace",
            f"NVML reports PIDs {sorted(set(missing))[:5]} that do not exist in this PID "
            "namespace (a container without --pid=host?): only device totals are reliable",
            device_states,
            gpu_processes,
        )
    return "ok", "", device_states, gpu_processes


def take_snapshot(
    *,
    root_pid: int | None = None,
    devices: Iterable[int] | None = None,
    with_fds: bool = True,
    known_workers: Collection[ProcessKey] = (),
    host_memory: bool | None = None,
    telemetry: bool = True,
    births: Mapping[ProcessKey, Birth] | None = None,
) -> Snapshot:
    """Who holds GPU memory (and ``/dev/nvidia*`` descriptors) now; never raises.

    Args:
        root_pid: A job root: its descendants are listed with roles relative to it. None lists
            every GPU process of the machine.
        devices: Device indices to read (default all).
        with_fds: Count every process's ``/dev/nvidia*`` descriptors: finds descriptor holders.
        known_workers: The only direct children labelled ``worker``.
        host_memory: Read the host memory of the job's processes (default: with a root).
        telemetry: Read each device's telemetry (a driver call each).
        births: Loader workers' birth readings; None reads the root's trackers' mailboxes.

    """
    read: list[_GpuRead] = []  # NVML, read on a thread meanwhile (NOTE [overlapped start])

    def read_gpu() -> None:
        try:
            read.append(read_gpu_processes(devices, telemetry=telemetry))
        except Exception as exc:  # it never raises; a surprise is a reason, not a lost snapshot
            reason = f"NVML unavailable: the read failed: {type(exc).__name__}: {exc}"
            read.append(("nvml-unavailable", reason, (), ()))

    reader = threading.Thread(target=read_gpu, name="leakcheck-snapshot-nvml", daemon=True)
    try:
        reader.start()
    except RuntimeError:  # no thread to be had (a limit, interpreter shutdown): read here
        read_gpu()
    # Command lines are read for the processes shown only. Kernel threads hold no descriptors
    # and carry no tag: left out (an ancestor of a shown process is still shown).
    every = {
        info.key.pid: info for info in procs.scan_all(with_cmdline=False, kernel_threads=False)
    }
    lineage: set[int] = set()
    if root_pid is not None:
        lineage = {info.key.pid for info in procs.tree_below(root_pid, every.values())}
        lineage.add(root_pid)
    own_pid = os.getpid()
    others = every.keys() - {own_pid} if with_fds else set()
    counts = {pid: procs.nvidia_fd_count(pid) for pid in others}
    fds = {pid: count for pid, count in counts.items() if count}
    if reader.is_alive():
        reader.join()
    if with_fds and own_pid in every:
        own = procs.nvidia_fds(own_pid) or {}  # after NVML's read, less what NVML opened
        if count := len(own.keys() - nvml.own_descriptors()):
            fds[own_pid] = count
    attribution, reason, device_states, gpu_processes = (
        read[0] if read else ("nvml-unavailable", "NVML unavailable: its read did not end", (), ())
    )
    gpu_by_pid, unknown_pids = nvml.gpu_bytes_by_pid(gpu_processes)

    interesting = set(gpu_by_pid) | set(fds) | lineage
    sessions: dict[int, str | None] = {pid: procs.tagged_session(pid) for pid in interesting}
    root_key = procs.process_key(root_pid) if root_pid is not None else None
    if root_key is not None:
        # The job's processes reparented away still carry its tag; all were born after the
        # root, so older environments (the costliest reads) are not read.
        for pid, candidate in every.items():
            if pid in interesting or candidate.key.start_ticks < root_key.start_ticks:
                continue
            tag = procs.tagged_session(pid)
            if tag is not None and _names_root(tag, root_key):
                interesting.add(pid)
                sessions[pid] = tag
    shown = set(interesting)  # and their ancestors, which give the trees their shape
    for pid in interesting:
        info = every.get(pid)
        for _ in range(64):
            if info is None or info.ppid <= 1 or info.key.pid == root_pid:
                break
            shown.add(info.ppid)
            info = every.get(info.ppid)

    job = lineage | {pid for pid, tag in sessions.items() if tag is not None}
    want_host = root_pid is not None if host_memory is None else host_memory
    if want_host:
        from leakcheck.observe import hostmem, mailbox  # (NOTE [lean start] in cli.py)

        if births is None and root_pid is not None:
            births = mailbox.read_births(root_pid)
    entries: list[ProcessSnapshot] = []
    for pid in sorted(shown):
        scanned = every.get(pid)
        info = procs.read_proc(pid)  # with its command line
        if info is None or (scanned is not None and info.key != scanned.key):
            info = scanned  # gone since the scan, or its PID reused: what the scan saw
        if info is None:
            continue
        flags: list[str] = []
        tag = sessions.get(pid)
        if tag is not None and pid not in lineage and _is_orphaned(tag, info.key):
            flags.append("orphan")
        if fds.get(pid) and pid not in gpu_by_pid:
            flags.append("descriptor-holder")
        if pid in lineage and pid != root_pid and roles.is_runtime_helper(info.cmdline):
            flags.append(roles.HELPER_FLAG)
        host = copied = None
        if want_host and pid in job:
            host = hostmem.read_host_memory(info.key)
            forked, birth = (births or {}).get(info.key, (None, None))
            if host is not None and forked is True and birth is not None:
                copied = hostmem.copied_bytes(birth, host)
        if "orphan" in flags:
            role: Role | None = "orphan"
        elif root_pid is None:
            role = None
        elif pid == root_pid:
            role = "parent"
        elif pid not in lineage:
            role = "foreign"
        elif info.ppid == root_pid:
            role = roles.direct_child_role(info.key, known_workers)
        else:
            role = "descendant"
        entries.append(
            ProcessSnapshot(
                info=info,
                role=role,
                gpu_bytes=gpu_by_pid.get(pid, {}),
                gpu_bytes_unknown=pid in unknown_pids,
                nvidia_fds=fds.get(pid) if with_fds else None,
                flags=tuple(flags),
                session=tag,
                host=host,
                copied_bytes=copied,
            )
        )
    return Snapshot(time.time(), attribution, reason, device_states, tuple(entries), root_pid)


def _names_root(tag: str, root_key: ProcessKey) -> bool:
    # A tag names its root by identity; one whose root was unreadable (ticks 0) by PID only:
    # a tag an earlier process of that PID left is older than the root, never read.
    root = procs.session_root_pid(tag)
    return (
        root is not None
        and root.pid == root_key.pid
        and root.start_ticks in (0, root_key.start_ticks)
    )


def _is_orphaned(tag: str, key: ProcessKey) -> bool:
    """Whether a tagged process lost its session's root: gone, PID reused, or not its ancestor."""
    root = procs.session_root_pid(tag)
    if root is None:
        return False
    root_key = procs.process_key(root.pid)
    if root_key is None or not _names_root(tag, root_key):
        return True
    return root_key.start_ticks > key.start_ticks or not procs.is_ancestor(root_key.pid, key.pid)
