"""Two torchrun ranks sharing GPU 0 (gloo), workers touching CUDA, under ``leakcheck run``.

Issue 16's one-GPU evidence: each rank trains on ``cuda:0`` and iterates a DataLoader whose
spawned workers each make a CUDA context; ``leakcheck run --nproc-per-node 2`` tracks both
ranks from inside (one tracker per loader, in each rank) and the agent's whole tree from
outside. Per rank, every worker's peak is what it reported of itself, every process is
labelled with its rank, and sharing the one GPU there is is not a device mismatch.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.scenario import key_of, processes, reported_gpu_bytes
from tests.test_distributed import leakcheck_run, leftovers, workdir

pytestmark = pytest.mark.gpu

__all__ = ["leftovers", "workdir"]  # fixtures, used by name

MIB = 2**20

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    class Augmented(Dataset):
        # Each worker computes on the GPU: a CUDA context of its own.
        def __len__(self):
            return 16
        def __getitem__(self, index):
            z = torch.full((256, 256), float(index), device="cuda:0")
            return (z @ z).sum().cpu().reshape(1).expand(32).clone()

    if __name__ == "__main__":
        dist.init_process_group("gloo")
        torch.cuda.set_device(0)  # one GPU: both ranks share it
        model = torch.nn.Linear(32, 1).cuda()
        loader = DataLoader(Augmented(), batch_size=4, num_workers=2,
                            multiprocessing_context="spawn")
        for epoch in range(2):
            for x in loader:
                model(x.cuda()).sum().backward()
            total = torch.ones(1)
            dist.all_reduce(total)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        print("done")
    """
)


def test_two_ranks_sharing_gpu_0_are_attributed_per_rank_exactly(
    workdir: Path, leftovers: list[tuple[int, int]]
) -> None:
    script = workdir / "train_ddp.py"
    script.write_text(SCRIPT)
    status, err, data = leakcheck_run(
        ["--nproc-per-node", "2", "--", str(script)], workdir, leftovers
    )
    print(err[-4000:])
    assert status == 0, err
    assert data["verdict"] == "clean" and data["leak_count"] == 0, err
    job = data["job"]
    assert (job["verdict"], job["world_size"]) == ("clean", 2)
    assert sorted(loader["rank"]["rank"] for loader in data["loaders"]) == [0, 1]
    for loader in data["loaders"]:
        rank = loader["rank"]["rank"]
        report: dict[str, Any] = loader["report"]
        assert report["attribution"] == "ok"
        assert [f for f in report["findings"] if f["severity"] == "leak"] == []
        held = reported_gpu_bytes(report)
        workers = processes(report, "worker")
        assert len(workers) == 4, workers  # 2 epochs x 2 workers
        for proc in workers:
            assert proc["rank"] == rank, proc
            assert proc["gpu_peak_source"] == "reported", proc
            assert proc["total_gpu_bytes_peak"] >= held[key_of(proc)] > 100 * MIB, proc
        parents = processes(report, "parent")
        assert parents and all(p["rank"] == rank for p in parents)
        assert all(p["gpu_bytes_end"].get("0", 0) > 100 * MIB for p in parents), parents
    # From outside, each rank's processes carry its rank and none is a device mismatch.
    tree = data["tree"]["report"]
    assert [f for f in tree["findings"] if f["rule"] == "device-mismatch"] == []
    ranked = {
        p["rank"]
        for rec in tree["epochs"]
        for p in rec["processes"]
        if p["rank"] is not None and p["total_gpu_bytes_peak"]
    }
    assert ranked == {0, 1}, tree["epochs"]
