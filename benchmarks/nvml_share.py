"""The benchmarks' ``--nvml-share`` diagnostic: how much of the time the sampler's NVML reads
may work in the driver (NOTE [nvml pacing] in leakcheck/track/pacing.py), instead of leakcheck's
own share. Only this benchmark process's trackers are affected."""

from __future__ import annotations

import argparse

from leakcheck.track import pacing

SHIPPED = pacing.LIST_SHARE


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--nvml-share`` to a benchmark's options."""
    parser.add_argument(
        "--nvml-share",
        type=float,
        default=None,
        help="diagnostic: the share of the time the sampler's NVML reads may work in the driver",
    )


def apply(parser: argparse.ArgumentParser, args: argparse.Namespace) -> float:
    """Check and set the share asked for, if any; return the share the run uses."""
    if args.nvml_share is not None:
        if not 0 < args.nvml_share <= 1:
            parser.error(f"--nvml-share: expected a share in (0, 1], got {args.nvml_share}")
        # Memory reads keep their fraction of the share (NOTE [nvml pacing]).
        pacing.MEMORY_SHARE *= args.nvml_share / pacing.LIST_SHARE
        pacing.LIST_SHARE = args.nvml_share
    return float(pacing.LIST_SHARE)


def variant(share: float) -> str:
    """The part of a result's name that marks a diagnostic share (empty at leakcheck's own)."""
    return "" if share == SHIPPED else f"nvml-share-{share:g}"


def banner(share: float) -> list[str]:
    """Markdown lines that mark a result as a diagnostic run (none at leakcheck's share)."""
    if share == SHIPPED:
        return []
    return [
        "",
        f"**Diagnostic: the sampler's NVML reads may work in the driver {share:g} of the "
        f"time (`--nvml-share`), not leakcheck's {SHIPPED:g}.**",
    ]
