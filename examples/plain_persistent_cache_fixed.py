"""plain_persistent_cache_leak.py fixed, still without leakcheck.

The cache is keyed by sample index, so it stops growing after the first epoch, and it holds
CPU tensors: workers never create a CUDA context, and the loop moves each batch to the GPU
in the main process. ``leakcheck run`` reports it clean on a GPU and on a CPU:

    leakcheck run -- python examples/plain_persistent_cache_fixed.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

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
    for epoch in range(5):
        for batch in loader:
            batch.to(DEVICE, non_blocking=True)
        print(f"epoch {epoch} done")


if __name__ == "__main__":
    main()
