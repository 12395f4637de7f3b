"""Host memory and /dev/shm on a GPU host: copy-on-read, clean loaders, CUDA IPC files.

The same evidence as the CPU tests, on the GPU machine: the copy-on-read scenario is found
per worker in MiB/epoch and clean sweeps have no host finding (with GPU columns beside the
host ones), and a loader whose workers return CUDA tensors leaves ``cuda.shm.*`` files that
the report names with their cause. Every sweep and scenario runs in its own interpreter, so
CUDA is never initialised in the pytest process. Each test prints what it saw (``-s``) for
the GPU test log.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.scenario import run_job
from tests.gpu.test_sweep_gpu import findings, sweep

pytestmark = pytest.mark.gpu

MIB = 2**20


def test_copy_on_read_is_found_per_worker_and_the_parent_is_not(tmp_path: Path) -> None:
    status, text, data = sweep(
        tmp_path, "cor", "--scenario", "copy-on-read", "--workers", "0,4", "--epochs", "5"
    )
    assert status == 0, text
    no_workers, four = data["configurations"]
    assert findings(no_workers, "host-growth") == []
    growth = findings(four, "host-growth")
    assert sorted(f["role"] for f in growth) == ["worker"] * 4, text
    for finding in growth:
        assert 20 * MIB < finding["bytes_per_epoch"] < 60 * MIB, finding["message"]
        assert "copy-on-read" in finding["remedy"]
    for config in data["configurations"]:
        for row in config["rows"]:
            assert row["host_source"] == "uss", row
            assert row["parent_host_bytes"] > 0
            assert row["device_used_bytes"] is not None  # GPU columns beside the host ones
    print("host-growth:", [f["message"] for f in growth])


@pytest.mark.parametrize("extra", [(), ("--persistent",), ("--start-method", "fork")])
def test_clean_sweeps_have_no_host_finding(tmp_path: Path, extra: tuple[str, ...]) -> None:
    status, text, data = sweep(
        tmp_path, "clean", "--workers", "0,4", "--epochs", "10", "--fail-on-leak", *extra
    )
    assert status == 0, text
    for config in data["configurations"]:
        assert findings(config, "host-growth") == [], text
        assert [f for f in findings(config, "shm") if f["severity"] == "leak"] == [], text
        hosts = [row["parent_host_bytes"] for row in config["rows"]]
        print(config["num_workers"], "parent host MiB per epoch:", [h // MIB for h in hosts])


CUDA_IPC = textwrap.dedent(
    """
    import json, os
    import torch
    from torch.utils.data import DataLoader, Dataset
    import leakcheck

    class CudaTensors(Dataset):
        # Returns CUDA tensors from the workers: they travel by CUDA IPC, whose reference
        # counts live in /dev/shm/cuda.shm.* files.
        def __len__(self):
            return 8
        def __getitem__(self, index):
            return torch.full((1024,), float(index), device="cuda")

    if __name__ == "__main__":
        before = set(os.listdir("/dev/shm"))
        loader = DataLoader(CudaTensors(), batch_size=None, num_workers=2,
                            multiprocessing_context="spawn")
        total = 0.0
        with leakcheck.watch(loader, on_leak="ignore") as watched:
            for _ in range(2):
                for batch in watched:
                    total += float(batch.sum())
                    del batch
        report = watched.report()
        left = sorted(set(os.listdir("/dev/shm")) - before)
        print("RESULT " + json.dumps({"report": report.to_dict(), "left": left}))
        # This job's files, removed now that they have been reported.
        for name in left:
            if name.startswith("cuda.shm."):
                os.unlink(os.path.join("/dev/shm", name))
    """
)


@pytest.mark.xfail(
    reason=(
        "GPU run 39 (2026-12-01): workers that returned CUDA tensors and exited normally left no "
        "cuda.shm.* file, so the premise did not hold; the files are left when a producer dies "
        "without its cleanup (to be staged with a SIGKILLed worker): docs/gpu-test-log.md"
    ),
    strict=False,
)
def test_workers_returning_cuda_tensors_leave_cuda_shm_files_named_with_their_cause(
    tmp_path: Path,
) -> None:
    script = tmp_path / "cuda_ipc.py"
    script.write_text(CUDA_IPC)
    result: dict[str, Any] = run_job(str(script), 300)
    left = [name for name in result["left"] if name.startswith("cuda.shm.")]
    print("cuda.shm files left:", left)
    shm = [f for f in result["report"]["findings"] if f["rule"] == "shm"]
    for finding in shm:
        print(finding["severity"], finding["message"])
    assert left, "no cuda.shm.* file was left: nothing to name (record it in the test log)"
    named = {f["shm_name"]: f for f in shm if (f["shm_name"] or "").startswith("cuda.shm.")}
    assert set(left) <= set(named), (left, list(named))
    for name in left:
        assert "a CUDA IPC file: workers returned CUDA tensors" in named[name]["message"]
        assert "return CPU tensors from workers" in named[name]["remedy"]
    assert not [n for n in left if os.path.exists(f"/dev/shm/{n}")]  # the job removed them
