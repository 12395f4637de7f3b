"""A CUDA loop over a DataLoader with ``pin_memory=True``, for tests/gpu/test_pinned_gpu.py.

``python pinned_job.py keep|clean watch|plain OUT.json``: five epochs of 16 pinned batches
of 4 MiB each, copied to the GPU; ``keep`` keeps every pinned batch (the pinned memory grows
64 MiB an epoch), ``clean`` none. ``watch`` wraps the loader in ``leakcheck.watch()`` and
writes its report as JSON; ``plain`` is the unmodified program ``leakcheck run`` tracks.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck


class Blocks(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((1024, 1024), float(index))  # 4 MiB: a pinned block of its own


def main(mode: str, how: str, out: str) -> None:
    total = torch.zeros((), device="cuda")  # CUDA initialised in the loop's process
    loader = DataLoader(Blocks(), batch_size=1, num_workers=2, pin_memory=True)
    watched = leakcheck.watch(loader, on_leak="ignore") if how == "watch" else None
    kept: list[torch.Tensor] = []
    for _ in range(5):
        for batch in watched if watched is not None else loader:
            assert batch.is_pinned()
            total += batch.to("cuda", non_blocking=True).sum()
            if mode == "keep":
                kept.append(batch)  # a reference kept to a pinned batch across steps
    torch.cuda.synchronize()
    if watched is not None:
        watched.close()
        report = watched.report()
        data = report.to_dict()
        data["pid"] = os.getpid()
        data["text"] = report.format(verbose=True)
        with open(out, "w") as handle:
            json.dump(data, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
