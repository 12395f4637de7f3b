"""What the hang watch and the descriptor counts cost, against the loop they watch.

Three parts, each timed alone on this machine (medians of rounds):

* per batch, the hang watch's two clock reads (``Tracker.batch_wanted``/``batch_arrived``,
  what ``watch()`` calls around each ``next()``);
* per sampler tick, its check of the loop's wait (``HangWatch.due``), 20 ticks a second;
* per epoch end, one ``/proc/PID/fd`` listing and limits read (``procs.descriptors``) of each
  of N children holding F open files each (the fd-pressure count and the ``/dev/nvidia*``
  count in one).

Each is set against a loop of ``--batch-ms`` per batch and ``--epoch-s`` per epoch with N
workers (defaults: bench_watch's loop on the H200, 8 workers, about 1.85 ms per batch and
1.5 s per epoch). Goal (issue: deaths and hangs): at most 0.1% of the loop.
``--write`` stores ``benchmarks/results/hang-fds-<machine>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from results_io import host_meta, result_stem, write_result

from leakcheck.observe import procs
from leakcheck.track.hang import HangWatch
from leakcheck.track.tracker import Tracker

HOLDER = (
    "import sys, time; files = [open(sys.argv[1]) for _ in range(int(sys.argv[2]))]; "
    "print('ready', flush=True); time.sleep(600)"
)


def _median_ns(action: Callable[[], object], calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            action()
        times.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=8)
    parser.add_argument("--fds", type=int, default=64, help="open files per child")
    parser.add_argument("--batch-ms", type=float, default=1.85)
    parser.add_argument("--epoch-s", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    tracker = Tracker(use_nvml=False, hang_after=120)

    def one_batch() -> None:
        tracker.batch_wanted()
        tracker.batch_arrived()

    batch_ns = _median_ns(one_batch, 100_000, args.rounds)
    watch = HangWatch(120.0)
    watch.waiting_since_s = time.monotonic()
    tick_ns = _median_ns(watch.due, 100_000, args.rounds)

    with tempfile.NamedTemporaryFile() as target:
        children = [
            subprocess.Popen(
                [sys.executable, "-c", HOLDER, target.name, str(args.fds)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(args.children)
        ]
        try:
            for child in children:
                assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            pids = [child.pid for child in children]

            def one_epoch_end() -> None:
                for pid in pids:
                    procs.descriptors(pid)

            fds_ns = _median_ns(one_epoch_end, 200, args.rounds)

            def nvidia_only() -> None:  # what an epoch end read before the fd-pressure rule
                for pid in pids:
                    procs.nvidia_fds(pid)

            nvidia_ns = _median_ns(nvidia_only, 200, args.rounds)
            counted = procs.descriptors(pids[0])
        finally:
            for child in children:
                child.kill()
                child.wait()

    batch_share = batch_ns / (args.batch_ms * 1e6)
    tick_share = tick_ns * 20 / 1e9
    fds_share = fds_ns / (args.epoch_s * 1e9)
    added_share = (fds_ns - nvidia_ns) / (args.epoch_s * 1e9)
    meta = host_meta()
    rows = [
        ("hang watch, per batch (2 clock reads)", f"{batch_ns:.0f} ns", batch_share),
        ("hang watch, per tick (20 a second)", f"{tick_ns:.0f} ns", tick_share),
        (
            f"descriptor counts, per epoch end ({args.children} children x "
            f"{counted.open_count if counted else '?'} fds)",
            f"{fds_ns / 1e6:.3f} ms",
            fds_share,
        ),
        (
            "of which the fd-pressure count's own part (the limits read; the listing was "
            "already read for /dev/nvidia* descriptors)",
            f"{(fds_ns - nvidia_ns) / 1e6:.3f} ms",
            added_share,
        ),
    ]
    lines = [
        "# The hang watch and the descriptor counts: their cost against the loop",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), Python {meta['python']}; "
        f"medians of {args.rounds} rounds; loop: {args.batch_ms} ms per batch, "
        f"{args.epoch_s} s per epoch, {args.children} workers. Goal: at most 0.1% of the loop.",
        "",
        "| part | cost | share of the loop |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {cost} | {share:.4%} |" for name, cost, share in rows),
        f"| the hang watch and the fd-pressure count together | | "
        f"{batch_share + tick_share + added_share:.4%} |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        payload = {
            "meta": meta,
            "args": vars(args),
            "batch_ns": batch_ns,
            "tick_ns": tick_ns,
            "epoch_end_fds_ns": fds_ns,
            "epoch_end_nvidia_only_ns": nvidia_ns,
            "shares": {
                "batch": batch_share,
                "tick": tick_share,
                "epoch_end": fds_share,
                "fd_pressure_added": added_share,
            },
        }
        print(write_result(result_stem("hang-fds"), payload, text))


if __name__ == "__main__":
    main()
