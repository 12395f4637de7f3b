"""Copy-on-read: a dataset of Python objects becomes each forked worker's private memory.

The dataset holds its samples as Python lists of Python ints (about 150 MiB). Forked workers
share the parent's pages until they write to them, and *reading* a Python object writes to
it: every access changes its reference count. So each page of objects a worker touches is
copied into that worker (pytorch/pytorch#13246), and with persistent workers drawing random
samples, each worker's private memory (USS) grows epoch after epoch toward a full copy of
the dataset per worker, while its RSS, which counts the shared pages too, stays flat. This
script prints each worker's USS, PSS and RSS after every epoch (leakcheck.hostmem), then
leakcheck.watch's report, which does not judge host memory yet: the lines above it are the
evidence. The fix: copy_on_read_fixed.py.

Run: python examples/copy_on_read_leak.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import leakcheck
from leakcheck import hostmem
from leakcheck.dataloader import WatchedLoader
from leakcheck.hostmem import HostMemory
from leakcheck.model import ProcessKey

ITEMS = 4000
INTS_PER_ITEM = 1000  # 4M ints of 28 bytes + 8 bytes per list slot: about 150 MiB
SAMPLES_PER_EPOCH = ITEMS // 4  # each of 2 workers touches 1/8 of the items per epoch
EPOCHS = 6
MIB = 2**20


class PythonObjects(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.items = [list(range(i * INTS_PER_ITEM, (i + 1) * INTS_PER_ITEM)) for i in range(ITEMS)]

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        # sum() only reads, but each int it visits has its reference count written.
        return torch.tensor(float(sum(self.items[index])))


def main() -> None:
    dataset = PythonObjects()
    loader = DataLoader(
        dataset,
        batch_size=50,
        sampler=RandomSampler(dataset, num_samples=SAMPLES_PER_EPOCH),
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",  # the default on Linux, and what shares the pages
    )
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    with leakcheck.watch(loader, on_leak="ignore") as watched:
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
