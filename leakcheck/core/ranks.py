"""Distributed ranks: who a process is in a torchrun job, read from its environment.

torchrun starts each rank with ``RANK`` and its fellows in its initial environment, which every
process of its lineage inherits, orphans included (``/proc/PID/environ``).

NOTE [exported rank]: a rank no launcher variable names (a ``torch.multiprocessing.spawn``
child, a Lightning ``ddp_spawn`` rank) is given ``LEAKCHECK_RANK`` (``RANK,LOCAL_RANK,
WORLD_SIZE``, empty where unknown) by ``leakcheck run`` in its own environment when it first
iterates a DataLoader (by ``LeakCheckCallback`` at setup), so every process it execs later says
whose it was. Processes it forks
keep the rank's initial environment: a tracker gives them their parent's rank, and
``leakcheck run`` the rank's own record's. ``RANK`` wins where both are set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import replace

from leakcheck.core.model import RankInfo

EXPORTED_RANK_ENV = "LEAKCHECK_RANK"  # NOTE [exported rank]

RANK_VARIABLES: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    EXPORTED_RANK_ENV,
)
"""What ``rank_from_environ`` reads (what a reader of /proc/PID/environ needs)."""


def _count(text: str | None) -> int | None:
    """A non-negative integer, or None where absent or malformed (never raises)."""
    text = (text or "").strip()
    # Bounded: int() refuses more than 4,300 digits, and no rank or count has 19.
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def physical_device(index: int, environ: Mapping[str, str]) -> int | None:
    """The NVML index of CUDA device ``index`` in a process with this environment.

    CUDA numbers the devices ``CUDA_VISIBLE_DEVICES`` lists (``2,3``: device 0 is GPU2),
    NVML all of them. UUIDs or MIG instances cannot be mapped without the driver: None.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    return _count(entries[index]) if index < len(entries) else None


def rank_from_environ(environ: Mapping[str, str]) -> RankInfo | None:
    """A process's place in a distributed job, by ``RANK``, else ``LEAKCHECK_RANK``; or None."""
    rank = _count(environ.get("RANK"))
    if rank is None and environ.get("NODE_RANK") == "0" and _count(environ.get("WORLD_SIZE")):
        rank = _count(environ.get("LOCAL_RANK"))  # Lightning's ddp launcher names no RANK
    if rank is not None:
        info = RankInfo(
            rank=rank,
            local_rank=_count(environ.get("LOCAL_RANK")),
            world_size=_count(environ.get("WORLD_SIZE")),
            node_rank=_count(environ.get("GROUP_RANK")),
            run_id=environ.get("TORCHELASTIC_RUN_ID") or None,
            restart_count=_count(environ.get("TORCHELASTIC_RESTART_COUNT")),
        )
    else:
        parts = environ.get(EXPORTED_RANK_ENV, "").split(",")
        counts = [_count(part) for part in parts]
        if len(parts) != 3 or counts[0] is None:
            return None
        info = RankInfo(rank=counts[0], local_rank=counts[1], world_size=counts[2])
    if info.local_rank is None:
        return info
    return replace(info, device=physical_device(info.local_rank, environ))


def export_rank(info: RankInfo, environ: MutableMapping[str, str] = os.environ) -> None:
    """Name ``info`` in ``LEAKCHECK_RANK`` unless ``environ`` says it (NOTE [exported rank])."""
    fields = (info.rank, info.local_rank, info.world_size)
    said = rank_from_environ(environ)
    if said is None or (said.rank, said.local_rank, said.world_size) != fields:
        environ[EXPORTED_RANK_ENV] = ",".join("" if n is None else str(n) for n in fields)


def rank_label(rank: int | None) -> str:
    """``rank 1 `` (with its space) where the rank is known, else empty."""
    return f"rank {rank} " if rank is not None else ""
