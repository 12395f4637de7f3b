"""leakcheck.watch on a real GPU: clean loaders, persistent-worker growth, orphans.

Each scenario is a script file run by its own interpreter: CUDA is never initialised in the
pytest process, and spawn workers can import the script's datasets (a ``python -c`` main
module cannot be imported by spawn children).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.scenario import leaks, run_job

pytestmark = pytest.mark.gpu

MIB = 2**20

PRELUDE = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import leakcheck
    MIB = 2**20

    def emit(report, **extra):
        print("RESULT " + json.dumps({"report": report.to_dict(), **extra}))

    def loader(dataset, workers=2, persistent=False, batch_size=1):
        return DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                          persistent_workers=persistent, multiprocessing_context="spawn")
    """
)


def run_scenario(tmp_path: Path, body: str, timeout_s: float = 300) -> dict[str, Any]:
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return run_job(str(script), timeout_s)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_touching_cuda_in_a_clean_loader_have_no_findings(
    tmp_path: Path, persistent: bool
) -> None:
    result = run_scenario(
        tmp_path,
        f"""
        class TouchesCuda(Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, index):
                x = torch.full((256, 256), float(index), device="cuda")
                return (x @ x).sum().cpu()

        if __name__ == "__main__":
            with leakcheck.watch(loader(TouchesCuda(), persistent={persistent}),
                                 grace=1.0, on_leak="ignore") as watched:
                for epoch in range(5):
                    assert len(list(watched)) == 8
            emit(watched.report(), workers=len(watched.tracker.worker_keys()))
        """,
    )
    report = result["report"]
    assert report["attribution"] == "ok"
    assert len(report["epochs"]) == 5
    assert result["workers"] == (2 if persistent else 10)
    assert leaks(report) == []


def test_persistent_workers_caching_cuda_tensors_grow_64_mib_per_epoch(tmp_path: Path) -> None:
    result = run_scenario(
        tmp_path,
        """
        class Caches(Dataset):
            # 8 items, batch 1, 2 workers: 4 items of 16 MiB per worker per epoch.
            def __init__(self):
                self.cache = []
            def __len__(self):
                return 8
            def __getitem__(self, index):
                self.cache.append(torch.empty(16 * MIB, dtype=torch.uint8, device="cuda"))
                torch.cuda.synchronize()
                return index

        if __name__ == "__main__":
            watched = leakcheck.watch(loader(Caches(), persistent=True), on_leak="ignore",
                                      warmup_epochs=1, grace=1.0)
            for epoch in range(5):
                list(watched)
                time.sleep(0.2)
            watched.close()
            emit(watched.report(), workers=[k.pid for k in watched.tracker.worker_keys()])
        """,
    )
    growth = [f for f in leaks(result["report"]) if f["rule"] == "growth" and f["pid"]]
    assert sorted(f["pid"] for f in growth) == sorted(result["workers"])
    for finding in growth:
        assert finding["role"] == "worker"
        assert finding["bytes_per_epoch"] == pytest.approx(64 * MIB, rel=0.1)


def test_grandchild_holding_a_context_after_the_loader_is_gone_is_an_orphan(
    tmp_path: Path,
) -> None:
    result = run_scenario(
        tmp_path,
        """
        GRANDCHILD = (
            "import sys, time, torch;"
            "x = torch.empty(300 * 2**20, dtype=torch.uint8, device='cuda');"
            "torch.cuda.synchronize(); open(sys.argv[1], 'w').write('ready'); time.sleep(120)"
        )

        class StartsGrandchild(Dataset):
            def __init__(self, folder):
                self.folder = folder
            def __len__(self):
                return 1
            def __getitem__(self, index):
                ready = os.path.join(self.folder, "ready")
                child = subprocess.Popen([sys.executable, "-c", GRANDCHILD, ready])
                while not os.path.exists(ready):
                    time.sleep(0.05)
                return child.pid

        if __name__ == "__main__":
            folder = sys.argv[0].rsplit("/", 1)[0]
            watched = leakcheck.watch(loader(StartsGrandchild(folder), workers=1),
                                      on_leak="ignore", grace=0.5)
            (batch,) = list(watched)
            grandchild = int(batch[0])
            time.sleep(0.5)  # the loader is gone; the grandchild is not
            before_close = watched.report()  # the README's order: a report about now
            watched.close()
            report = watched.report()
            os.kill(grandchild, 9)
            emit(report, grandchild=grandchild, before_close=before_close.to_dict())
        """,
    )
    for report in (result["before_close"], result["report"]):
        orphans = [f for f in leaks(report) if f["rule"] == "orphan"]
        assert [f["pid"] for f in orphans] == [result["grandchild"]]
        assert orphans[0]["gpu_bytes"] >= 300 * MIB
        assert "holds GPU" in orphans[0]["message"]
    assert result["before_close"]["final"]["closed"] is False


@pytest.mark.parametrize("persistent", [False, True])
def test_a_watched_training_loop_has_no_false_finding_and_exact_worker_peaks(
    tmp_path: Path, persistent: bool
) -> None:
    """A real training loop: a torchvision model on the GPU, fork workers (which never touch
    CUDA), pin_memory=True. No leak; every worker's peak is what it reported at exit."""
    result = run_scenario(
        tmp_path,
        f"""
        import torchvision
        from torch.utils.data import TensorDataset

        if __name__ == "__main__":
            model = torchvision.models.resnet18(weights=None, num_classes=10).cuda()
            optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
            data = TensorDataset(torch.randn(96, 3, 64, 64), torch.randint(0, 10, (96,)))
            train = DataLoader(data, batch_size=16, num_workers=4, pin_memory=True,
                               persistent_workers={persistent}, multiprocessing_context="fork")
            with leakcheck.watch(train, grace=1.0, on_leak="ignore") as watched:
                for epoch in range(4):
                    for images, labels in watched:
                        loss = torch.nn.functional.cross_entropy(
                            model(images.cuda(non_blocking=True)), labels.cuda())
                        optimiser.zero_grad(); loss.backward(); optimiser.step()
                    torch.cuda.synchronize()
            emit(watched.report())
        """,
    )
    report = result["report"]
    assert report["attribution"] == "ok"
    assert leaks(report) == [], [f["message"] for f in leaks(report)]
    reported = {
        (t["key"]["pid"], t["key"]["start_ticks"]): t["gpu_bytes_by_device"]
        for t in report["teardowns"]
    }
    workers = [
        (epoch["index"], p)
        for epoch in report["epochs"]
        for p in epoch["processes"]
        if p["role"] == "worker"
    ]
    assert len(workers) == 16
    for _index, proc in workers:
        # Fork workers of a CUDA parent never use CUDA: each reported 0 on every device.
        assert proc["gpu_peak_source"] in ("reported", "sampled"), proc
        assert proc["total_gpu_bytes_peak"] == 0, proc
    # Workers per epoch report at exit; persistent ones outlive the tracker (the loader keeps
    # them) and are read in full at every epoch end instead.
    assert len(reported) == (0 if persistent else 16)
    assert all(held == {} for held in reported.values()), reported
