"""Diagnose: where the sampler thread's CPU time goes during a sweep-like run.

Runs the built-in workload (4 workers per epoch, spawn, 3 epochs) under a Tracker, as
``leakcheck sweep`` does, and splits the sampler thread's CPU time (``time.thread_time``)
and wall time by phase: lineage walk, NVML process lists, NVML memory, mailbox, tag scan,
GPU attribution. Only the sampler thread's calls are counted.

``--host-workers``: the workers compute on the CPU only and the main thread multiplies each
batch on the GPU, as in benchmarks/bench_watch.py (whose sampler cost this splits up).

Usage: PYTHONPATH=. python3 tools/diag_sampler.py [--workers 4] [--epochs 3] [--persistent]
       [--host-workers] [--batches 16]
"""

import argparse
import os
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.getcwd())

from leakcheck import nvml, procs, tracker as tracker_module  # noqa: E402
from leakcheck.sweep import _register_workers  # noqa: E402
from leakcheck.workload import WorkloadSpec, make_loader  # noqa: E402

CPU_S: dict[str, float] = defaultdict(float)
WALL_S: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def _timed(name, function):
    def wrapper(*args, **kwargs):
        if threading.current_thread().name != "leakcheck-sampler":
            return function(*args, **kwargs)
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            CPU_S[name] += time.thread_time() - cpu
            WALL_S[name] += time.perf_counter() - wall
            CALLS[name] += 1

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--host-workers", action="store_true")
    parser.add_argument("--batches", type=int, default=16)
    args = parser.parse_args()
    tracker_module.procs.descendants = _timed("lineage walk", procs.descendants)
    tracker_module.procs.is_alive = _timed("is_alive", procs.is_alive)
    procs.TagScan.scan = _timed("tag scan", procs.TagScan.scan)
    tracker_module.procs.read_proc = _timed("read_proc", procs.read_proc)
    nvml.Nvml.processes = _timed("nvml processes", nvml.Nvml.processes)
    nvml.Nvml.memory = _timed("nvml memory", nvml.Nvml.memory)
    T = tracker_module.Tracker
    T._read_mailbox = _timed("mailbox", T._read_mailbox)
    T._attribute_gpu = _timed("attribute gpu", T._attribute_gpu)
    T._sample_locked = _timed("whole sample", T._sample_locked)
    gpu = nvml.availability()[0]
    spec = WorkloadSpec(
        gpu=gpu and not args.host_workers, persistent=args.persistent, batches=args.batches
    )
    step = None
    if args.host_workers and gpu:
        import torch

        weight = torch.randn(spec.features, spec.features, device="cuda")

        def step(batch):
            (batch.to("cuda", non_blocking=True) @ weight).sum().item()
    tracker = T(interval=0.05, grace=2.0, use_nvml=gpu).start()
    loader = make_loader(spec, args.workers)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        with tracker.epoch(f"epoch {epoch}"):
            iterator = iter(loader)
            _register_workers(tracker, iterator)
            for batch in iterator:
                if step is not None:
                    step(batch)
    epochs_s = time.perf_counter() - started
    cost = tracker.cost()
    del loader
    tracker.close()
    print(f"epochs {epochs_s:.2f} s; samples {cost.samples}; sampler CPU {cost.sampler_cpu_s * 1000:.1f} ms "
          f"({cost.sampler_cpu_s / epochs_s * 100:.2f}% of the epochs); caller {cost.caller_wall_s * 1000:.1f} ms")
    print(f"{'phase (sampler thread)':24} {'calls':>6} {'CPU ms':>9} {'wall ms':>9} {'CPU ms/call':>12}")
    for name in sorted(CPU_S, key=lambda n: -CPU_S[n]):
        print(f"{name:24} {CALLS[name]:6d} {CPU_S[name] * 1000:9.1f} {WALL_S[name] * 1000:9.1f} "
              f"{CPU_S[name] * 1000 / CALLS[name]:12.3f}")


if __name__ == "__main__":
    main()
