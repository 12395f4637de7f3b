"""A CUDA training loop whose worker is killed, or blocks, for tests/gpu/test_deaths_gpu.py.

``python deaths_job.py kill|hang|oom OUT.json``: the model trains on the GPU, two spawned
workers compute on it; ``kill`` SIGKILLs a worker mid-epoch, ``hang`` has one block in
``__getitem__`` until the loop has waited ``hang_after`` (20 s) and the stacks are out, ``oom``
has one grow its host memory until the kernel's OOM killer ends it (the job first joins the
memory cgroup named by ``LEAKCHECK_TEST_CGROUP``, whose limit the test set). Writes the
report's findings and what the loop saw as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck


class OnTheGpu(Dataset[float]):
    """Computes on the GPU; returns Python floats (batches are lists, ``collate_fn=list``): a
    tensor in flight would reach the parent through a descriptor a killed worker can no longer
    send, and the DataLoader would fail on that instead."""

    def __init__(self, release: str, grow: bool = False) -> None:
        self.release = release
        self.grow = grow

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> float:
        if index == 0 and self.release:  # what handles the stack signal here, for the test
            handler = signal.getsignal(signal.SIGUSR2)
            with open(self.release + f".handler-{os.getpid()}", "w") as note:
                note.write(repr(handler))
        z = torch.full((256, 256), float(index), device="cuda")
        held: list[bytes] = []
        while index == 8 and self.grow:  # until the cgroup's OOM killer ends this worker
            held.append(b"\x01" * (256 * 2**20))
        while index == 16 and self.release and not os.path.exists(self.release):
            time.sleep(0.01)  # the hang: blocked inside the worker
        time.sleep(0.02)
        return float((z @ z).sum().item())


def main(mode: str, out: str) -> None:
    release = out + ".release" if mode == "hang" else out + ".never"
    if mode == "oom":  # the job's processes, workers too, live under the test's memory limit
        with open(os.path.join(os.environ["LEAKCHECK_TEST_CGROUP"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    loader = leakcheck.watch(
        DataLoader(
            OnTheGpu(release if mode == "hang" else "", grow=mode == "oom"),
            batch_size=4,
            num_workers=2,
            multiprocessing_context="spawn",
            collate_fn=list,
        ),
        hang_after=20.0,  # spawned workers import torch and make a context: above that
        on_leak="ignore",
    )

    def release_when_the_worker_is_shown() -> None:
        # The loop waits in next() for item 16; released once a stall shows the worker in it.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            hangs = [f for f in loader.report().findings if f.rule == "hang"]
            if any("__getitem__" in (f.stack or "").split("the loop's process")[0] for f in hangs):
                break
            time.sleep(0.5)
        open(release, "w").close()

    if mode == "hang":
        threading.Thread(target=release_when_the_worker_is_shown, daemon=True).start()
    model = torch.nn.Linear(1, 1).cuda()
    error = ""
    try:
        for count, batch in enumerate(loader):
            model(torch.tensor(batch).reshape(-1, 1).cuda()).sum().backward()
            if mode == "kill" and count == 3:
                os.kill(loader.tracker.worker_keys()[0].pid, signal.SIGKILL)
    except Exception as exc:  # the DataLoader's own error about the killed worker
        error = f"{type(exc).__name__}: {exc}"
    loader.close()
    report = loader.report()
    found = [
        {"rule": f.rule, "pid": f.pid, "message": f.message, "stack": f.stack}
        for f in report.findings
    ]
    workers = [key.pid for key in loader.tracker.worker_keys()]
    notes = [n for n in os.listdir(os.path.dirname(out)) if ".handler-" in n]
    handlers = [Path(os.path.dirname(out), n).read_text() for n in notes]
    with open(out, "w") as handle:
        json.dump(
            {"findings": found, "error": error, "workers": workers, "handlers": handlers}, handle
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
