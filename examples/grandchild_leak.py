"""A worker starts a helper process and exits without reaping it: an orphan that outlives
the loader (and, on a GPU, keeps its CUDA context and 256 MiB).

leakcheck.watch finds it through the session tag every child inherits, even after it was
reparented to PID 1, and names it with its PID, command line and memory. The example then
kills the orphan it made, as the report's fix suggests. The fix: grandchild_fixed.py.

Run: python examples/grandchild_leak.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import psutil
import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.observe.procs import process_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HELPER = (
    "import sys, time, torch\n"
    "x = torch.empty(256 * 2**20, dtype=torch.uint8, device=sys.argv[1])\n"
    "open(sys.argv[2], 'w').close()\n"
    "time.sleep(600)  # a 'prefetch server' nobody stops\n"
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


def make_loader(folder: str, **options: object) -> DataLoader[int]:
    return DataLoader(
        WithHelper(folder),
        batch_size=1,
        num_workers=2,
        multiprocessing_context="spawn" if DEVICE == "cuda" else "fork",
        **options,  # type: ignore[arg-type]
    )


def kill_orphans(report: leakcheck.Report) -> None:
    """Stop the processes this example leaked, checked by (pid, start_ticks)."""
    for finding in report.leaks:
        if finding.rule not in ("orphan", "survivor") or finding.pid is None:
            continue
        try:
            proc = psutil.Process(finding.pid)
            if finding.start_ticks is None or process_key(finding.pid) == (
                finding.pid,
                finding.start_ticks,
            ):
                proc.kill()
        except psutil.Error:
            pass


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        watched = leakcheck.watch(make_loader(folder), on_leak="ignore", grace=1.0)
        for _batch in watched:
            pass
        watched.close()
        report = watched.report()
        print(report.format())
        kill_orphans(report)


if __name__ == "__main__":
    main()
