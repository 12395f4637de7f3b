"""The ``fd-pressure`` rule: a process of the job near its limit of open descriptors.

A DataLoader's default sharing strategy (file_descriptor) passes every shared tensor as a
descriptor; a process that holds many at once, or leaks them, meets its ``RLIMIT_NOFILE``:
"Too many open files", or "received 0 items of ancdata" in the process receiving a batch.
Counted at epoch ends only (``procs.descriptors``: one listing per process), so the
finding names the most a process held at one, against its own limit then.
"""

from __future__ import annotations

from leakcheck.core.model import Finding, ProcessEpoch, ProcessKey, RuleConfig, Timeline
from leakcheck.core.names import culprit

__all__ = ["fd_pressure"]


def _readings(timeline: Timeline) -> list[tuple[int | None, ProcessEpoch]]:
    """Every record of a process with its epoch (None: the final state)."""
    found: list[tuple[int | None, ProcessEpoch]] = [
        (epoch.index, proc) for epoch in timeline.epochs for proc in epoch.processes
    ]
    if timeline.final is not None:
        found += [(None, proc) for proc in timeline.final.processes]
    return found


def fd_pressure(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """One finding per process whose open descriptors reached the pressure share of its limit."""
    worst: dict[ProcessKey, tuple[float, int | None, ProcessEpoch]] = {}
    for index, proc in _readings(timeline):
        if proc.open_fds is None or not proc.fd_limit:
            continue
        share = proc.open_fds / proc.fd_limit
        if share >= config.fd_pressure_fraction and share > worst.get(proc.key, (0.0,))[0]:
            worst[proc.key] = (share, index, proc)
    findings: list[Finding] = []
    for share, index, proc in worst.values():
        who = culprit(proc.role, proc.key.pid, proc.cmdline, rank=proc.rank, rule="fd-pressure")
        when = f"at the end of epoch {index}" if index is not None else "after the work"
        findings.append(
            Finding(
                rule="fd-pressure",
                severity="info",
                message=(
                    f"{who} held {proc.open_fds} open descriptors of its limit {proc.fd_limit} "
                    f"({share:.0%}) {when}"
                ),
                remedy=(
                    "raise it (ulimit -n 65536), or "
                    "torch.multiprocessing.set_sharing_strategy('file_system')"
                ),
                pid=proc.key.pid,
                start_ticks=proc.key.start_ticks,
                role=proc.role,
                cmdline=proc.cmdline,
                epoch=index,
                rank=proc.rank,
            )
        )
    return tuple(findings)
