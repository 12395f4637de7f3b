"""grandchild_leak.py without leakcheck: the program as a user wrote it, for ``leakcheck run``.

A worker starts a helper process and exits without reaping it: an orphan that outlives the
loader (and, on a GPU, keeps its CUDA context and 256 MiB). Nothing here knows about
leakcheck; ``leakcheck run`` finds both helpers and names them:

    leakcheck run -- python examples/plain_grandchild_leak.py

The helpers sleep for two minutes; the report's fix says how to stop them now. The fix:
plain_grandchild_fixed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HELPER = (
    "import sys, time, torch\n"
    "x = torch.empty(256 * 2**20, dtype=torch.uint8, device=sys.argv[1])\n"
    "open(sys.argv[2], 'w').close()\n"
    "time.sleep(120)  # a 'prefetch server' nobody stops\n"
)


class WithHelper(Dataset[int]):
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.helper: subprocess.Popen[bytes] | None = None

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if self.helper is None:
            ready = os.path.join(self.folder, f"ready-{os.getpid()}")
            self.helper = subprocess.Popen([sys.executable, "-c", HELPER, DEVICE, ready])
            while not os.path.exists(ready) and self.helper.poll() is None:
                time.sleep(0.05)
        return index

    def stop_helper(self) -> None:
        if self.helper is not None and self.helper.poll() is None:
            self.helper.terminate()
            self.helper.wait()


def make_loader(folder: str, **options: object) -> DataLoader[int]:
    return DataLoader(
        WithHelper(folder),
        batch_size=1,
        num_workers=2,
        multiprocessing_context="spawn" if DEVICE == "cuda" else "fork",
        **options,  # type: ignore[arg-type]
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        loader = make_loader(folder)
        for _batch in loader:
            pass
        print("done")


if __name__ == "__main__":
    main()
