"""Cost of one sample of a job with 64 child processes, side by side with the alternatives.

Measured in one run, same job, interleaved rounds:
- ``Tracker.sample()``: leakcheck's per-tick path with a walk (lineage from /proc, a quick walk
  as the sampler's: NOTE [quick walk] in leakcheck/observe/procs.py, + NVML per-PID memory);
- ``tracker_sample_full``: the same sample with every process read in full, as at an epoch end
  (without the epoch end's descriptor counts and telemetry);
- ``take_snapshot(with_fds=False)``: the full snapshot (all of /proc, trees, tags);
- ``nvidia-smi --query-compute-apps``: the usual shell-out (GPU machine only);
- ``torch.cuda.list_gpu_processes()``: torch's helper (GPU machine only; it initialises CUDA
  in the caller, so it runs last, in a child process).

Usage: python benchmarks/bench_snapshot.py [--children 64] [--gpu-children 4] [--rounds 200]
       [--write]  (writes benchmarks/results/snapshot-<machine>.md, a section per N,
       see results_io.py)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stats
from results_io import gpu_meta, host_meta, result_stem, write_result

from leakcheck.observe import nvml
from leakcheck.observe.snapshot import take_snapshot
from leakcheck.track.tracker import Tracker


def _idle(stop: Any) -> None:
    stop.wait(600)


def _gpu_holder(ready: Any, stop: Any) -> None:
    import torch

    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # noqa: F841
    torch.cuda.synchronize()
    ready.set()
    stop.wait(600)


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "mean_ms": statistics.fmean(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "min_ms": ordered[0],
        "n": len(ordered),
    }


def _torch_list_ms(rounds: int) -> list[float]:
    code = (
        "import json,time,torch\n"
        "torch.cuda.list_gpu_processes()\n"
        "s=[]\n"
        f"for _ in range({rounds}):\n"
        "    t=time.perf_counter(); torch.cuda.list_gpu_processes()\n"
        "    s.append((time.perf_counter()-t)*1000)\n"
        "print(json.dumps(s))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [float(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=64)
    parser.add_argument("--gpu-children", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    gpu_ok, gpu_reason = nvml.availability()
    ctx = mp.get_context("spawn") if gpu_ok else mp.get_context("fork")
    stop = ctx.Event()
    kids = [ctx.Process(target=_idle, args=(stop,)) for _ in range(args.children)]
    readies = []
    if gpu_ok:
        for _ in range(args.gpu_children):
            ready = ctx.Event()
            readies.append(ready)
            kids.append(ctx.Process(target=_gpu_holder, args=(ready, stop)))
    for kid in kids:
        kid.start()
    for ready in readies:
        ready.wait(120)
    time.sleep(0.5)

    results: dict[str, Any] = {}
    tracker = Tracker(interval=3600.0).start()  # sampler idle: we drive samples by hand
    try:
        samples: dict[str, list[float]] = {
            "tracker_sample": [],
            "tracker_sample_full": [],
            "take_snapshot": [],
        }

        def full_sample() -> None:
            with tracker.lock:
                tracker._sample(epoch_end=False)

        smi = shutil.which("nvidia-smi") if gpu_ok else None
        if smi:
            samples["nvidia_smi"] = []
        per_round = max(1, args.rounds // 20)
        for _ in range(20):  # interleave, so drift hits every method alike
            samples["tracker_sample"] += stats.time_ms(tracker.sample, per_round)
            samples["tracker_sample_full"] += stats.time_ms(full_sample, per_round)
            samples["take_snapshot"] += stats.time_ms(
                lambda: take_snapshot(root_pid=os.getpid(), with_fds=False), per_round
            )
            if smi:
                samples["nvidia_smi"] += stats.time_ms(
                    lambda: subprocess.run(
                        [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                        capture_output=True,
                        check=True,
                    ),
                    max(1, per_round // 4),
                )
        if gpu_ok:
            samples["torch_list_gpu_processes"] = _torch_list_ms(max(20, args.rounds // 4))
        results = {name: _summary(values) for name, values in samples.items()}
    finally:
        tracker.close()
        stop.set()
        for kid in kids:
            kid.join(30)

    base = results["tracker_sample"]["median_ms"]
    ratios = {name: r["median_ms"] / base for name, r in results.items()}
    meta: dict[str, Any] = {
        **host_meta(),
        "children": args.children,
        "gpu_children": args.gpu_children if gpu_ok else 0,
        "gpu": gpu_reason or "available",
    }
    if gpu_ok:
        meta.update(gpu_meta())
        try:
            import torch

            meta["torch"] = torch.__version__
        except ImportError:
            pass
    payload = {"meta": meta, "results": results, "ratio_to_tracker_sample": ratios}
    lines = [
        f"# Snapshot cost, {meta['children']} children (+{meta['gpu_children']} on the GPU)",
        "",
        f"{meta['date']} on {meta['host']}, {meta.get('gpu')}, driver {meta.get('driver', '-')}, "
        f"torch {meta.get('torch', '-')}, python {meta['python']}",
        "",
        "| method | median ms | mean ms | p90 ms | x tracker sample (medians) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['p90_ms']:.3f} | "
            f"{ratios[name]:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_result(result_stem("snapshot", f"{args.children}children"), payload, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
