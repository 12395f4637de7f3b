"""A CUDA training loop whose worker is killed, or blocks, for tests/gpu/test_deaths_gpu.py.

``python deaths_job.py kill|hang OUT.json``: the model trains on the GPU, two spawned workers
compute on it; ``kill`` SIGKILLs a worker mid-epoch, ``hang`` has one block in ``__getitem__``
until the loop has waited ``hang_after`` (2 s) and the stacks are out. Writes the report's
findings and what the loop saw as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck


class OnTheGpu(Dataset[torch.Tensor]):
    def __init__(self, release: str) -> None:
        self.release = release

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        z = torch.full((256, 256), float(index), device="cuda")
        while index == 16 and self.release and not os.path.exists(self.release):
            time.sleep(0.01)  # the hang: blocked inside the worker
        time.sleep(0.02)
        return (z @ z).sum().cpu().reshape(1)


def main(mode: str, out: str) -> None:
    release = out + ".release" if mode == "hang" else ""
    loader = leakcheck.watch(
        DataLoader(OnTheGpu(release), batch_size=4, num_workers=2, multiprocessing_context="spawn"),
        hang_after=2.0,
        on_leak="ignore",
    )
    model = torch.nn.Linear(1, 1).cuda()
    error = ""
    try:
        for count, batch in enumerate(loader):
            model(batch.cuda()).sum().backward()
            if mode == "kill" and count == 3:
                os.kill(loader.tracker.worker_keys()[0].pid, signal.SIGKILL)
            if mode == "hang" and count == 2:  # batch 4 holds item 16: its worker blocks
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                    f.rule == "hang" for f in loader.report().findings
                ):
                    time.sleep(0.2)
                open(release, "w").close()
    except RuntimeError as exc:
        error = str(exc)
    loader.close()
    report = loader.report()
    found = [
        {"rule": f.rule, "pid": f.pid, "message": f.message, "stack": f.stack}
        for f in report.findings
    ]
    workers = [key.pid for key in loader.tracker.worker_keys()]
    with open(out, "w") as handle:
        json.dump({"findings": found, "error": error, "workers": workers}, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
