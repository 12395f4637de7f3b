"""Copy-on-read: a dataset of Python objects becomes each forked worker's private memory.

The dataset holds one Python dict per sample (600,000 of them, about 280 MiB in the parent).
Forked workers share the parent's pages until they write to them, and *reading* a Python
object writes to it: every access changes its reference count. So each page of objects a
worker touches is copied into that worker (pytorch/pytorch#13246): with shuffled samples,
each worker touches nearly every page in its first epoch and holds its own copy of the
dataset from then on, flat, while its RSS, which counts the shared pages too, looks the same
from the start. N workers hold N copies. This script prints, for every epoch end, each
worker's private memory (USS), what it still shares with the parent, and what it copied
since it started; then the report: a copy-on-read leak found in epoch 0, with what each
worker copied. The fix: copy_on_read_fixed.py.

Run: python examples/copy_on_read_leak.py [ROWS]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.core.model import ProcessEpoch

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 600_000
EPOCHS = 4
MIB = 2**20


class Annotations(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = [
            {
                "path": f"images/{i:07d}.jpg",
                "label": i % 1000,
                "box": [0.1 * (i % 7), 0.2, 0.5, 0.25],
            }
            for i in range(ROWS)
        ]

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> torch.Tensor:
        # Only reads; yet every object it visits has its reference count written.
        row = self.rows[index]
        return torch.tensor([len(row["path"]), row["label"], *row["box"]])


def main() -> None:
    loader = DataLoader(
        Annotations(),
        batch_size=256,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",  # the default on Linux, and what shares the pages
    )
    # USS at every epoch end, for the table below; the copy-on-read rule needs no more than
    # the first end, which it always reads.
    with leakcheck.watch(loader, on_leak="ignore", rollup_share=1.0) as watched:
        tracker = watched.tracker
        for epoch in range(EPOCHS):
            for _batch in watched:
                pass
            tracker.finish_reads()  # this epoch end's reads, made just now
            print(f"epoch {epoch}:")
            for proc in tracker.epochs()[-1].processes:
                if proc.role == "worker":
                    print(f"  worker {proc.key.pid}: {figures(proc)}")
        watched.drop_loader()
    print(watched.report().format())


def figures(proc: ProcessEpoch) -> str:
    return (
        f"private (USS) {mib(proc.host_bytes_end)}  shared with the parent "
        f"{mib(proc.shared_bytes_end)}  copied {mib(proc.copied_bytes_end)}  "
        f"RSS {mib(proc.rss_bytes_end)} MiB"
    )


def mib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / MIB:6.1f}"


if __name__ == "__main__":
    main()
