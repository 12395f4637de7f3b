"""The sweep's own cost: the same loaders iterated with and without leakcheck, in one run.

For each worker count, one round builds the built-in workload's DataLoader and iterates it
for E epochs twice: bare, and under a ``Tracker`` exactly as ``leakcheck sweep`` does (one
tracker per configuration, ``tracker.epoch`` around each epoch, workers registered at
``iter()``, sampling every 50 ms). Rounds alternate the order (bare first, then tracked
first) so that drift (clocks, temperature, page cache) falls on both alike. Reported: median
wall seconds of the epochs (what a training loop pays) and of the whole configuration
(loader, epochs, tracker start and close), the ratio tracked/bare, and the median cost of one
``Tracker.sample()`` while the workers run. Goal: under 2% on the epochs.

The loaders are identical in both arms: the teardown policy is off in both by default
(``--teardown`` turns it on in both), so only the measuring is compared.

Usage: python benchmarks/bench_sweep.py [--workers 0,4,8] [--epochs 3] [--repeats 5]
       [--batches 128] [--features 1024] [--start-method spawn] [--teardown] [--write]
       (--write: benchmarks/results/sweep-<date>.{json,md})
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_io import write_result

import leakcheck
from leakcheck import nvml
from leakcheck.sweep import _register_workers
from leakcheck.tracker import Tracker
from leakcheck.workload import WorkloadSpec, make_loader


def _iterate(loader: Any, tracker: Tracker | None, epoch: int) -> int:
    batches = 0
    if tracker is None:
        for _ in loader:
            batches += 1
        return batches
    with tracker.epoch(f"epoch {epoch}"):
        iterator = iter(loader)
        _register_workers(tracker, iterator)
        for _ in iterator:
            batches += 1
    return batches


def _run(spec: WorkloadSpec, workers: int, epochs: int, tracked: bool) -> dict[str, float]:
    """One configuration, bare or tracked: wall seconds of the epochs and of everything."""
    started = time.perf_counter()
    tracker = None
    if tracked:
        tracker = Tracker(interval=0.05, grace=2.0, use_nvml=spec.gpu).start()
    loader = make_loader(spec, workers)
    epochs_s = 0.0
    sample_ms: list[float] = []
    for epoch in range(epochs):
        epoch_start = time.perf_counter()
        _iterate(loader, tracker, epoch)
        epochs_s += time.perf_counter() - epoch_start
    if tracker is not None and spec.persistent_workers and workers:
        # Workers are alive between epochs: time the sampler's per-tick path on them.
        for _ in range(20):
            tick = time.perf_counter()
            tracker.sample()
            sample_ms.append((time.perf_counter() - tick) * 1000)
    del loader
    gc.collect()
    if tracker is not None:
        tracker.close()
        tracker.report()
    total_s = time.perf_counter() - started
    result = {"epochs_s": epochs_s, "total_s": total_s}
    if sample_ms:
        result["sample_ms"] = statistics.median(sample_ms)
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default=None, help="default 0,4,8 with a GPU, 0,2 without")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=128)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--start-method", default="spawn")
    parser.add_argument("--teardown", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    gpu, gpu_reason = nvml.availability()
    workers_text = args.workers or ("0,4,8" if gpu else "0,2")
    worker_counts = [int(part) for part in workers_text.split(",")]
    base = WorkloadSpec(
        batches=args.batches,
        features=args.features,
        start_method=args.start_method,
        teardown=args.teardown,
        gpu=gpu,
    )
    results: dict[str, Any] = {}
    for workers in worker_counts:
        # Persistent workers too, so the sampler's cost with live workers is measured.
        for persistent in (False, True) if workers else (False,):
            spec = WorkloadSpec(**{**base.__dict__, "persistent": persistent})
            name = f"{workers} workers" + (" persistent" if persistent else "")
            runs: dict[str, list[dict[str, float]]] = {"bare": [], "tracked": []}
            _run(spec, workers, 1, tracked=False)  # warm-up: imports, page cache, CUDA
            for repeat in range(args.repeats):
                order = ("bare", "tracked") if repeat % 2 == 0 else ("tracked", "bare")
                for arm in order:
                    runs[arm].append(_run(spec, workers, args.epochs, tracked=arm == "tracked"))
            entry: dict[str, Any] = {"raw": runs}
            for key in ("epochs_s", "total_s"):
                bare = _median([r[key] for r in runs["bare"]])
                tracked = _median([r[key] for r in runs["tracked"]])
                entry[key] = {"bare": bare, "tracked": tracked, "ratio": tracked / bare}
            samples = [r["sample_ms"] for r in runs["tracked"] if "sample_ms" in r]
            entry["sample_ms"] = _median(samples) if samples else None
            results[name] = entry
            print(
                f"{name}: epochs {entry['epochs_s']['bare']:.3f} s bare, "
                f"{entry['epochs_s']['tracked']:.3f} s tracked "
                f"({(entry['epochs_s']['ratio'] - 1) * 100:+.1f}%)",
                file=sys.stderr,
            )

    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "leakcheck": leakcheck.__version__,
        "torch": sys.modules["torch"].__version__ if "torch" in sys.modules else None,
        "gpu": gpu_reason or "available",
        "workers": worker_counts,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "batches": args.batches,
        "features": args.features,
        "start_method": args.start_method,
        "teardown": args.teardown,
    }
    if gpu:
        meta["gpu"] = nvml.get().memory()[0].name
        try:
            import pynvml

            meta["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as error:
            meta["driver"] = f"unknown ({error})"
    lines = [
        "# Sweep overhead: the same loaders with and without leakcheck's Tracker",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), GPU: {meta['gpu']}, "
        f"driver {meta.get('driver', '-')}, torch {meta['torch']}, python {meta['python']}, "
        f"leakcheck {meta['leakcheck']}",
        "",
        f"{args.batches} batches of 64x{args.features} per epoch, {args.epochs} epochs, "
        f"{args.repeats} alternating repeats, start method {args.start_method}, teardown "
        f"{'on' if args.teardown else 'off'} in both arms; medians. Goal: epochs under +2%.",
        "",
        "| configuration | epochs bare s | epochs tracked s | epochs overhead | "
        "total bare s | total tracked s | total overhead | Tracker.sample() ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, entry in results.items():
        epochs, total = entry["epochs_s"], entry["total_s"]
        sample = "-" if entry["sample_ms"] is None else f"{entry['sample_ms']:.2f}"
        lines.append(
            f"| {name} | {epochs['bare']:.3f} | {epochs['tracked']:.3f} | "
            f"{(epochs['ratio'] - 1) * 100:+.1f}% | {total['bare']:.3f} | "
            f"{total['tracked']:.3f} | {(total['ratio'] - 1) * 100:+.1f}% | {sample} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.write:
        stem = write_result(
            f"sweep-{time.strftime('%Y%m%d-%H%M%S')}", {"meta": meta, "results": results}, text
        )
        print(f"wrote {stem}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
