"""Distributed ranks: who a process is in a torchrun job, read from its environment.

torchrun starts each rank with ``RANK`` and its fellows in its initial environment, and every
process the rank starts inherits them: any process of a rank's lineage, orphans included,
says its rank in ``/proc/PID/environ``.

NOTE [exported rank]: a rank no launcher variable names (a ``torch.multiprocessing.spawn``
child, a Lightning ``ddp_spawn`` rank) is given ``LEAKCHECK_RANK`` (``RANK,LOCAL_RANK,
WORLD_SIZE``, empty where unknown) by ``leakcheck run`` in its own environment when it first
iterates a DataLoader: every process it execs after that has it in its initial environment,
so an orphan still says whose it was. Processes it forks keep the rank's initial environment:
a tracker gives them their parent's rank, and ``leakcheck run`` the rank's own record's.
``RANK`` wins where both are set.
"""

from __future__ import annotations

from collections.abc import Mapping

from leakcheck.core.model import RankInfo

__all__ = [
    "EXPORTED_RANK_ENV",
    "RANK_VARIABLES",
    "culprit_label",
    "exported_rank",
    "physical_device",
    "rank_from_environ",
    "rank_label",
]

EXPORTED_RANK_ENV = "LEAKCHECK_RANK"
"""A rank ``leakcheck run`` found itself (NOTE [exported rank])."""

RANK_VARIABLES: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    EXPORTED_RANK_ENV,
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
    """The NVML index of CUDA device ``index`` in a process with this environment.

    CUDA numbers the devices ``CUDA_VISIBLE_DEVICES`` lists (``2,3``: device 0 is GPU2),
    NVML all of them. UUIDs or MIG instances cannot be mapped without the driver: None.
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

    Returns:
        A ``RankInfo`` when ``RANK`` is a non-negative integer, else the rank
        ``LEAKCHECK_RANK`` names (NOTE [exported rank]); None: not a rank's process.

    """
    rank = _count(environ.get("RANK"))
    if rank is None:
        return _decode(environ.get(EXPORTED_RANK_ENV), environ)
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


def exported_rank(info: RankInfo) -> str:
    """``LEAKCHECK_RANK``'s value for ``info`` (NOTE [exported rank])."""
    fields = (info.rank, info.local_rank, info.world_size)
    return ",".join("" if value is None else str(value) for value in fields)


def _decode(text: str | None, environ: Mapping[str, str]) -> RankInfo | None:
    """``exported_rank``'s form read back; None where absent or malformed."""
    if text is None:
        return None
    parts = text.split(",")
    if len(parts) != 3:
        return None
    rank, local_rank, world_size = (_count(part) for part in parts)
    if rank is None:
        return None
    return RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=None if local_rank is None else physical_device(local_rank, environ),
    )


def rank_label(rank: int | None) -> str:
    """``rank 1 `` (with its space) where the rank is known, else empty."""
    return f"rank {rank} " if rank is not None else ""


def culprit_label(role: str, pid: int, rank: int | None = None) -> str:
    """How every report names a process: ``rank 1 worker PID 123`` (``worker PID 123``)."""
    return f"{rank_label(rank)}{role} PID {pid}"
