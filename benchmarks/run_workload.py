"""A small training script as users write it (no leakcheck), for ``bench_run.py``.

A train loader (workers started each epoch) and a validation loader, a small MLP trained
on synthetic samples made in the workers. It prints one JSON line: the wall time of its
training loop (from before the first epoch to after the last), the batches it iterated, and
its PID. Run bare or under ``leakcheck run``; it cannot tell the difference.

Usage: python benchmarks/run_workload.py [EPOCHS] [WORKERS]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset


class Synthetic(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(index)
        features = torch.randn(256, generator=gen)
        return (features - features.mean()) / (features.std() + 1e-6), index % 10


def main() -> None:
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(Synthetic(16384), batch_size=32, shuffle=True, num_workers=workers)
    val = DataLoader(Synthetic(4096), batch_size=64, num_workers=1)
    batches = 0
    started = time.perf_counter()
    for _epoch in range(epochs):
        model.train()
        for features, labels in train:
            loss = functional.cross_entropy(model(features), labels)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            optimizer.step()
            batches += 1
        model.eval()
        with torch.no_grad():
            for features, _labels in val:
                model(features)
                batches += 1
    loop_s = time.perf_counter() - started
    print(json.dumps({"loop_s": loop_s, "batches": batches, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
