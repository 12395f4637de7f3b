"""Teardown policy on a real GPU (NOTE [teardown policy] in leakcheck/worker/teardown.py).

Each scenario is a script file run by its own interpreter, as in test_dataloader_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MIB = 2**20
REPO = str(Path(__file__).resolve().parents[2])

SIDE_STREAM_DATASET = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import leakcheck
    from leakcheck.worker import teardown
    MIB = 2**20

    class SideStreams(Dataset):
        # Each worker runs work on a side stream it registers with the policy, plus an event
        # and a callable that drops the worker's cache.
        def __init__(self):
            self.cache = None
        def __len__(self):
            return 4
        def __getitem__(self, index):
            if self.cache is None:
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    x = torch.randn(2048, 2048, device="cuda")
                    self.cache = [x @ x for _ in range(8)]
                done = torch.cuda.Event()
                done.record(stream)
                teardown.register_resource(stream)
                teardown.register_resource(done)
                teardown.register_resource(self.cache.clear)
            return index
    """
)


def run_script(
    tmp_path: Path, body: str, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"scenario_{abs(hash(body))}.py"
    script.write_text(textwrap.dedent(body))
    return run_file(script, timeout_s)


def run_file(script: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=REPO,
    )


def result_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result; stdout: {done.stdout[-2000:]} stderr: {done.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


TEARDOWN_SCENARIO = SIDE_STREAM_DATASET + textwrap.dedent(
    """
    if __name__ == "__main__":
        loader = DataLoader(SideStreams(), batch_size=1, num_workers=2,
                            multiprocessing_context="spawn")
        watched = leakcheck.watch(loader, teardown=TEARDOWN, on_leak="ignore", grace=1.0)
        for epoch in range(2):
            list(watched)
        watched.close()
        report = watched.report()
        print("RESULT " + json.dumps({"report": report.to_dict(),
                                      "text": report.format(verbose=True),
                                      "workers": [k.pid for k in watched.tracker.worker_keys()]}))
    """
)


def _released_by_every_worker(
    result: dict[str, Any], *, gpu_bytes_above: int
) -> list[dict[str, Any]]:
    """Check that each of the 2 workers x 2 epochs tore down: CUDA was up, the context was
    released, and the PID left NVML before the worker exited. Returns the records."""
    records: list[dict[str, Any]] = result["report"]["teardowns"]
    assert sorted(r["key"]["pid"] for r in records) == sorted(result["workers"])
    assert len(records) == 4  # 2 workers x 2 epochs
    for record in records:
        assert record["error"] is None
        assert record["cuda_initialized"] is True
        assert record["context_released"] is True
        assert record["gpu_bytes_before"] and record["gpu_bytes_before"] > gpu_bytes_above
        assert record["left_nvml"] is True
    return records


def test_teardown_on_every_worker_leaves_nvml_before_it_exits(tmp_path: Path) -> None:
    result = result_of(run_script(tmp_path, TEARDOWN_SCENARIO.replace("TEARDOWN", "True")))
    for record in _released_by_every_worker(result, gpu_bytes_above=100 * MIB):
        assert record["streams_joined"] == 1
        assert record["resources_released"] == 3
        assert record["freed_cache_bytes"] >= 8 * 16 * MIB
    assert "context released" in result["text"]


def test_teardown_off_the_report_shows_no_release(tmp_path: Path) -> None:
    result = result_of(run_script(tmp_path, TEARDOWN_SCENARIO.replace("TEARDOWN", "False")))
    assert len(result["workers"]) == 4
    # Without the policy each worker still reports what it held (NOTE [worker reports]),
    # and releases nothing.
    records = result["report"]["teardowns"]
    assert sorted(r["key"]["pid"] for r in records) == sorted(result["workers"])
    for record in records:
        assert record["released"] is False and record["context_released"] is False
        assert record["cuda_initialized"] is True
        assert record["gpu_bytes_before"] and record["gpu_bytes_before"] > 100 * MIB
    assert "context released" not in result["text"]
    assert [f for f in result["report"]["findings"] if f["severity"] == "leak"] == []


EXIT_SCENARIO = SIDE_STREAM_DATASET + textwrap.dedent(
    """
    if __name__ == "__main__":
        # The parent keeps streams, events and persistent CUDA workers alive at exit.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y = torch.randn(4096, 4096, device="cuda")
            z = y @ y
        event = torch.cuda.Event(enable_timing=True)
        event.record(side)
        teardown.register_resource(side)
        teardown.register_resource(event)
        teardown.register_resource(lambda: z.add_(1))
        loader = DataLoader(SideStreams(), batch_size=1, num_workers=2, persistent_workers=True,
                            multiprocessing_context="spawn",
                            worker_init_fn=leakcheck.worker_init_fn())
        assert len(list(loader)) == 4
        batches = iter(loader)
        print("ok")
    """
)


def test_parent_exits_cleanly_with_streams_alive_over_20_runs(tmp_path: Path) -> None:
    # Ten at a time: each run is a process of its own, and the machine has the cores.
    # The script is written once: a run must never read a file another run's thread is
    # rewriting (one did, and ran an empty file).
    script = tmp_path / "exit_scenario.py"
    script.write_text(textwrap.dedent(EXIT_SCENARIO))
    with ThreadPoolExecutor(max_workers=10) as pool:
        runs = list(pool.map(lambda _: run_file(script), range(20)))
    assert [r.returncode for r in runs] == [0] * 20
    assert [r.stderr for r in runs] == [""] * 20
    assert [r.stdout for r in runs] == ["ok\n"] * 20


def test_release_device_refuses_with_live_tensors_then_frees(tmp_path: Path) -> None:
    result = result_of(
        run_script(
            tmp_path,
            """
            import json, os, threading, torch
            from leakcheck import LeakCheckError, release_device
            from leakcheck.observe import nvml
            x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            refusals = []
            try:
                release_device()
            except LeakCheckError as exc:
                refusals.append(str(exc))
            del x
            stop = threading.Event()
            busy = threading.Thread(target=stop.wait, name="busy-loader-thread")
            busy.start()
            try:
                release_device()
            except LeakCheckError as exc:
                refusals.append(str(exc))
            stop.set(); busy.join()
            result = release_device()
            listed = any(p.pid == os.getpid() for p in nvml.get().processes())
            print("RESULT " + json.dumps({"refusals": refusals, "listed": listed,
                                          **result.__dict__}))
            """,
        )
    )
    tensors, threads = result["refusals"]
    assert "256.0 MiB" in tensors and "force=True" in tensors and "\n" not in tensors
    assert "busy-loader-thread" in threads
    assert result["context_released"] is True
    assert result["freed_cache_bytes"] >= 256 * MIB
    assert result["gpu_bytes_before"] >= 256 * MIB
    assert result["gpu_bytes_after"] == 0
    assert result["listed"] is False


TWO_DEVICE_SCENARIO = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    import leakcheck
    from leakcheck.observe import nvml
    MIB = 2**20

    class TwoDevices(Dataset):
        # Each worker holds memory on cuda:0 and cuda:1 and leaves cuda:1 current, so the
        # teardown must release a context that is not the current one, then the current one.
        def __len__(self):
            return 4
        def __getitem__(self, index):
            if not hasattr(self, "held"):
                first = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0")
                torch.cuda.set_device(1)
                second = torch.empty(96 * MIB, dtype=torch.uint8, device="cuda:1")
                torch.cuda.synchronize(1)
                self.held = [first, second]
            return index

    if __name__ == "__main__":
        devices = nvml.get().device_count()
        if devices < 2:
            print("RESULT " + json.dumps({"devices": devices}))
            sys.exit(0)
        loader = DataLoader(TwoDevices(), batch_size=1, num_workers=2,
                            multiprocessing_context="spawn")
        watched = leakcheck.watch(loader, on_leak="ignore", grace=1.0)
        for epoch in range(2):
            list(watched)
        watched.close()
        report = watched.report()
        workers = [k.pid for k in watched.tracker.worker_keys()]
        listed = sorted({p.pid for p in nvml.get().processes()} & set(workers))
        print("RESULT " + json.dumps({"devices": devices, "report": report.to_dict(),
                                      "workers": workers, "still_listed": listed}))
    """
)


def test_teardown_releases_every_device_a_worker_used(tmp_path: Path) -> None:
    result = result_of(run_script(tmp_path, TWO_DEVICE_SCENARIO))
    if result["devices"] < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {result['devices']}")
    # left_nvml: gone from every device, not only the current one.
    _released_by_every_worker(result, gpu_bytes_above=160 * MIB)
    assert result["still_listed"] == []
    assert [f for f in result["report"]["findings"] if f["severity"] == "leak"] == []


def test_release_device_after_model_inference_leaves_nvml_and_the_clock_falls(
    tmp_path: Path,
) -> None:
    """A torchvision model's inference (conv + matmul, cuBLAS workspaces), a finished
    pin-memory loader, everything deleted: release_device() releases, the PID leaves NVML.
    How long the SM clock takes to fall afterwards is recorded (printed), not asserted."""
    result = result_of(
        run_script(
            tmp_path,
            """
            import json, os, time, torch, torchvision
            from torch.utils.data import DataLoader, TensorDataset
            from leakcheck import release_device
            from leakcheck.observe import nvml
            model = torchvision.models.resnet18(weights=None).cuda().eval()
            data = TensorDataset(torch.randn(64, 3, 224, 224))
            # Persistent workers: the loader's pin-memory thread and queue feeders stay alive
            # after the epoch, idle.
            loader = DataLoader(data, batch_size=16, pin_memory=True, num_workers=2,
                                persistent_workers=True, multiprocessing_context="fork")
            with torch.no_grad():
                for (batch,) in loader:
                    out = model(batch.cuda(non_blocking=True))
                    (out @ out.T).sum().item()
            del model, out, batch
            torch.cuda.synchronize()
            import threading
            threads = [t.name for t in threading.enumerate()]
            result = release_device()
            handle = nvml.get()
            listed = any(p.pid == os.getpid() for p in handle.processes())
            (device,) = handle.devices([0])
            started, clocks = time.monotonic(), []
            while time.monotonic() - started < 30:
                (state,) = handle.devices([0])
                clocks.append((round(time.monotonic() - started, 2), state.sm_clock_mhz))
                if state.sm_clock_mhz is not None and state.sm_clock_max_mhz and (
                    state.sm_clock_mhz < 0.5 * state.sm_clock_max_mhz
                ):
                    break
                time.sleep(0.5)
            print("RESULT " + json.dumps({"listed": listed, "clocks": clocks,
                                          "threads": threads, **result.__dict__}))
            """,
        )
    )
    print(f"SM clock after release_device(), (seconds, MHz): {result['clocks']}")
    assert any("_pin_memory_loop" in name for name in result["threads"]), result["threads"]
    assert result["context_released"] is True, result
    assert result["error"] is None
    assert result["gpu_bytes_after"] == 0
    assert result["listed"] is False
