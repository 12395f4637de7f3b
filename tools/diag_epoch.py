"""Diagnose: what one epoch boundary of ``watch(loader)`` costs the calling thread, by part.

bench_watch.py's loader (8 spawn workers, persistent, pin_memory, a matmul per batch on the
GPU) under one ``watch()`` over ``--epochs`` epochs. Times, in the calling thread only, each
epoch's ``begin_epoch``, ``end_epoch`` and its parts (the epoch-end sample's walk, NVML
lists, ``/dev/nvidia*`` descriptor counts, command lines; the telemetry read), and the
judgement (``report``), and prints the descriptors each process holds.

Usage: PYTHONPATH=. python3 tools/diag_epoch.py [--device auto|cpu|cuda] [--workers 8]
       [--batches 300] [--epochs 12]
"""

import argparse
import os
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_watch import _epoch_s, setup

import leakcheck
from leakcheck import procs
from leakcheck import tracker as tracker_module

WALL_S: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
MAIN = threading.main_thread()


def _timed(owner: object, name: str, label: str) -> None:
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if threading.current_thread() is not MAIN:
            return function(*args, **kwargs)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            WALL_S[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    device, weight, loader = setup(args.device, args.workers, args.batches)
    T = tracker_module.Tracker
    for owner, name, label in [
        (T, "begin_epoch", "begin_epoch (all)"),
        (T, "end_epoch", "end_epoch (all)"),
        (T, "_walk", "  walk (full)"),
        (T, "_read_gpu_processes", "  NVML lists"),
        (T, "_job_nvidia_fds", "  /dev/nvidia* counts"),
        (T, "_read_devices", "  telemetry"),
        (tracker_module.procs, "read_proc", "  command lines"),
        (T, "report", "report (judging)"),
    ]:
        _timed(owner, name, label)
    with leakcheck.watch(loader) as wrapped:
        for _ in range(args.epochs):
            _epoch_s(wrapped, device, weight)
        cost = wrapped.tracker.cost()
        pids = [os.getpid(), *procs.child_pids(os.getpid())]
    print(
        f"{args.epochs} epochs, {device.type}; caller {cost.caller_wall_s * 1000 / args.epochs:.2f}"
        " ms per epoch in tracker calls (close included)"
    )
    for label, seconds in WALL_S.items():
        print(
            f"{label:24} {CALLS[label]:5d} calls {seconds * 1000 / args.epochs:8.3f} ms per epoch"
        )
    for pid in pids:
        fds = len(os.listdir(f"/proc/{pid}/fd")) if os.path.exists(f"/proc/{pid}/fd") else None
        print(f"pid {pid}: {fds} descriptors, {len(procs.nvidia_fds(pid) or {})} of /dev/nvidia*")


if __name__ == "__main__":
    main()
