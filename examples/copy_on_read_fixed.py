"""The dataset of copy_on_read_leak.py, fixed: the same numbers in one numpy array.

A numpy array keeps its numbers in one flat buffer, not as Python objects: reading a sample
reads the buffer and writes no reference count into it (only the array object's own header
is written, one page). The forked workers keep sharing the parent's pages, and each worker's
private memory (USS) stays flat from epoch to epoch: the report finds no host growth. The
same holds for a torch tensor, or for Arrow or memory-mapped files; strings can go into one
bytes buffer with an offsets array. The array is also smaller than the objects (8 bytes per
number instead of 36).

Run: python examples/copy_on_read_fixed.py
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import leakcheck

ITEMS = 8000
INTS_PER_ITEM = 1000  # 8M int64: about 61 MiB
SAMPLES_PER_EPOCH = ITEMS // 4
EPOCHS = 8
MIB = 2**20


class FlatArray(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.items = np.arange(ITEMS * INTS_PER_ITEM, dtype=np.int64).reshape(ITEMS, INTS_PER_ITEM)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(float(self.items[index].sum()))


def main() -> None:
    dataset = FlatArray()
    loader = DataLoader(
        dataset,
        batch_size=50,
        sampler=RandomSampler(dataset, num_samples=SAMPLES_PER_EPOCH),
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    # USS at every epoch end: this demo's epochs last a fraction of a second, where the
    # default pacing (a 0.1% share of the time) would read it only every few seconds.
    with leakcheck.watch(loader, on_leak="ignore", rollup_share=1.0) as watched:
        tracker = watched.tracker
        for epoch in range(EPOCHS):
            for _batch in watched:
                pass
            tracker.finish_reads()  # the USS reads of this epoch's end, made just now
            print(f"epoch {epoch}:")
            for proc in tracker.epochs()[-1].processes:
                if proc.role in ("parent", "worker"):
                    print(
                        f"  {proc.role:6} {proc.key.pid}: {(proc.host_source or '?').upper()} "
                        f"{mib(proc.host_bytes_end)}  PSS {mib(proc.pss_bytes_end)}  "
                        f"RSS {mib(proc.rss_bytes_end)} MiB"
                    )
        watched.drop_loader()
    print(watched.report().format())


def mib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / MIB:6.1f}"


if __name__ == "__main__":
    main()
