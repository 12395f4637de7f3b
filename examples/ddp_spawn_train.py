"""DDP started with ``torch.multiprocessing.spawn``, as PyTorch's ImageNet example does it.

No leakcheck in it: run it under ``leakcheck run`` and each rank's DataLoader is tracked,
its report labelled with the rank and the line that made the loader:

    leakcheck run -- python examples/ddp_spawn_train.py
    leakcheck run -- python examples/ddp_spawn_train.py --leak

Each rank joins a gloo process group (NCCL where every rank has a GPU), reads its share of
the data through a ``DistributedSampler`` with two workers, and trains a linear layer for two
epochs. With ``--leak``, each worker starts a helper (``sleep``) and exits without stopping
it: the helpers outlive their workers, their ranks and the job, and the report names each
one with its rank. They sleep for ``--helper-s`` seconds (two minutes by default).
"""

from __future__ import annotations

import argparse
import os
import subprocess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random (x, y) pairs; with ``helper_s``, each worker starts a helper it never stops."""

    def __init__(self, helper_s: float | None) -> None:
        self.helper_s = helper_s
        self.helper: subprocess.Popen[bytes] | None = None

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.helper_s is not None and self.helper is None:
            self.helper = subprocess.Popen(["sleep", str(self.helper_s)])
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=generator), torch.randn(1, generator=generator)


def train(gpu: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank: ``gpu`` is its index among the spawned processes (mp.spawn's first argument)."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        world_size=world_size,
        rank=gpu,
    )
    device = torch.device("cuda", gpu) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = DistributedDataParallel(
        torch.nn.Linear(8, 1).to(device), device_ids=[gpu] if cuda else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = Pairs(args.helper_s if args.leak else None)
    sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]] = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        print(f"rank {gpu} epoch {epoch} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    parser.add_argument("--leak", action="store_true", help="each worker leaves a helper")
    parser.add_argument("--helper-s", type=float, default=120.0)
    args = parser.parse_args()
    if args.port == 0:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.port = probe.getsockname()[1]
    mp.spawn(train, nprocs=args.world_size, args=(args.world_size, args))  # type: ignore[attr-defined,no-untyped-call]
    print("done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
