"""Diagnose: what one wake-up of a periodic thread costs in CPU, by the way it waits.

The tracker's sampler wakes every ``interval`` (50 ms). Its thread's CPU time per tick
counts the wake-up itself (timer, futex, scheduler, the interpreter lock taken back) as well
as the sample. This times a bare thread that only waits, ``--seconds`` per way of waiting:
``threading.Event.wait`` (a Condition over a fresh lock per call), ``Lock.acquire`` with a
timeout on a held lock, and ``time.sleep``; then an idle Tracker (8 sleeping children, 30
idle threads in the root, NVML off and, where present, on) per tick.

Usage: PYTHONPATH=. python3 tools/diag_wake.py [--seconds 2] [--interval 0.05]
"""

import argparse
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.getcwd())

from leakcheck import nvml
from leakcheck.tracker import Tracker


def wake_cpu_us(kind: str, seconds: float, interval_s: float) -> float:
    event = threading.Event()
    gate = threading.Lock()
    gate.acquire()
    result: dict[str, float] = {}

    def run() -> None:
        wakes, cpu_s = 0, time.thread_time()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if kind == "event":
                event.wait(interval_s)
            elif kind == "lock":
                gate.acquire(timeout=interval_s)
            else:
                time.sleep(interval_s)
            wakes += 1
        result["us"] = (time.thread_time() - cpu_s) / wakes * 1e6

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["us"]


def tracker_tick_us(use_nvml: bool, seconds: float, interval_s: float) -> tuple[float, float]:
    tracker = Tracker(interval=interval_s, use_nvml=use_nvml).start()
    tracker.begin_epoch()
    time.sleep(1.0)
    before = tracker.cost()
    time.sleep(seconds)
    after = tracker.cost()
    tracker.end_epoch()
    tracker.close()
    ticks = max(1, after.samples - before.samples)
    return (
        (after.sampler_cpu_s - before.sampler_cpu_s) / ticks * 1e6,
        (after.sample_wall_s - before.sample_wall_s) / ticks * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.05)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, interval {args.interval} s")
    for kind in ("event", "lock", "sleep", "event", "lock", "sleep"):
        print(
            f"wait by {kind:6}: {wake_cpu_us(kind, args.seconds, args.interval):7.1f} us CPU per wake"
        )
    release = threading.Event()
    idle = [threading.Thread(target=release.wait, daemon=True) for _ in range(30)]
    for thread in idle:
        thread.start()
    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(8)
    ]
    try:
        modes = [False, True] if nvml.availability()[0] else [False]
        for use_nvml in modes * 2:
            cpu_us, wall_us = tracker_tick_us(use_nvml, 2 * args.seconds, args.interval)
            print(
                f"idle tracker, nvml {'on ' if use_nvml else 'off'}: sampler CPU {cpu_us:7.1f} us "
                f"per tick, of which inside samples (wall) {wall_us:7.1f} us"
            )
    finally:
        release.set()
        for child in children:
            child.kill()
            child.wait()


if __name__ == "__main__":
    main()
