"""Iteration throughput of ``leakcheck.watch(loader)`` against the raw loader, in one run.

One DataLoader (8 workers by default, persistent, so both sides iterate the very same worker
processes) is iterated in blocks: raw epochs, or epochs through a fresh ``watch(loader)``
(tracker started before the clock, closed after it). Each round runs four blocks in the
order raw, watched, watched, raw (the next round: watched, raw, raw, watched), so a speed
that drifts steadily through the run weighs the same on both sides of a round. ``--warmup``
rounds run first and are not counted. Each epoch runs a small training step per batch (a
matmul on the GPU with ``--device cuda``). Goal: watch(loader) under 1% slower. Two measures
of it, side by side (``benchmarks/stats.py`` explains both):

* A/B: per round, the ratio watched/raw of the batches per second of its two watched and
  its two raw blocks together; the median over rounds, its 95% bootstrap interval, and the
  slowdown ``1 - ratio`` in %.
* Accounted cost: what leakcheck itself spent during the watched block, read from
  ``tracker.cost()`` just before and just after each watched block (start and ``close()``
  lie outside the timed block and outside this difference), over the blocks' wall time::

      (caller_wall_s + sampler_cpu_s + batches * per_batch_ns * 1e-9) / block wall s

  The calling thread's time inside tracker calls (epoch begin and end) is paid in full; the
  sampler thread can delay the training thread only while it holds the GIL, at most its CPU
  time, where there are spare cores; the generator step per batch is measured alone (below).
  So the sum bounds the slowdown from above without drowning in round-to-round noise.
  The watched blocks use watch()'s defaults (``on_leak="warn"``: a report is judged at each
  epoch end), as a user gets them.

``--variant`` splits the A/B (diagnostics; the watched blocks as users get them are
``watch``, the default): ``no-sampler`` watches with an interval of an hour, so that only the
epoch boundaries and the wrapper remain; ``control`` runs the second arm through a plain
generator and no leakcheck at all (an A/A check of the design: its A/B should centre on 0).
``fresh-workers`` makes a new loader for every block, raw or watched, whose persistent
workers start inside the block and stop after it (outside the clock): each watched block's
workers then report their birth to its tracker, which reads their copies of the parent's
memory at their first epoch end and inside epochs of 10 s or more (NOTE [copy on read]
in leakcheck/observe/hostmem.py). Every block is a whole run of its own there: the worst
case for those one-off reads (a run's workers are born once).

Also measured alone in the same run: one ``Tracker.sample()``, one epoch boundary, one batch
step. Each round also shows the wall time of the tracker's NVML reads (``nvml_wall_s``) and
their CPU time (``nvml_cpu_s``: part of the sampler's CPU, spent mostly in the driver with the
interpreter lock released), the sampler's CPU in host-memory reads after epoch ends
(``host_read_cpu_s``: USS and PSS of the parent and the persistent workers, read at each new
tracker's first epoch end and paced after), and ``--nvml-share`` (a diagnostic) sets the
share of the time the sampler's NVML reads may work in the driver (NOTE [nvml pacing] in
leakcheck/track/pacing.py) instead of leakcheck's own.

Usage: python benchmarks/bench_watch.py [--device auto|cpu|cuda] [--workers 8]
       [--batches 200] [--epochs 1] [--rounds 10] [--warmup 1] [--interval 0.05]
       [--variant watch|no-sampler|control] [--write]
       (--write: benchmarks/results/watch-<machine>.md, a section per variant, see results_io.py)
The GPU run, ``--device cuda --workers 8 --batches 1000 --rounds 6``, has epochs of ~1.5 s:
28 blocks, about 1.5 minutes with start-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nvml_share
import stats
import torch
from results_io import host_meta, machine, result_stem, write_result
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.observe import nvml


class Images(Dataset[torch.Tensor]):
    """Decode-like work per item: a small image made and normalised on the CPU."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(index)
        image = torch.rand(3, 64, 64, generator=gen)
        return (image - image.mean()) / (image.std() + 1e-6)


def _epoch_s(loader: Any, device: torch.device, weight: torch.Tensor) -> tuple[float, int]:
    start = time.perf_counter()
    batches = 0
    for batch in loader:
        x = batch.to(device, non_blocking=True).flatten(1)
        (x @ weight).relu_().sum()
        batches += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, batches


GOAL_PCT = 1.0
VARIANT_NOTES = {
    "watch": "watch() as users get it",
    "no-sampler": "watch() whose sampler never ticks: epoch boundaries and the wrapper only",
    "control": "the second arm is the raw loader through a generator: an A/A check",
    "fresh-workers": "a new loader per block: each watched block's workers are born under its "
    "tracker, which reads their copies (at their first epoch end, inside epochs of 10 s+)",
}
VARIANTS = tuple(VARIANT_NOTES)
# An interval that no block lasts: the sampler thread never ticks (``--variant no-sampler``).
_NO_SAMPLER_INTERVAL_S = 3600.0


class _Plain:
    """The loader through a generator per epoch, as watch() wraps it (``--variant control``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        yield from self.loader


def _block(
    loader: Any, epochs: int, device: torch.device, weight: torch.Tensor
) -> tuple[float, int]:
    """Wall seconds and batches over ``epochs`` epochs."""
    seconds = 0.0
    batches = 0
    for _ in range(epochs):
        took, count = _epoch_s(loader, device, weight)
        seconds += took
        batches += count
    return seconds, batches


def _accounted_pct(
    cost: dict[str, float], batches: int, per_batch_ns: float, wall_s: float
) -> float:
    """Upper bound of the slowdown, in % of the watched block's wall time."""
    # A negative per-batch estimate is noise (two timings subtracted): count nothing for it.
    spent_s = (
        cost["caller_wall_s"] + cost["sampler_cpu_s"] + batches * max(per_batch_ns, 0.0) * 1e-9
    )
    return spent_s / wall_s * 100


def _median_ms(call: Any, rounds: int) -> float:
    return statistics.median(stats.time_ms(call, rounds))


def _costs(loader: Any, interval_s: float) -> dict[str, Any]:
    """What watch() adds, measured piece by piece (steady on a noisy machine)."""
    with leakcheck.watch(loader, on_leak="ignore", interval=interval_s) as wrapped:
        tracker = wrapped.tracker
        tick_ms = _median_ms(tracker.sample, 200)

        def boundary() -> None:
            tracker.begin_epoch()
            tracker.end_epoch()
            tracker.report()

        boundary_ms = _median_ms(boundary, 30)
    # The device reads an epoch end makes, alone: memory with and without the telemetry
    # (temperature, clocks, power, P-state, clock-event reasons: a driver call each).
    device_ms: dict[str, float | None] = {"device_memory_ms": None, "device_telemetry_ms": None}
    if nvml.availability()[0]:
        handle = nvml.get()
        device_ms["device_memory_ms"] = _median_ms(handle.memory, 30)
        device_ms["device_telemetry_ms"] = _median_ms(handle.devices, 30)
    items = list(range(200_000))
    raw_ms = _median_ms(lambda: sum(1 for _ in items), 5)
    with leakcheck.watch(items, on_leak="ignore") as wrapped_items:
        watched_ms = _median_ms(lambda: sum(1 for _ in wrapped_items), 5)
    step_ns = (watched_ms - raw_ms) / len(items) * 1e6
    return {
        "sampler_tick_ms": tick_ms,
        "sampler_cpu_pct_of_one_core": tick_ms / (interval_s * 1000) * 100,
        "epoch_boundary_ms": boundary_ms,
        **device_ms,
        "per_batch_ns": step_ns,
    }


def make_loader(
    use_cuda: bool, workers: int, batches: int, batch_size: int
) -> DataLoader[torch.Tensor]:
    """The benchmark's loader (its workers not started)."""
    return DataLoader(
        Images(batches * batch_size),
        batch_size=batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=use_cuda,
        multiprocessing_context="spawn" if use_cuda else "fork",
    )


def setup(
    device_choice: str, workers: int, batches: int, batch_size: int = 32
) -> tuple[torch.device, torch.Tensor, DataLoader[torch.Tensor]]:
    """The benchmark's device, model weight and loader, its workers started and warm.

    Args:
        device_choice: ``"auto"`` (CUDA where available), ``"cpu"`` or ``"cuda"``.
        workers: Worker processes (persistent where there are any).
        batches: Batches per epoch.
        batch_size: Items per batch.

    """
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    if not use_cuda:
        torch.set_num_threads(1)  # the workers need the cores; one thread steps the model
    weight = torch.randn(3 * 64 * 64, 512, device=device)
    loader = make_loader(use_cuda, workers, batches, batch_size)
    _block(loader, 1, device, weight)  # start the workers, warm the caches
    return device, weight, loader


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per block")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first, not counted")
    parser.add_argument("--interval", type=float, default=0.05, help="watch() sampling, s")
    parser.add_argument(
        "--variant",
        choices=VARIANTS,
        default="watch",
        help="diagnostic: what the second arm runs (see the module's docstring)",
    )
    nvml_share.add_argument(parser)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    share = nvml_share.apply(parser, args)

    device, weight, loader = setup(args.device, args.workers, args.batches, args.batch_size)
    use_cuda = device.type == "cuda"
    fresh = args.variant == "fresh-workers"

    def block_loader() -> Any:
        """The loader of one block: the same one, or a new one (``fresh-workers``)."""
        if not fresh:
            return loader
        return make_loader(use_cuda, args.workers, args.batches, args.batch_size)

    rounds: list[dict[str, Any]] = []
    for round_index in range(-args.warmup, args.rounds):
        pair = ("raw", "watched") if round_index % 2 == 0 else ("watched", "raw")
        order = (*pair, *reversed(pair))
        row: dict[str, Any] = {"round": round_index, "order": "/".join(order)}
        row.update(raw_s=0.0, raw_batches=0, watched_s=0.0, watched_batches=0, cost={})
        for mode in order:
            current = block_loader()
            if mode == "raw":
                took_s, batches = _block(current, args.epochs, device, weight)
                row["raw_s"] += took_s
                row["raw_batches"] += batches
                del current  # a fresh loader's workers stop now, outside the clock
                continue
            if args.variant == "control":
                took_s, batches = _block(_Plain(loader), args.epochs, device, weight)
                spent = dict.fromkeys(stats.COST_FIELDS, 0.0)
            else:
                interval_s = (
                    _NO_SAMPLER_INTERVAL_S if args.variant == "no-sampler" else args.interval
                )
                with leakcheck.watch(current, interval=interval_s) as wrapped:
                    # Read before and after the timed block only: start() and close() are
                    # outside the clock, and outside the accounted cost too.
                    before = stats.cost_counters(wrapped.tracker)
                    took_s, batches = _block(wrapped, args.epochs, device, weight)
                    spent = stats.cost_delta(before, stats.cost_counters(wrapped.tracker))
                    if fresh:
                        wrapped.drop_loader()  # its workers stop within the tracked run
                del current
            row["watched_s"] += took_s
            row["watched_batches"] += batches
            row["cost"] = {k: row["cost"].get(k, 0.0) + v for k, v in spent.items()}
        row["raw_batches_per_s"] = row["raw_batches"] / row["raw_s"]
        row["watched_batches_per_s"] = row["watched_batches"] / row["watched_s"]
        row["ratio"] = row["watched_batches_per_s"] / row["raw_batches_per_s"]
        if round_index < 0:
            continue  # a warm-up round
        rounds.append(row)
        print(
            f"round {round_index} ({row['order']}): watched/raw {row['ratio']:.4f}, "
            f"leakcheck caller {row['cost']['caller_wall_s'] * 1000:.1f} ms, "
            f"sampler CPU {row['cost']['sampler_cpu_s'] * 1000:.1f} ms "
            f"in {row['watched_s']:.2f} s",
            file=sys.stderr,
        )
    raw = [row["raw_batches_per_s"] for row in rounds]
    watched = [row["watched_batches_per_s"] for row in rounds]
    ratios = [row["ratio"] for row in rounds]
    ratio = statistics.median(ratios)
    costs = _costs(loader, args.interval)
    epoch_ms = args.batches / statistics.median(raw) * 1000
    costs["epoch_boundary_pct_of_epoch"] = costs["epoch_boundary_ms"] / epoch_ms * 100
    # The control's generator is no cost of leakcheck's: its arm has nothing to account.
    step_ns = 0.0 if args.variant == "control" else costs["per_batch_ns"]
    for row in rounds:
        row["accounted_pct"] = _accounted_pct(
            row["cost"], row["watched_batches"], step_ns, row["watched_s"]
        )
    ab = stats.slowdown_summary(ratios)
    ratio_summary = stats.summarize(ratios)
    accounted = stats.summarize([row["accounted_pct"] for row in rounds])
    ab_verdict = stats.verdict(ab, GOAL_PCT)
    accounted_verdict = stats.bound_verdict(accounted, GOAL_PCT)
    cpu_count = os.cpu_count() or 1
    # The workers, the training thread, the sampler thread and (on CUDA) the pin-memory
    # thread: with fewer cores than that the sampler competes for a core, which the
    # accounted bound does not count.
    spare_cores = cpu_count - args.workers - 2 - (1 if use_cuda else 0)

    meta: dict[str, Any] = {
        **host_meta(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "workers": args.workers,
        "batch_size": args.batch_size,
        "batches_per_epoch": args.batches,
        "epochs_per_block": args.epochs,
        "rounds": args.rounds,
        "interval_s": args.interval,
        "nvml_share": share,
        "variant": args.variant,
        "goal_slowdown_pct": GOAL_PCT,
        "spare_cores": spare_cores,
    }
    payload = {
        "meta": meta,
        "raw_batches_per_s": raw,
        "watched_batches_per_s": watched,
        "ratio_per_round": ratios,
        "median_ratio": ratio,
        "slowdown_pct": (1 - ratio) * 100,
        "ratio_summary": ratio_summary.to_dict(),
        "ab_slowdown_pct": ab.to_dict(),
        "ab_verdict": ab_verdict,
        "accounted_pct": accounted.to_dict(),
        "accounted_verdict": accounted_verdict,
        "rounds_detail": rounds,
        "costs": costs,
    }
    lines = [
        f"# watch(loader) vs raw loader: {args.workers} workers, {meta['device']}",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), torch {meta['torch']}, "
        f"python {meta['python']}; {args.rounds} rounds x {args.epochs} epochs x "
        f"{args.batches} batches of {args.batch_size}",
    ]
    lines += nvml_share.banner(share)
    if args.variant != "watch":
        note = VARIANT_NOTES[args.variant]
        lines += ["", f"**Diagnostic: `--variant {args.variant}` ({note}).**"]
    lines += [
        "",
        "| round | order | raw batches/s | watched batches/s | watched/raw | slowdown | "
        "leakcheck caller ms (2 blocks) | sampler CPU ms (2 blocks) | "
        "NVML wall / CPU ms (2 blocks) | host reads CPU ms (2 blocks) | samples | accounted |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rounds:
        cost = row["cost"]
        lines.append(
            f"| {row['round']} | {row['order']} | {row['raw_batches_per_s']:.1f} | "
            f"{row['watched_batches_per_s']:.1f} | {row['ratio']:.4f} | "
            f"{stats.slowdown_pct(row['ratio']):+.2f}% | {cost['caller_wall_s'] * 1000:.2f} | "
            f"{cost['sampler_cpu_s'] * 1000:.2f} | {cost['nvml_wall_s'] * 1000:.2f} / "
            f"{cost['nvml_cpu_s'] * 1000:.2f} | {cost['host_read_cpu_s'] * 1000:.2f} | "
            f"{cost['samples']:.0f} | "
            f"{row['accounted_pct']:.3f}% |"
        )
    lines += [
        "",
        f"## Summary (goal: watch(loader) under {GOAL_PCT:g}% slower than the raw loader)",
        "",
        "| measure | median | 95% CI of the median | over rounds | verdict |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| A/B slowdown, 1 - watched/raw | {stats.format_pct(ab.median)} | "
        f"{stats.format_ci(ab)} | {ab.minimum:+.2f}% .. {ab.maximum:+.2f}% | {ab_verdict} |",
        "| accounted cost (GIL and CPU bound) | "
        f"{stats.format_pct(accounted.median, signed=False)} | "
        f"{stats.format_ci(accounted, signed=False)} | max {accounted.maximum:.3f}% | "
        f"{accounted_verdict} |",
        "",
        f"- A/B: median watched/raw {ratio:.4f} over {len(ratios)} rounds of four adjacent "
        f"blocks (raw/watched/watched/raw, then the mirror order; {args.warmup} warm-up "
        f"round(s) not counted); bootstrap of the median, {ab.resamples} resamples, seed "
        f"{ab.seed}.",
        "- accounted: (caller wall s in tracker calls + sampler thread CPU s + batches x "
        "per-batch step) / watched block wall s, read from tracker.cost() around the block; "
        "a bound of what each round's loop paid through the GIL and the CPU (not driver "
        "waits: benchmarks/stats.py), so its verdict asks the worst round.",
    ]
    if spare_cores < 0:
        lines.append(
            f"- caveat: {cpu_count} CPUs for {args.workers} workers and the main process's "
            "threads: no spare core, so the sampler also competes for a core and the "
            "accounted cost is not a strict bound here."
        )
    lines += [
        "",
        "What watch() adds, measured alone in the same run:",
        f"- per batch: {costs['per_batch_ns']:.0f} ns (one generator step)",
        f"- per epoch: {costs['epoch_boundary_ms']:.2f} ms at the epoch boundaries "
        f"({costs['epoch_boundary_pct_of_epoch']:.2f}% of a {epoch_ms:.0f} ms epoch)"
        + (
            ""
            if costs["device_telemetry_ms"] is None
            else f"; of which the devices' read, alone: memory {costs['device_memory_ms']:.2f} "
            f"ms, memory and telemetry {costs['device_telemetry_ms']:.2f} ms"
        ),
        f"- one Tracker.sample(): {costs['sampler_tick_ms']:.3f} ms, the cost of a walking "
        f"tick (every 4th of the sampler's ticks, every {args.interval * 1000:.0f} ms; the "
        "others skip the walk, and the NVML lists while device memory holds still): "
        f"{costs['sampler_cpu_pct_of_one_core']:.2f}% of one core if every tick cost that",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        # The loader on the CPU of a GPU machine is not that machine's GPU result.
        cpu_loader = not use_cuda and machine() != "cpu"
        stem = result_stem(
            "watch",
            "" if args.variant == "watch" else args.variant,
            nvml_share.variant(share),
            "cpu-loader" if cpu_loader else "",
        )
        write_result(stem, payload, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
