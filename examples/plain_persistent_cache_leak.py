"""persistent_cache_leak.py without leakcheck, for ``leakcheck run``.

Each persistent worker keeps every sample it prepares on the GPU in a list that is never
trimmed: 64 MiB more per worker per epoch. On a GPU ``leakcheck run`` names both workers
with their MiB/epoch; on a CPU-only machine the cache is host memory, and it names both
workers' host-memory growth:

    leakcheck run -- python examples/plain_persistent_cache_leak.py

The fix: plain_persistent_cache_fixed.py.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

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
    for epoch in range(5):
        for _batch in loader:
            pass
        print(f"epoch {epoch} done")


if __name__ == "__main__":
    main()
