"""Six DataLoader workers each start a shell job and exit without waiting for it.

No leakcheck in it: ``leakcheck run -- python examples/shell_orphans.py`` names the six
``sleep 60`` orphans on one line, under one fix that kills them all.
"""

from __future__ import annotations

import subprocess

import torch
from torch.utils.data import DataLoader, TensorDataset


def start_a_job(worker_id: int) -> None:
    # A background job of a shell: the shell exits at once, so the sleep is reparented.
    subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 &"], check=True)


def main() -> None:
    data = TensorDataset(torch.arange(12))
    loader = DataLoader(data, batch_size=2, num_workers=6, worker_init_fn=start_a_job)
    for _batch in loader:
        pass
    print("done")


if __name__ == "__main__":
    main()
