"""The persistent-worker cache of persistent_cache_leak.py, fixed.

Two changes: the cache is keyed by sample index, so it stops growing after the first epoch,
and it holds CPU tensors: workers never create a CUDA context, and the training loop moves
each batch to the GPU in the main process. The report is clean on a GPU and on a CPU.

Run: python examples/persistent_cache_fixed.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIB = 2**20


class CachingDataset(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index not in self.cache:  # bounded by the dataset, filled in the first epoch
            self.cache[index] = torch.full((MIB,), index % 256, dtype=torch.uint8)
        return self.cache[index]


def main() -> None:
    loader = DataLoader(
        CachingDataset(),
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        pin_memory=DEVICE == "cuda",
        multiprocessing_context="fork",  # workers no longer touch CUDA
    )
    with leakcheck.watch(loader) as watched:
        for epoch in range(5):
            for batch in watched:
                batch.to(DEVICE, non_blocking=True)
            print(f"epoch {epoch} done")
    print(watched.report().format())


if __name__ == "__main__":
    main()
