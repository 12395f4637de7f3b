"""A small DDP-style training script for tests/test_distributed.py, run under torchrun.

No leakcheck in it: ``leakcheck run`` tracks it from outside. Every rank joins a gloo
process group, iterates a DataLoader with one forked worker for two epochs and all-reduces a
sum each epoch (the workers fork from a forkserver). ``--mode``:

* ``clean``: nothing leaks;
* ``grandchild``: on rank 1 the worker starts a helper process that sleeps and is never
  reaped: it outlives the worker, the rank and the job (an orphan of rank 1);
* ``kill``: rank 1 starts a helper that sleeps, then sends itself SIGKILL in the middle of
  its first epoch: no exit handler runs, torchrun fails the job, the helper is left.

``--gather``: the loader is wrapped with ``leakcheck.watch`` (the one place leakcheck appears),
closed after training, and ``leakcheck.gather_reports`` gathers every rank's report on rank
0 through torch.distributed; rank 0 writes the job's report to ``<folder>/job.json`` and
prints it.

Helpers write ``<folder>/helper-<rank>-<pid>`` when they started, and sleep at most
``HELPER_S`` seconds, so that nothing outlives a broken test for long.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

HELPER_S = 60
HELPER = "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(float(sys.argv[2]))"


def start_helper(folder: str, rank: int) -> subprocess.Popen[bytes]:
    """A process that outlives whoever started it (nobody waits for it)."""
    ready = os.path.join(folder, f"helper-{rank}-{os.getpid()}")
    helper = subprocess.Popen([sys.executable, "-c", HELPER, ready, str(HELPER_S)])
    deadline = time.monotonic() + 20
    while not os.path.exists(ready) and helper.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return helper


class Numbers(Dataset[torch.Tensor]):
    def __init__(self, mode: str, rank: int, folder: str) -> None:
        self.mode, self.rank, self.folder = mode, rank, folder
        self.started = False

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.mode == "grandchild" and self.rank == 1 and not self.started:
            self.started = True  # once per worker: the first epoch's worker
            start_helper(self.folder, self.rank)
        return torch.full((4,), float(index))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("clean", "grandchild", "kill"), default="clean")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--gather", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Workers fork from a forkserver that preloaded torch: cheap per epoch, and never forked
    # from the rank itself, whose gloo and tracker threads make fork hazardous on CPython
    # 3.11 (a child once hung in PyOS_AfterFork_Child here).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.utils.data"])
    loader: Any = DataLoader(
        Numbers(args.mode, rank, args.folder),
        batch_size=2,
        num_workers=1,
        multiprocessing_context=context,
    )
    if args.gather:
        import leakcheck

        loader = leakcheck.watch(loader, on_leak="ignore", grace=1.0)
    total = torch.zeros(4)
    for epoch in range(2):
        for step, batch in enumerate(loader):
            total += batch.sum(0)
            if args.mode == "kill" and rank == 1 and epoch == 0 and step == 1:
                start_helper(args.folder, rank)
                os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(total)
    if args.gather:
        import leakcheck

        loader.close()
        job = leakcheck.gather_reports(loader.report())
        if job is not None:
            with open(os.path.join(args.folder, "job.json"), "w") as handle:
                json.dump(job.to_dict(), handle)
            print(job.format(), flush=True)
    dist.destroy_process_group()
    # Stop the forkserver now, and wait for it: left to itself it exits only once it notices
    # that the rank is gone, a few seconds after the job, where leakcheck run (rightly) calls
    # it an orphan of the rank. multiprocessing has no public call for this.
    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private: not in typeshed
    print(f"rank {rank} done: {total.tolist()}", flush=True)


if __name__ == "__main__":
    main()
