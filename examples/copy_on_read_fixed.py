"""The dataset of copy_on_read_leak.py, fixed: the same annotations in numpy arrays.

A numpy array keeps its values in one flat buffer, not as Python objects: reading a sample
reads the buffer and writes no reference count into it (only the array object's own header
is written, one page). The paths go into one bytes buffer with an offsets array, the labels
and boxes into arrays of numbers. The forked workers keep sharing the parent's pages: each
copies a few MiB (the interpreter's own objects it touches), far below the copy-on-read
rule's tolerance, and the report is clean. The same holds for a torch tensor, Arrow, or a
memory-mapped file. The arrays are also smaller than the objects.

Run: python examples/copy_on_read_fixed.py [ROWS]
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.core.model import ProcessEpoch

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 600_000
EPOCHS = 4
MIB = 2**20


class Annotations(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        paths = [f"images/{i:07d}.jpg".encode() for i in range(ROWS)]
        self.path_bytes = np.frombuffer(b"".join(paths), dtype=np.uint8)
        self.path_offsets = np.cumsum([0] + [len(p) for p in paths], dtype=np.int64)
        self.labels = np.arange(ROWS, dtype=np.int64) % 1000
        self.boxes = np.zeros((ROWS, 4), dtype=np.float32)
        self.boxes[:, 0] = 0.1 * (np.arange(ROWS) % 7)
        self.boxes[:, 1:] = (0.2, 0.5, 0.25)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> torch.Tensor:
        start, end = self.path_offsets[index], self.path_offsets[index + 1]
        path = self.path_bytes[start:end].tobytes().decode()
        return torch.tensor([len(path), int(self.labels[index]), *self.boxes[index].tolist()])


def main() -> None:
    loader = DataLoader(
        Annotations(),
        batch_size=256,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    with leakcheck.watch(loader, on_leak="ignore", rollup_share=1.0) as watched:
        tracker = watched.tracker
        for epoch in range(EPOCHS):
            for _batch in watched:
                pass
            tracker.finish_reads()
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
