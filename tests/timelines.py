"""Builders of synthetic timelines for the rule and report tests.

Sizes are given in MiB (floats allowed) and stored as bytes; times in seconds on the
tracker's clock, epochs one ``duration_s`` long and back to back from 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from leakcheck.core.model import (
    MIB,
    Attribution,
    DeviceState,
    EndReason,
    EpochRecord,
    FinalState,
    ProcessEpoch,
    ProcessKey,
    Role,
    Timeline,
)

ROOT_PID = 100
BOOT_UNIX_S = 1_700_000_000.0
TOTAL_MIB = 81_559


def mib(value: float) -> int:
    return int(value * MIB)


def key(pid: int) -> ProcessKey:
    """A stable identity for a PID: started 1000 s after boot, one clock tick per PID."""
    return ProcessKey(pid, 100_000 + pid)


def _bytes_map(value: float | Mapping[int, float] | None) -> dict[int, int]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {d: mib(v) for d, v in value.items()}
    return {0: mib(value)}


def proc(
    pid: int,
    role: Role = "worker",
    *,
    gpu_mib: float | Mapping[int, float] | None = None,
    peak_mib: float | Mapping[int, float] | None = None,
    born: bool = False,
    persistent: bool = False,
    alive: bool = True,
    exited_after_s: float | None = None,
    last_seen_after_s: float | None = None,
    fds: int | None = None,
    unknown: bool = False,
    ppid: int | None = None,
    cmdline: str | None = None,
    uss_mib: float | None = None,
    rss_mib: float | None = None,
    anon_mib: float | None = None,
) -> ProcessEpoch:
    """One process in one epoch; ``gpu_mib`` is a number (GPU0) or ``{device: MiB}``.

    Host memory: ``uss_mib`` (read at the epoch end) and ``rss_mib``; ``host_bytes_end`` is
    the USS where given, else the RSS.
    """
    end = _bytes_map(gpu_mib)
    host = uss_mib if uss_mib is not None else rss_mib
    return ProcessEpoch(
        key=key(pid),
        role=role,
        ppid=ppid if ppid is not None else (1 if role in ("parent", "orphan") else ROOT_PID),
        cmdline=cmdline if cmdline is not None else f"python {role}_{pid}.py --flag",
        born_in_epoch=born,
        persistent=persistent,
        alive_at_end=alive,
        exited_after_s=exited_after_s,
        last_seen_after_s=last_seen_after_s,
        gpu_bytes_end=end,
        gpu_bytes_peak=_bytes_map(peak_mib) if peak_mib is not None else dict(end),
        gpu_bytes_unknown=unknown,
        nvidia_fds=fds,
        host_bytes_end=mib(host) if host is not None else None,
        host_source="uss" if uss_mib is not None else ("rss" if rss_mib is not None else None),
        rss_bytes_end=mib(rss_mib) if rss_mib is not None else None,
        anon_bytes_end=mib(anon_mib) if anon_mib is not None else None,
        rss_bytes_peak=mib(rss_mib) if rss_mib is not None else None,
    )


def copier(
    pid: int,
    copied_mib: float | None,
    *,
    forked: bool | None = True,
    persistent: bool = True,
    over_after_s: float | None = None,
    uss_mib: float | None = None,
    ppid: int | None = None,
    alive: bool = True,
) -> ProcessEpoch:
    """A loader's worker with its copy of the parent's memory (NOTE [copy on read]).

    Born with 9 MiB private and 200 MiB shared; ``copied_mib`` moved from shared to private
    (None: no copy known); ``uss_mib`` defaults to what that makes.
    """
    copied = mib(copied_mib) if copied_mib is not None else None
    if uss_mib is None:
        uss_mib = 9 + (copied_mib or 0)
    base = proc(pid, persistent=persistent, uss_mib=uss_mib, ppid=ppid, alive=alive)
    return replace(
        base,
        forked=forked,
        private_bytes_birth=mib(9),
        shared_bytes_birth=mib(200) if forked else 0,
        shared_bytes_end=mib(200 - (copied_mib or 0)) if forked else 0,
        copied_bytes_end=copied,
        copied_bytes_peak=copied,
        copied_over_after_s=over_after_s,
    )


def parent(
    gpu_mib: float | Mapping[int, float] | None = 600,
    *,
    fds: int | None = None,
    uss_mib: float | None = None,
    rss_mib: float | None = None,
) -> ProcessEpoch:
    """The watched root: persistent, there before the epochs."""
    return proc(
        ROOT_PID,
        "parent",
        gpu_mib=gpu_mib,
        persistent=True,
        fds=fds,
        cmdline="python train.py --epochs 5",
        uss_mib=uss_mib,
        rss_mib=rss_mib,
    )


def device(
    index: int = 0,
    used_mib: float = 0,
    *,
    total_mib: float = TOTAL_MIB,
    temp_c: int | None = None,
    sm_mhz: int | None = None,
    sm_max_mhz: int | None = None,
    power_w: float | None = None,
) -> DeviceState:
    return DeviceState(
        index=index,
        name="NVIDIA H200",
        uuid=f"GPU-0000-{index}",
        used_bytes=mib(used_mib),
        total_bytes=mib(total_mib),
        temperature_c=temp_c,
        sm_clock_mhz=sm_mhz,
        sm_clock_max_mhz=sm_max_mhz,
        power_w=power_w,
    )


def epoch(
    index: int,
    processes: Iterable[ProcessEpoch],
    devices: Iterable[DeviceState] = (),
    *,
    duration_s: float = 1.0,
    label: str | None = None,
    end_reason: EndReason = "completed",
) -> EpochRecord:
    devices = tuple(devices)
    return EpochRecord(
        index=index,
        label=label if label is not None else f"epoch {index}",
        start_s=index * duration_s,
        end_s=(index + 1) * duration_s,
        end_reason=end_reason,
        processes=tuple(processes),
        devices=devices,
        device_peak_used_bytes={d.index: d.used_bytes for d in devices},
        samples=20,
    )


def final_state(
    processes: Iterable[ProcessEpoch],
    devices: Iterable[DeviceState] = (),
    *,
    after_last_epoch: Sequence[EpochRecord] = (),
    wait_s: float = 2.5,
    parent_allocated_gpu_bytes: int | None = None,
    open_epoch: int | None = None,
) -> FinalState:
    """The state ``wait_s`` after the last of ``after_last_epoch`` ended (or at ``wait_s``).

    ``open_epoch``: the epoch open when it was read (a report in its middle).
    """
    end_s = max((rec.end_s for rec in after_last_epoch), default=0.0)
    return FinalState(
        time_s=end_s + wait_s,
        devices=tuple(devices),
        processes=tuple(processes),
        parent_allocated_gpu_bytes=parent_allocated_gpu_bytes,
        closed=open_epoch is None,
        open_epoch=open_epoch,
    )


def timeline(
    epochs: Iterable[EpochRecord],
    *,
    final: FinalState | None = None,
    attribution: Attribution = "ok",
    reason: str = "",
    baseline: Iterable[DeviceState] | None = None,
    baseline_gpu_mib: Mapping[int, float] | None = None,
    failures: Sequence[str] = (),
) -> Timeline:
    """A timeline; the baseline defaults to an empty GPU0."""
    return Timeline(
        session_id="test-session",
        root=key(ROOT_PID),
        started_unix_s=BOOT_UNIX_S + 1010,
        boot_unix_s=BOOT_UNIX_S,
        attribution=attribution,
        attribution_reason=reason,
        baseline_devices=tuple(baseline) if baseline is not None else (device(0, 0),),
        baseline_gpu_bytes={d: mib(v) for d, v in (baseline_gpu_mib or {}).items()},
        epochs=tuple(epochs),
        final=final,
        failures=tuple(failures),
    )


def series_timeline(
    series_mib: Sequence[float],
    *,
    role: Role = "parent",
    pid: int = ROOT_PID,
    attribution: Attribution = "ok",
) -> Timeline:
    """One persistent process whose GPU0 bytes at each epoch end follow ``series_mib``."""
    epochs = [
        epoch(
            i,
            [proc(pid, role, gpu_mib=value, persistent=True)],
            [device(0, value + 500)],
        )
        for i, value in enumerate(series_mib)
    ]
    return timeline(epochs, attribution=attribution)


def clean_timeline(n_epochs: int = 5, n_workers: int = 2) -> Timeline:
    """A healthy run: parent steady at 600 MiB, workers born each epoch and gone at once."""
    epochs = []
    pid = 1000
    for i in range(n_epochs):
        workers = []
        for _ in range(n_workers):
            pid += 1
            workers.append(proc(pid, gpu_mib=0, born=True, alive=True, exited_after_s=0.1, fds=0))
        epochs.append(epoch(i, [parent(600), *workers], [device(0, 650, sm_mhz=1980)]))
    final = final_state(
        [parent(600)],
        [device(0, 650, sm_mhz=345, sm_max_mhz=1980)],
        after_last_epoch=epochs,
        parent_allocated_gpu_bytes=mib(100),
    )
    return timeline(epochs, final=final, baseline=[device(0, 50)], baseline_gpu_mib={0: 0})
