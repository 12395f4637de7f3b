"""``leakcheck run`` on unmodified GPU programs: workers touching CUDA, orphans holding memory.

Each program runs under ``python -m leakcheck run`` as a user would start it (its own
interpreter: CUDA is never initialised in the pytest process). The command, its report and
the checks are the CPU tests' (tests/test_run.py); here the workers and helpers hold real
CUDA contexts, so the report's MiB and the teardown's releases are the driver's.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.scenario import key_of, processes, reported_gpu_bytes
from tests.test_run import findings, leakcheck_files, leakcheck_run, leftovers, private_tmp

pytestmark = pytest.mark.gpu

__all__ = ["leftovers", "private_tmp"]  # fixtures, used by name

MIB = 2**20

TRAINING = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Augmented(Dataset):
        # Each worker computes on the GPU: a CUDA context of its own in every worker.
        def __len__(self):
            return 64
        def __getitem__(self, index):
            z = torch.full((256, 256), float(index), device="cuda")
            return (z @ z).sum().cpu().reshape(1).expand(32).clone(), torch.zeros(1)

    if __name__ == "__main__":
        model = torch.nn.Linear(32, 1).cuda()
        optimiser = torch.optim.SGD(model.parameters(), lr=1e-6)
        train = DataLoader(Augmented(), batch_size=8, num_workers=2,
                           multiprocessing_context="spawn")
        val = DataLoader(Augmented(), batch_size=16, num_workers=1,
                         multiprocessing_context="spawn")
        for epoch in range(3):
            for x, y in train:
                loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
                optimiser.zero_grad(); loss.backward(); optimiser.step()
            with torch.no_grad():
                for x, y in val:
                    model(x.cuda())
        torch.cuda.synchronize()
        print("done")
    """
)


@pytest.mark.parametrize("teardown", [False, True])
def test_an_unmodified_training_script_whose_workers_touch_cuda_is_clean_and_exact(
    tmp_path: Path, private_tmp: Path, leftovers: list[dict[str, Any]], teardown: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    options = ["--teardown"] if teardown else []
    run = leakcheck_run(
        *options, "--", sys.executable, str(script), private_tmp=private_tmp, leftovers=leftovers
    )
    print(run.stderr[-3000:])
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    labels = sorted(item["label"] for item in run.data["loaders"])
    # Outside the working directory (the checkout): the file with its folder.
    shown = f"{script.parent.name}/{script.name}"
    assert [label.rsplit(":", 1)[0] for label in labels] == [shown] * 2, labels
    assert run.data["leak_count"] == 0, run.stderr
    assert "leakcheck run: verdict clean" in run.stderr
    counts = []
    for item in run.data["loaders"]:
        report = item["report"]
        assert report["attribution"] == "ok"
        workers = processes(report, "worker")
        counts.append(len(workers))
        # Each worker reported what it held at exit: a CUDA context, never an unknown peak.
        held = reported_gpu_bytes(report)
        assert len(held) == len(workers)
        for proc in workers:
            assert proc["gpu_peak_source"] == "reported", proc
            assert proc["total_gpu_bytes_peak"] >= held[key_of(proc)] > 100 * MIB, proc
        assert all(t["released"] is teardown for t in report["teardowns"]), report["teardowns"]
    assert sorted(counts) == [3, 6]  # 3 epochs of 1 val and 2 train workers
    assert leakcheck_files(private_tmp) == [], "the run left files in TMPDIR"


def test_orphans_of_an_unmodified_script_are_named_with_their_gpu_memory(
    private_tmp: Path, leftovers: list[dict[str, Any]]
) -> None:
    run = leakcheck_run(
        "--",
        sys.executable,
        "examples/plain_grandchild_leak.py",
        private_tmp=private_tmp,
        leftovers=leftovers,
    )
    print(run.stderr[-3000:])
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    (item,) = run.data["loaders"]
    assert dict(findings(item["report"])) == {("orphan", "orphan"): 2}
    for report in (item["report"], run.data["tree"]["report"]):
        orphans = [f for f in report["findings"] if f["rule"] == "orphan"]
        assert len(orphans) == 2
        for finding in orphans:
            assert finding["gpu_bytes"] >= 256 * MIB, finding["message"]
            assert "MiB" in finding["message"]


def test_the_persistent_cache_leak_is_growth_under_run_and_its_fix_is_clean(
    private_tmp: Path, leftovers: list[dict[str, Any]]
) -> None:
    leak = leakcheck_run(
        "--",
        sys.executable,
        "examples/plain_persistent_cache_leak.py",
        private_tmp=private_tmp,
        leftovers=leftovers,
    )
    fixed = leakcheck_run(
        "--",
        sys.executable,
        "examples/plain_persistent_cache_fixed.py",
        private_tmp=private_tmp,
        leftovers=leftovers,
    )
    print(leak.stderr[-2000:], fixed.stderr[-2000:])
    assert leak.returncode == 0 and fixed.returncode == 0, (leak.stderr, fixed.stderr)
    assert leak.data is not None and fixed.data is not None
    (leaking,) = leak.data["loaders"]
    growth = [f for f in leaking["report"]["findings"] if f["rule"] == "growth"]
    assert growth and all(f["role"] == "worker" for f in growth), leak.stderr
    (clean,) = fixed.data["loaders"]
    assert dict(findings(clean["report"])) == {}, fixed.stderr
