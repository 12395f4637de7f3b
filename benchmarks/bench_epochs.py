"""What an epoch end of ``watch(loader)`` costs as a run grows: judged window vs whole run.

``watch()`` judges the timeline at every epoch end so that it can warn at once. Judging the
whole run costs time in proportion to the epochs so far; leakcheck judges the latest
``JUDGED_EPOCHS`` epochs at an epoch end and the whole run at ``close()`` (NOTE [judged
window] in leakcheck/adapters/dataloader.py). This runs both in one process, one after the other:
a wrapper over a loader with persistent workers and a few batches per epoch (so the epoch
end weighs the most it can), and records the tracker's caller time
(``Tracker.cost().caller_wall_s``) spent in each epoch: the epoch end's sample, its
judgement, and the begin of the next. The arms do not overlap because the whole-run arm's
garbage (frozen records of every epoch, every epoch) would tax the other arm's epochs
through the garbage collector.

Reported: the median caller ms per epoch end over blocks of epochs (1-10, 91-100, ...),
for the window and for the whole run, and their ratio.

Usage: python benchmarks/bench_epochs.py [--epochs 400] [--workers 4] [--write]
       (--write: benchmarks/results/epochs-<machine>.md, see results_io.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from results_io import host_meta, result_stem, write_result
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.adapters import dataloader as watching
from leakcheck.adapters.dataloader import WatchedLoader


class Tiny(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


def _loader(workers: int) -> DataLoader[torch.Tensor]:
    return DataLoader(
        Tiny(),
        batch_size=8,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
    )


def _epoch_ms(watched: WatchedLoader[torch.Tensor], window: int | None) -> float:
    """One epoch of ``watched`` with the judged window set to ``window`` (None: all)."""
    watching.JUDGED_EPOCHS = window if window is not None else 10**9
    before = watched.tracker.cost().caller_wall_s
    for _ in watched:
        pass
    return (watched.tracker.cost().caller_wall_s - before) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.epochs < 20:
        parser.error(f"--epochs: expected at least 20, got {args.epochs}")

    window = watching.JUDGED_EPOCHS
    arms: dict[str, list[float]] = {"window": [], "whole run": []}
    for arm, judged in (("window", window), ("whole run", None)):
        with leakcheck.watch(_loader(args.workers), on_leak="warn") as watched:
            arms[arm] = [_epoch_ms(watched, judged) for _ in range(args.epochs)]
    watching.JUDGED_EPOCHS = window

    edges = sorted({10, args.epochs // 4, args.epochs // 2, args.epochs})
    blocks: list[dict[str, Any]] = []
    for end in edges:
        start = max(0, end - 10)
        w = statistics.median(arms["window"][start:end])
        a = statistics.median(arms["whole run"][start:end])
        blocks.append(
            {"epochs": f"{start + 1}-{end}", "window_ms": w, "whole_run_ms": a, "ratio": a / w}
        )
    meta = {
        **host_meta(),
        "torch": torch.__version__,
        "leakcheck": leakcheck.__version__,
        "epochs": args.epochs,
        "workers": args.workers,
        "judged_epochs": window,
    }
    lines = [
        f"# Epoch-end cost of watch(loader) over {args.epochs} epochs, {args.workers} workers",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), torch {meta['torch']}, "
        f"python {meta['python']}; judged window {window} epochs; both arms in one process, one "
        "after the other; medians over each block of 10 epochs.",
        "",
        "| epochs | window ms | whole run ms | whole run / window |",
        "| --- | ---: | ---: | ---: |",
    ]
    for block in blocks:
        lines.append(
            f"| {block['epochs']} | {block['window_ms']:.2f} | {block['whole_run_ms']:.2f} | "
            f"{block['ratio']:.1f}x |"
        )
    text = "\n".join(lines)
    print(text)
    if args.write:
        stem = result_stem("epochs")
        path = write_result(stem, {"meta": meta, "blocks": blocks, "raw_ms": arms}, text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
