"""The dataset of copy_on_read_leak.py, fixed: the same numbers in one numpy array.

A numpy array keeps its numbers in one flat buffer, not as Python objects: reading a sample
reads the buffer and writes no reference count into it (only the array object's own header
is written, one page). The forked workers keep sharing the parent's pages, and each worker's
private memory (USS) stays flat from epoch to epoch. The same holds for a torch tensor, or
for Arrow or memory-mapped files; strings can go into one bytes buffer with an offsets array.
The array is also smaller than the objects (8 bytes per number instead of 36).

Run: python examples/copy_on_read_fixed.py
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import leakcheck
from leakcheck import hostmem
from leakcheck.dataloader import WatchedLoader
from leakcheck.hostmem import HostMemory
from leakcheck.model import ProcessKey

ITEMS = 4000
INTS_PER_ITEM = 1000  # 4M int64: about 31 MiB
SAMPLES_PER_EPOCH = ITEMS // 4
EPOCHS = 6
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
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    with leakcheck.watch(loader) as watched:
        for epoch in range(EPOCHS):
            for _batch in watched:
                pass
            print(f"epoch {epoch}:")
            for key, memory in sorted(worker_memories(watched).items()):
                uss = memory.uss_bytes or 0
                first.setdefault(key.pid, uss)
                grown = uss - last.get(key.pid, uss)
                last[key.pid] = uss
                print(
                    f"  worker {key.pid}: USS {uss / MIB:6.1f} MiB ({grown / MIB:+4.1f} this epoch)"
                    f"  PSS {(memory.pss_bytes or 0) / MIB:6.1f}"
                    f"  RSS {(memory.rss_bytes or 0) / MIB:6.1f}  [{memory.source}]"
                )
    for pid, uss in last.items():
        grown = (uss - first[pid]) / MIB
        print(f"worker {pid}: USS {grown:+.1f} MiB over epochs 1-{EPOCHS - 1}")
    print(watched.report().format())


def worker_memories(watched: WatchedLoader[torch.Tensor]) -> dict[ProcessKey, HostMemory]:
    """Host memory of the loader's live workers, read now (by identity: PIDs get reused)."""
    workers = [
        process.key
        for process in watched.report().epochs[-1].processes
        if process.role == "worker" and process.alive_at_end
    ]
    return hostmem.read_host_memories(workers)


if __name__ == "__main__":
    main()
