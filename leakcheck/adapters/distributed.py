"""Gather the reports of a distributed job's ranks on rank 0: torch.distributed, or files.

NOTE [rank gathering]: a collective completes only when every rank calls it, and a dead rank
never will (the others would block until the group's timeout: 30 minutes for gloo, for ever
with NCCL). So leakcheck never gathers on its own, least of all at exit: each rank writes its
file (``LEAKCHECK_RANK_DIR``, or ``leakcheck run``'s folder, which merges them). Where the
program calls ``gather_reports``, every rank first counts itself in through the group's store
and waits at most ``timeout_s``: a missing rank makes every rank fall back to its file,
written first. leakcheck's own failures are warned about, never raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from leakcheck.core.errors import UsageError, one_line
from leakcheck.core.files import write_json
from leakcheck.core.model import RankInfo
from leakcheck.core.ranks import rank_from_environ
from leakcheck.judge.job import JobReport, RankReport, judge_job
from leakcheck.judge.report import Report

__all__ = ["RANK_DIR_ENV", "gather_reports", "job_from_folder", "read_rank_reports"]

RANK_DIR_ENV = "LEAKCHECK_RANK_DIR"
"""The folder where each rank writes its report."""

_RUN_ENV = "LEAKCHECK_RUN"  # instrument.RUN_ENV: the run folder under ``leakcheck run``
_PREFIX = "rank-"


def _process_group() -> Any | None:
    """``torch.distributed`` where the program imported it and a group is initialised."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist and dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def read_rank_reports(folder: str) -> tuple[list[RankReport], list[str]]:
    """Every rank report in ``folder`` by rank then PID, and a line per file not read."""
    entries: list[RankReport] = []
    failures: list[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError as error:
        return [], [f"rank reports: cannot list {folder!r}: {error.strerror or error}"]
    for name in names:
        if not (name.startswith(_PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                entries.append(RankReport.from_dict(json.load(handle)))
        except (OSError, ValueError, UsageError, RecursionError) as error:
            failures.append(f"rank report {name}: cannot be read: {error}")
    entries.sort(key=lambda e: (e.info.rank, e.pid))
    return entries, failures


def job_from_folder(folder: str) -> JobReport:
    """The job's verdicts from the rank reports in ``folder`` (the file path's merge)."""
    return judge_job(read_rank_reports(folder)[0])


def gather_reports(
    reports: Report | Iterable[Report],
    *,
    dst: int = 0,
    folder: str | None = None,
    timeout_s: float = 60.0,
) -> JobReport | None:
    """Gather every rank's reports on rank ``dst`` (see NOTE [rank gathering]).

    Call it on every rank after training, before ``destroy_process_group``.

    Args:
        reports: ``loader.report()`` of each of this rank's closed loaders.
        dst: The rank that receives the job's report.
        folder: Where each rank also writes its own file (default: ``$LEAKCHECK_RANK_DIR``,
            else ``leakcheck run``'s run folder; none: no file).
        timeout_s: How long every rank waits for a missing one before it falls back.

    Returns:
        On ``dst``: the ``JobReport`` of every rank (of this rank alone where no process
        group is initialised, or the gather failed); None on the other ranks.

    """
    dist = _process_group()
    info = rank_from_environ(os.environ)
    if info is None and dist is not None:
        info = RankInfo(rank=int(dist.get_rank()), world_size=int(dist.get_world_size()))
    items = (reports,) if isinstance(reports, Report) else tuple(reports)
    entry = RankReport(info=info or RankInfo(rank=0, world_size=1), pid=os.getpid(), reports=items)
    rank = entry.info.rank
    target = folder or os.environ.get(RANK_DIR_ENV) or os.environ.get(_RUN_ENV)
    if target:  # a folder not there is said, as a write that failed is
        try:  # atomically: a merging side never reads half a file
            write_json(os.path.join(target, f"{_PREFIX}{rank}-{entry.pid}.json"), entry.to_dict())
        except OSError as error:
            warnings.warn(f"leakcheck: rank {rank}: report not written: {error}", stacklevel=2)
            target = None
    alone = judge_job([entry]) if rank == dst else None
    if dist is None:
        return alone
    try:
        gathered = _gather(dist, entry, dst, timeout_s)
    except Exception as error:  # a peer died or the group broke: never into the job
        where = f"; each rank's report is in {target}" if target else ""
        warnings.warn(
            f"leakcheck: rank {rank}: reports not gathered through "
            f"torch.distributed ({one_line(error)}){where}",
            stacklevel=2,
        )
        return alone
    if gathered is None:
        return None
    try:
        return judge_job([RankReport.from_dict(d) for d in gathered if isinstance(d, Mapping)])
    except Exception as error:  # a peer's report that cannot be read: never into the job
        warnings.warn(
            f"leakcheck: rank {rank}: gathered reports not judged "
            f"({one_line(error)}); this rank's alone",
            stacklevel=2,
        )
        return alone


_gathers = 0  # gathers this process began: every rank calls them in the same order


def _gather(dist: Any, entry: RankReport, dst: int, timeout_s: float) -> list[Any] | None:
    """Every rank's report on ``dst`` once all came (NOTE [rank gathering]); else TimeoutError."""
    global _gathers
    _gathers += 1
    store = dist.distributed_c10d._get_default_store()
    key = f"leakcheck/gather/{_gathers}"
    world = dist.get_world_size()
    arrived = int(store.add(key, 1))
    deadline = time.monotonic() + timeout_s
    while arrived < world:
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{arrived} of {world} ranks reached gather_reports in {timeout_s:g} s"
            )
        time.sleep(0.05)
        arrived = int(store.add(key, 0))
    gathered: list[Any] | None = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(entry.to_dict(), gathered, dst=dst)
    return gathered
