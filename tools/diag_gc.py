"""Diagnose: the garbage collections that ``watch(loader)`` adds, by thread and generation.

bench_watch.py's loader (persistent workers) iterated in alternating raw and watched blocks
of one epoch each; ``gc.callbacks`` time every collection and note the thread it ran in.
Collections in the training thread are not in the accounted bound (only tracker calls
are), so this prints their count and time per block: raw against watched.

Usage: PYTHONPATH=. python3 tools/diag_gc.py [--device auto|cpu|cuda] [--workers 8]
       [--batches 300] [--rounds 4]
"""

import argparse
import gc
import os
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_watch import _epoch_s, setup

import leakcheck

MAIN = threading.main_thread()
STARTED: dict[int, float] = {}
TOTALS: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0, 0.0])
MODE = ["none"]


def _on_gc(phase: str, info: dict) -> None:
    ident = threading.get_ident()
    if phase == "start":
        STARTED[ident] = time.perf_counter()
        return
    began = STARTED.pop(ident, None)
    if began is None:
        return
    where = "main" if threading.current_thread() is MAIN else threading.current_thread().name
    total = TOTALS[(MODE[0], where, info["generation"])]
    total[0] += 1
    total[1] += time.perf_counter() - began


def _allocated() -> int:
    """GC-tracked objects alive now (cheap enough between blocks)."""
    return len(gc.get_objects())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    device, weight, loader = setup(args.device, args.workers, args.batches)
    print(f"objects tracked by gc: {len(gc.get_objects())}; thresholds {gc.get_threshold()}")
    gc.callbacks.append(_on_gc)
    wall = defaultdict(float)
    net = defaultdict(int)
    for round_index in range(args.rounds):
        order = ("raw", "watched") if round_index % 2 == 0 else ("watched", "raw")
        for mode in (*order, *reversed(order)):
            if mode == "raw":
                MODE[0] = "raw"
                before = _allocated()
                wall["raw"] += _epoch_s(loader, device, weight)[0]
                net["raw"] += _allocated() - before
                MODE[0] = "none"
                continue
            with leakcheck.watch(loader, on_leak="ignore") as wrapped:
                MODE[0] = "watched"
                before = _allocated()
                wall["watched"] += _epoch_s(wrapped, device, weight)[0]
                net["watched"] += _allocated() - before
                MODE[0] = "none"
    gc.callbacks.remove(_on_gc)
    print("mode     thread            gen  collections  ms total  ms per s of blocks")
    for (mode, where, gen), (count, seconds) in sorted(TOTALS.items()):
        if mode == "none":
            continue
        print(
            f"{mode:8} {where[:16]:16} {gen:4} {count:12} {seconds * 1000:9.1f} "
            f"{seconds * 1000 / wall[mode]:10.2f}"
        )
    print(f"block wall s: raw {wall['raw']:.2f}, watched {wall['watched']:.2f}")
    print(f"net gc-tracked objects per block: raw {net['raw'] / (2 * args.rounds):.0f}, "
          f"watched {net['watched'] / (2 * args.rounds):.0f}")


if __name__ == "__main__":
    main()
