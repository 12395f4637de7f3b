"""A persistent-worker cache leak, and what leakcheck.watch reports about it.

Each persistent worker keeps every sample it prepares on the GPU "for reuse" in a list that
is never trimmed: 4 samples of 16 MiB per worker per epoch, so each worker grows by 64 MiB
per epoch for as long as the loader lives. On a GPU the report names both workers with
their MiB/epoch; on a CPU-only machine the cache is host memory, GPU memory is not checked,
and the report names both workers' host-memory growth instead. The fix:
persistent_cache_fixed.py.

Run: python examples/persistent_cache_leak.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIB = 2**20


class CachingDataset(Dataset[int]):
    def __init__(self) -> None:
        self.cache: list[torch.Tensor] = []

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        sample = torch.full((16 * MIB,), index % 256, dtype=torch.uint8, device=DEVICE)
        self.cache.append(sample)  # the leak: appended every epoch, never trimmed
        return index


def main() -> None:
    loader = DataLoader(
        CachingDataset(),
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        # Workers that use CUDA must be spawned; fork is faster where there is no GPU.
        multiprocessing_context="spawn" if DEVICE == "cuda" else "fork",
    )
    with leakcheck.watch(loader, on_leak="ignore") as watched:
        for epoch in range(5):
            for _batch in watched:
                pass
            print(f"epoch {epoch} done")
    print(watched.report().format())


if __name__ == "__main__":
    main()
