"""A distributed job's verdict, one per rank and one for the job, from the ranks' reports.

A rank's leaks are those its own reports found and those of reports from outside the ranks
(``leakcheck run``'s) whose culprit carries its rank; each leaking process counts once. A
rank whose report never came still gets a verdict from outside, and says it is missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leakcheck.core.errors import UsageError
from leakcheck.core.model import Finding, RankInfo
from leakcheck.core.records import record_from_dict, to_jsonable
from leakcheck.core.units import plural
from leakcheck.judge.report import (
    FINDING_WIDTH,
    Report,
    cut,
    leaks_short,
    report_from_dict,
    verdict_of,
)

__all__ = [
    "JOB_SCHEMA_VERSION",
    "JobReport",
    "RankReport",
    "RankVerdict",
    "finding_identity",
    "judge_job",
]

JOB_SCHEMA_VERSION = 1
"""Version of ``JobReport.to_dict`` and ``RankReport.to_dict``."""

_NEVER_CAME = "no report of this rank came (it never iterated a tracked loader, or died)"
_LEAK_KEYS = ("rule", "pid", "start_ticks", "create_time", "role", "rank", "message")


def finding_identity(finding: Finding) -> tuple[object, ...]:
    """One leaking thing: a process (by identity), a /dev/shm file, else the finding itself."""
    if finding.shm_name is not None:  # a file, also where a process holds it
        return ("shm", finding.shm_name)
    if finding.pid is not None:  # by identity (NOTE [process identity] in procs.py)
        return ("pid", finding.pid, finding.start_ticks)
    return (finding.rule, finding.device_index, finding.message)


@dataclass(frozen=True)
class RankReport:
    """What a process of one rank reported (``missing``: why a report of it never came).

    A rank's file (``gather_reports``) holds one; ``leakcheck run`` makes one per loader.
    """

    info: RankInfo
    pid: int
    reports: tuple[Report, ...] = ()
    missing: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ranks send to rank 0, or write to their file)."""
        return {
            "schema": "leakcheck.rank",
            "schema_version": JOB_SCHEMA_VERSION,
            "rank": to_jsonable(self.info),
            "pid": self.pid,
            "reports": [report.to_dict() for report in self.reports],
            "missing": list(self.missing),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankReport:
        """Read ``to_dict``'s form back; ``UsageError`` where it is not a rank report."""
        if not isinstance(data, Mapping) or data.get("schema") != "leakcheck.rank":
            raise UsageError("rank report data: expected schema 'leakcheck.rank'")
        try:
            info: RankInfo = record_from_dict(RankInfo, data["rank"])
            if not isinstance(info.rank, int):
                raise TypeError(f"rank: expected an int, got {info.rank!r}")
            return cls(
                info=info,
                pid=int(data["pid"]),
                reports=tuple(report_from_dict(r) for r in data.get("reports") or ()),
                missing=tuple(str(m) for m in data.get("missing") or ()),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise UsageError(f"rank report data: malformed ({error})") from None


class _Judged:
    leaks: tuple[Finding, ...]
    blind: bool

    @property
    def verdict(self) -> str:
        """``leak``, ``blind`` or ``clean``."""
        return verdict_of(leaked=bool(self.leaks), blind=self.blind)


@dataclass(frozen=True)
class RankVerdict(_Judged):
    """One rank's verdict: its leaks, each process once; ``missing``: why a report never came."""

    rank: int
    pids: tuple[int, ...]
    restart_counts: tuple[int, ...]
    leaks: tuple[Finding, ...]
    missing: tuple[str, ...] = ()
    blind: bool = False

    @property
    def reported(self) -> bool:
        """Whether the rank's own report came."""
        return not self.missing

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (findings by identity: the full ones are in the reports)."""
        return {
            "rank": self.rank,
            "pids": list(self.pids),
            "restart_counts": list(self.restart_counts),
            "verdict": self.verdict,
            "reported": self.reported,
            "missing": list(self.missing),
            "leaks": [{key: getattr(f, key) for key in _LEAK_KEYS} for f in self.leaks],
        }

    def line(self, *, named: bool) -> str:
        """``rank 1 (PID 11): verdict LEAK; 1 leak: …`` (``named``: name its first leaks)."""
        pids = ", ".join(f"PID {pid}" for pid in self.pids) or "PID ?"
        restarts = ", ".join(str(c) for c in self.restart_counts if c)
        restart = f", restart {restarts}" if restarts else ""
        text = f"  rank {self.rank} ({pids}{restart}): verdict {self.verdict.upper()}"
        if self.missing:  # judged from outside only: what its own trackers saw never came
            text += " as seen from outside"
        if self.leaks:
            text += f"; {plural(len(self.leaks), 'leak')}"
            text += f": {leaks_short(self.leaks)}" if named else ""
        if self.missing:  # last: the loader's own line above says it whole
            text += f"; its own report is missing: {self.missing[0]}"
        return cut(text, FINDING_WIDTH)


@dataclass(frozen=True)
class JobReport(_Judged):
    """The job's verdict (every leak once, the ranks' and those no rank owns) and each rank's."""

    world_size: int | None
    ranks: tuple[RankVerdict, ...]
    leaks: tuple[Finding, ...]
    blind: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "schema": "leakcheck.judge.job",
            "schema_version": JOB_SCHEMA_VERSION,
            "world_size": self.world_size,
            "verdict": self.verdict,
            "leak_count": len(self.leaks),
            "ranks": [rank.to_dict() for rank in self.ranks],
        }

    def format_lines(self, *, named: bool = True) -> list[str]:
        """The job's verdict line, then one per rank (``named``: name its first leaks)."""
        seen = {rank.rank for rank in self.ranks}
        missing = [str(r) for r in range(self.world_size or 0) if r not in seen]
        absent = f"; no sign of rank {', '.join(missing)}" if missing else ""
        size = "?" if self.world_size is None else self.world_size
        head = (
            f"job (world size {size}, {plural(len(self.ranks), 'rank')} seen{absent}): "
            f"verdict {self.verdict.upper()}, {plural(len(self.leaks), 'leak')}"
        )
        return [head, *(rank.line(named=named) for rank in self.ranks)]

    def format(self) -> str:
        """The text of ``format_lines``."""
        return "\n".join(self.format_lines())


def _unique(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    first: dict[tuple[object, ...], Finding] = {}
    for finding in findings:
        first.setdefault(finding_identity(finding), finding)
    return tuple(first.values())


def judge_job(
    rank_reports: Sequence[RankReport],
    outside: Sequence[Report] = (),
    *,
    rank_roots: Mapping[int, Sequence[int]] | None = None,
) -> JobReport:
    """One verdict per rank and one for the job (see the module docstring).

    Args:
        rank_reports: What each rank's processes reported (several per rank).
        outside: Reports of trackers outside the ranks (``leakcheck run``'s tree).
        rank_roots: Rank -> PIDs the outside saw as its process, for ranks that sent nothing.

    """
    roots = rank_roots or {}
    outside_leaks = [f for report in outside for f in report.leaks]
    ranks = {e.info.rank for e in rank_reports} | set(roots)
    ranks |= {f.rank for f in outside_leaks if f.rank is not None}
    verdicts: list[RankVerdict] = []
    for rank in sorted(ranks):
        entries = [entry for entry in rank_reports if entry.info.rank == rank]
        reports = [report for entry in entries for report in entry.reports]
        own = [f for report in reports for f in report.leaks]
        verdicts.append(
            RankVerdict(
                rank=rank,
                pids=tuple(sorted({e.pid for e in entries} | set(roots.get(rank, ())))),
                restart_counts=tuple(
                    sorted({c for e in entries if (c := e.info.restart_count) is not None})
                ),
                leaks=_unique([*own, *(f for f in outside_leaks if f.rank == rank)]),
                missing=tuple(m for e in entries for m in e.missing) if entries else (_NEVER_CAME,),
                blind=any(r.verdict == "blind" for r in reports),
            )
        )
    every = [f for v in verdicts for f in v.leaks] + [f for f in outside_leaks if f.rank is None]
    sizes = [e.info.world_size for e in rank_reports if e.info.world_size is not None]
    return JobReport(
        world_size=max(sizes, default=None),
        ranks=tuple(verdicts),
        leaks=_unique(every),
        blind=any(v.blind for v in verdicts) or any(r.verdict == "blind" for r in outside),
    )
