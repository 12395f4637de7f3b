"""Does leakcheck's NVML reading slow the job's own driver calls? Measured directly.

The loader benchmarks (``bench_sweep.py``, ``bench_watch.py``) time whole epochs, whose
run-to-run noise (mostly worker start-up) drowns a 2% goal; and their accounted cost cannot
see the workers waiting in the driver while the sampler's NVML reads hold its lock. This
benchmark isolates that wait, in its worst case: ``--workers`` child processes do nothing
but driver calls, counting them, while the parent alternates blocks with a ``Tracker``
sampling them (as ``leakcheck sweep`` does) and blocks without one. ``--op``:

* ``context`` (the default): create and destroy the device's primary context
  (``cuDevicePrimaryCtxRetain`` then ``cuDevicePrimaryCtxRelease``), the driver work of a
  DataLoader worker that starts, uses CUDA and exits with leakcheck's teardown; the device's
  used memory moves on every call, so the sampler reads the process lists as often as its
  pacing allows (NOTE [nvml pacing] in leakcheck/track/pacing.py);
* ``malloc``: with a context held, allocate and free 64 MiB (``cuMemAlloc``/``cuMemFree``),
  many short calls that each take the driver's locks.

The workers run throughout. Each publishes its count of completed calls and the time of the
last one (a sequence-locked triple in shared memory), so a block's rate per worker is the
calls completed between its first and last completion in the block over the time between
them: a call in progress at either edge of the block (a context takes tens of milliseconds)
adds no error. Rounds of four blocks, bare, tracked, tracked, bare (the next: tracked, bare,
bare, tracked), as in the other benchmarks; per round the ratio tracked/bare of the calls per
second, its median over rounds with a 95% bootstrap interval (``benchmarks/stats.py``), and
the slowdown ``1 - ratio``. The tracker starts before the block's clock and closes after it.
Each round also shows the tracker's cost counters over its blocks: the sampler's CPU and the
wall time of its NVML reads. Goal: under 2%, the sweep's goal: what the workers of a sweep
lose to the sampler inside the driver can be no more than what workers doing nothing but
driver calls lose.

Needs an NVIDIA driver (``libcuda.so.1``) and NVML; torch is not used.

Usage: python benchmarks/bench_driver.py [--op context|malloc] [--workers 4] [--block 3]
       [--rounds 6] [--warmup 1] [--interval 0.05] [--nvml-share S] [--write]
       (--write: benchmarks/results/driver-<machine>.md, a section per op, see results_io.py)
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nvml_share
import stats
from results_io import gpu_meta, host_meta, result_stem, write_result

import leakcheck
from leakcheck.observe import nvml
from leakcheck.track.tracker import Tracker

GOAL_PCT = 2.0
_MALLOC_BYTES = 64 * 2**20
_START_TIMEOUT_S = 60.0


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result}")


# A worker's shared state: [sequence, calls completed, monotonic ns of the last completion].
# The sequence is odd while the worker writes, so a reader never pairs a count with the time
# of another call (x86 keeps the worker's stores in order).
_SEQ, _CALLS, _LAST_NS = 0, 1, 2


def _publish(state: Any) -> None:
    state[_SEQ] += 1
    state[_CALLS] += 1
    state[_LAST_NS] = time.monotonic_ns()
    state[_SEQ] += 1


def _read_state(state: Any) -> tuple[int, int]:
    """A worker's (calls completed, ns of the last completion), read consistently.

    A worker that died mid-write would leave the sequence odd: after many tries the values
    are taken as they are (the run then stops on the dead worker).
    """
    for _ in range(100_000):
        sequence = state[_SEQ]
        calls, last_ns = state[_CALLS], state[_LAST_NS]
        if sequence % 2 == 0 and state[_SEQ] == sequence:
            break
    return calls, last_ns


def _driver_loop(op: str, state: Any, ready: Any, stop: Any) -> None:
    """One worker: driver calls until ``stop`` (or its parent is gone), published in ``state``."""
    parent_pid = os.getppid()
    cuda = ctypes.CDLL("libcuda.so.1")
    _check(cuda.cuInit(0), "cuInit")
    device = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    context = ctypes.c_void_p()
    pointer = ctypes.c_uint64()
    size = ctypes.c_size_t(_MALLOC_BYTES)
    if op == "malloc":
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "retain")
        _check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    ready.set()
    # A parent killed before it could set ``stop`` must not leave workers loading the GPU.
    while not stop.is_set() and os.getppid() == parent_pid:
        if op == "context":
            _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "retain")
            _check(cuda.cuDevicePrimaryCtxRelease_v2(device), "release")
        else:
            _check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), size), "alloc")
            _check(cuda.cuMemFree_v2(pointer), "free")
        _publish(state)
    if op == "malloc":
        cuda.cuDevicePrimaryCtxRelease_v2(device)


def _rate(before: tuple[int, int], after: tuple[int, int], block_s: float) -> float:
    """One worker's calls per second in a block, from its completions (see the docstring)."""
    calls, span_ns = after[0] - before[0], after[1] - before[1]
    if calls < 2 or span_ns <= 0:
        return calls / block_s  # too few completions to time: the plain count
    return calls / (span_ns / 1e9)


def _block(arm: str, seconds: float, states: list[Any], interval_s: float) -> dict[str, Any]:
    """One block: the workers' calls per second, and the tracker's cost when tracked."""
    tracker = Tracker(interval=interval_s, grace=0.0).start() if arm == "tracked" else None
    before_cost = stats.cost_counters(tracker) if tracker is not None else None
    before = [_read_state(state) for state in states]
    time.sleep(seconds)
    after = [_read_state(state) for state in states]
    rate = sum(_rate(b, a, seconds) for b, a in zip(before, after, strict=True))
    calls = sum(a[0] - b[0] for b, a in zip(before, after, strict=True))
    row: dict[str, Any] = {"rate": rate, "calls": calls}
    if tracker is not None and before_cost is not None:
        row["cost"] = stats.cost_delta(before_cost, stats.cost_counters(tracker))
        tracker.close()
    return row


def _render(meta: dict[str, Any], rounds: list[dict[str, Any]], ab: stats.Summary) -> str:
    lines = [
        f"# Driver calls with and without leakcheck's sampler: `{meta['op']}`, "
        f"{meta['workers']} workers",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), GPU: {meta['gpu']}, "
        f"driver {meta['driver']}, python {meta['python']}, leakcheck {meta['leakcheck']}; "
        f"{len(rounds)} rounds of four {meta['block_s']:g} s blocks, sampling every "
        f"{meta['interval_s'] * 1000:g} ms.",
    ]
    lines += nvml_share.banner(meta["nvml_share"])
    lines += [
        "",
        "| round | order | bare calls/s | tracked calls/s | tracked/bare | slowdown | "
        "sampler CPU ms (2 blocks) | NVML wall / CPU ms (2 blocks) | samples |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rounds:
        cost = row["cost"]
        lines.append(
            f"| {row['round']} | {row['order']} | {row['bare_rate']:.1f} | "
            f"{row['tracked_rate']:.1f} | {row['ratio']:.4f} | "
            f"{stats.slowdown_pct(row['ratio']):+.2f}% | {cost['sampler_cpu_s'] * 1000:.1f} | "
            f"{cost['nvml_wall_s'] * 1000:.1f} / {cost['nvml_cpu_s'] * 1000:.1f} | "
            f"{cost['samples']:.0f} |"
        )
    lines += [
        "",
        f"## Summary (goal: the workers' driver calls under {GOAL_PCT:g}% slower tracked)",
        "",
        "| measure | median | 95% CI of the median | over rounds | verdict |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| A/B slowdown, 1 - tracked/bare | {stats.format_pct(ab.median)} | "
        f"{stats.format_ci(ab)} | {ab.minimum:+.2f}% .. {ab.maximum:+.2f}% | "
        f"{stats.verdict(ab, GOAL_PCT)} |",
        "",
        f"A/B: median over rounds of the paired ratio, percentile bootstrap of the median "
        f"({ab.resamples} resamples, seed {ab.seed}).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--op", choices=["context", "malloc"], default="context")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--block", type=float, default=3.0, help="seconds per block")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first, not counted")
    parser.add_argument("--interval", type=float, default=0.05, help="the sampling interval, s")
    nvml_share.add_argument(parser)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.workers < 1 or args.rounds < 1 or args.block <= 0 or args.warmup < 0:
        parser.error("--workers, --rounds and --block must be positive, --warmup at least 0")
    share = nvml_share.apply(parser, args)
    available, reason = nvml.availability()
    if not available:
        print(f"bench_driver: needs an NVIDIA GPU: {reason}", file=sys.stderr)
        return 2

    # A time limit's SIGTERM runs the ``finally`` below, which stops the workers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    context = multiprocessing.get_context("spawn")
    states = [context.Array("q", 3, lock=False) for _ in range(args.workers)]
    readies = [context.Event() for _ in range(args.workers)]
    stop = context.Event()
    workers = [
        context.Process(target=_driver_loop, args=(args.op, state, ready, stop), daemon=True)
        for state, ready in zip(states, readies, strict=True)
    ]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        for ready, worker in zip(readies, workers, strict=True):
            while not ready.wait(0.1):
                if not worker.is_alive() or time.monotonic() > deadline:
                    print(
                        f"bench_driver: worker PID {worker.pid} did not start its driver "
                        f"calls (exit code {worker.exitcode})",
                        file=sys.stderr,
                    )
                    return 1
        rounds: list[dict[str, Any]] = []
        for round_index in range(-args.warmup, args.rounds):
            pair = ("bare", "tracked") if round_index % 2 == 0 else ("tracked", "bare")
            order = (*pair, *reversed(pair))
            blocks = [_block(arm, args.block, states, args.interval) for arm in order]
            if not all(worker.is_alive() for worker in workers):
                print("bench_driver: a worker stopped during the run", file=sys.stderr)
                return 1
            row: dict[str, Any] = {"round": round_index, "order": "/".join(order)}
            for arm in ("bare", "tracked"):
                mine = [block for name, block in zip(order, blocks, strict=True) if name == arm]
                row[f"{arm}_rate"] = sum(block["rate"] for block in mine) / len(mine)
            tracked = [block["cost"] for block in blocks if "cost" in block]
            row["cost"] = {name: sum(cost[name] for cost in tracked) for name in tracked[0]}
            row["ratio"] = row["tracked_rate"] / row["bare_rate"]
            if round_index < 0:
                continue  # a warm-up round
            rounds.append(row)
            print(
                f"round {round_index} ({row['order']}): tracked/bare {row['ratio']:.4f}, "
                f"{row['bare_rate']:.1f} calls/s bare, sampler CPU "
                f"{row['cost']['sampler_cpu_s'] * 1000:.1f} ms, NVML "
                f"{row['cost']['nvml_wall_s'] * 1000:.1f} ms",
                file=sys.stderr,
            )
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()

    ab = stats.slowdown_summary([row["ratio"] for row in rounds])
    meta: dict[str, Any] = {
        **host_meta(),
        **gpu_meta(),
        "leakcheck": leakcheck.__version__,
        "op": args.op,
        "workers": args.workers,
        "block_s": args.block,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "interval_s": args.interval,
        "nvml_share": share,
        "goal_pct": GOAL_PCT,
    }
    text = _render(meta, rounds, ab)
    print(text)
    if args.write:
        payload = {"meta": meta, "rounds": rounds, "ab_slowdown_pct": ab.to_dict()}
        stem = result_stem("driver", args.op, nvml_share.variant(share))
        path = write_result(stem, payload, text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
