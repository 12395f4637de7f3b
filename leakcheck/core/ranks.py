"""Distributed ranks: who a process is in a torchrun job, read from its environment.

torchrun's elastic agent starts each rank with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``GROUP_RANK`` (the node), ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` in
its initial environment, and every process the rank starts inherits them (forked children
share the block, exec'd ones get a copy): so any process of a rank's lineage, orphans
included, says which rank it belongs to in ``/proc/PID/environ``. This module turns such an
environment into a ``RankInfo`` and names processes with their rank; it does no I/O and
imports only ``leakcheck.core.model``.
"""

from __future__ import annotations

from collections.abc import Mapping

from leakcheck.core.model import RankInfo

__all__ = [
    "RANK_VARIABLES",
    "culprit_label",
    "physical_device",
    "rank_from_environ",
    "rank_label",
]

RANK_VARIABLES: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
)
"""The variables ``rank_from_environ`` reads (what a reader of ``/proc/PID/environ`` needs)."""


def _count(text: str | None) -> int | None:
    """A non-negative integer, or None where absent or malformed (never raises)."""
    if text is None:
        return None
    text = text.strip()
    # Bounded: int() refuses more than 4,300 digits, and no rank or count has 19.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)


def physical_device(index: int, environ: Mapping[str, str]) -> int | None:
    """The NVML index of the process's CUDA device ``index``.

    CUDA numbers the devices ``CUDA_VISIBLE_DEVICES`` lists (``2,3``: device 0 is GPU2);
    NVML numbers them all. Without the variable the two agree. A list of UUIDs or MIG
    instances cannot be mapped without the driver: None (unknown, never a guess).

    Args:
        index: A CUDA device index in that process (``LOCAL_RANK``, ``current_device()``).
        environ: The process's environment.

    Returns:
        The NVML index, or None when it cannot be told.

    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(entries):
        return None
    return _count(entries[index])


def rank_from_environ(environ: Mapping[str, str]) -> RankInfo | None:
    """Read a process's place in a distributed job from its environment.

    Args:
        environ: The environment (``os.environ``, or a parsed ``/proc/PID/environ``).

    Returns:
        A ``RankInfo`` when ``RANK`` is a non-negative integer; None otherwise (not a rank
        of a torchrun job). Other variables that are absent or malformed are None; the
        device is ``LOCAL_RANK``'s, through ``CUDA_VISIBLE_DEVICES``.

    """
    rank = _count(environ.get("RANK"))
    if rank is None:
        return None
    local_rank = _count(environ.get("LOCAL_RANK"))
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    return RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=_count(environ.get("WORLD_SIZE")),
        node_rank=_count(environ.get("GROUP_RANK")),
        run_id=run_id if run_id else None,
        restart_count=_count(environ.get("TORCHELASTIC_RESTART_COUNT")),
        device=None if local_rank is None else physical_device(local_rank, environ),
    )


def rank_label(rank: int | None) -> str:
    """``rank 1 `` (with its space) where the rank is known, else empty."""
    return f"rank {rank} " if rank is not None else ""


def culprit_label(role: str, pid: int, rank: int | None = None) -> str:
    """How every report names a process: ``rank 1 worker PID 123`` (``worker PID 123``)."""
    return f"{rank_label(rank)}{role} PID {pid}"
