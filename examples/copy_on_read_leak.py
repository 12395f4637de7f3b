"""Copy-on-read: a dataset of Python objects becomes each forked worker's private memory.

The dataset holds its samples as Python lists of Python ints (about 300 MiB). Forked workers
share the parent's pages until they write to them, and *reading* a Python object writes to
it: every access changes its reference count. So each page of objects a worker touches is
copied into that worker (pytorch/pytorch#13246), and with persistent workers drawing random
samples, each worker's private memory (USS) grows epoch after epoch toward a full copy of
the dataset per worker, while its RSS, which counts the shared pages too, stays flat. This
script prints the parent's and each worker's USS, PSS and RSS as the tracker read them at
every epoch end, then the report: a host-growth leak per worker, in MiB per epoch. The
parent's USS climbs too, without a finding: its pages become its own again as the workers
stop sharing them, and its RSS shows no new memory. The fix: copy_on_read_fixed.py.

Run: python examples/copy_on_read_leak.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import leakcheck

ITEMS = 8000
INTS_PER_ITEM = 1000  # 8M ints of 28 bytes + 8 bytes per list slot: about 300 MiB
SAMPLES_PER_EPOCH = ITEMS // 4  # each of 2 workers draws an eighth of the items per epoch
EPOCHS = 8
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
