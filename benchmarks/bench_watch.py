"""Iteration throughput of ``leakcheck.watch(loader)`` against the raw loader, in one run.

One DataLoader (8 workers by default, persistent, so both sides iterate the very same worker
processes) is iterated in alternating blocks: a block of raw epochs, then a block of epochs
through a fresh ``watch(loader)`` (tracker started before the clock, closed after it), then
the other order in the next round. Each epoch runs a small training step per batch (a
matmul on the GPU with ``--device cuda``). The result is the median over rounds of
watched/raw batches per second; the goal is a slowdown under 1%.

Usage: python benchmarks/bench_watch.py [--device auto|cpu|cuda] [--workers 8]
       [--batches 200] [--epochs 1] [--rounds 20] [--interval 0.05] [--write]
       (--write: benchmarks/results/watch-<device>-<date>.{json,md})
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from results_io import write_result
from torch.utils.data import DataLoader, Dataset

import leakcheck


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


def _block(loader: Any, epochs: int, device: torch.device, weight: torch.Tensor) -> float:
    """Batches per second over ``epochs`` epochs."""
    seconds = batches = 0.0
    for _ in range(epochs):
        took, count = _epoch_s(loader, device, weight)
        seconds += took
        batches += count
    return batches / seconds


def _median_ms(call: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def _costs(loader: Any, interval_s: float) -> dict[str, float]:
    """What watch() adds, measured piece by piece (steady on a noisy machine)."""
    with leakcheck.watch(loader, on_leak="ignore", interval=interval_s) as wrapped:
        tracker = wrapped.tracker
        tick_ms = _median_ms(tracker.sample, 200)

        def boundary() -> None:
            tracker.begin_epoch()
            tracker.end_epoch()
            tracker.report()

        boundary_ms = _median_ms(boundary, 30)
    items = list(range(200_000))
    raw_ms = _median_ms(lambda: sum(1 for _ in items), 5)
    with leakcheck.watch(items, on_leak="ignore") as wrapped_items:
        watched_ms = _median_ms(lambda: sum(1 for _ in wrapped_items), 5)
    step_ns = (watched_ms - raw_ms) / len(items) * 1e6
    return {
        "sampler_tick_ms": tick_ms,
        "sampler_cpu_pct_of_one_core": tick_ms / (interval_s * 1000) * 100,
        "epoch_boundary_ms": boundary_ms,
        "per_batch_ns": step_ns,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per block")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.05, help="watch() sampling, s")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    if not use_cuda:
        torch.set_num_threads(1)  # the workers need the cores; one thread steps the model
    weight = torch.randn(3 * 64 * 64, 512, device=device)
    loader = DataLoader(
        Images(args.batches * args.batch_size),
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=use_cuda,
        multiprocessing_context="spawn" if use_cuda else "fork",
    )
    _block(loader, 1, device, weight)  # start the workers, warm the caches

    raw: list[float] = []
    watched: list[float] = []
    for round_index in range(args.rounds):
        order = ("raw", "watched") if round_index % 2 == 0 else ("watched", "raw")
        for mode in order:
            if mode == "raw":
                raw.append(_block(loader, args.epochs, device, weight))
                continue
            with leakcheck.watch(loader, on_leak="ignore", interval=args.interval) as wrapped:
                watched.append(_block(wrapped, args.epochs, device, weight))
    ratios = [w / r for w, r in zip(watched, raw, strict=True)]
    ratio = statistics.median(ratios)
    costs = _costs(loader, args.interval)
    epoch_ms = args.batches / statistics.median(raw) * 1000
    costs["epoch_boundary_pct_of_epoch"] = costs["epoch_boundary_ms"] / epoch_ms * 100

    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "workers": args.workers,
        "batch_size": args.batch_size,
        "batches_per_epoch": args.batches,
        "epochs_per_block": args.epochs,
        "rounds": args.rounds,
        "interval_s": args.interval,
    }
    payload = {
        "meta": meta,
        "raw_batches_per_s": raw,
        "watched_batches_per_s": watched,
        "ratio_per_round": ratios,
        "median_ratio": ratio,
        "slowdown_pct": (1 - ratio) * 100,
        "costs": costs,
    }
    lines = [
        f"# watch(loader) vs raw loader: {args.workers} workers, {meta['device']}",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), torch {meta['torch']}, "
        f"python {meta['python']}; {args.rounds} rounds x {args.epochs} epochs x "
        f"{args.batches} batches of {args.batch_size}",
        "",
        "| round | raw batches/s | watched batches/s | watched/raw |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for index, (r, w, q) in enumerate(zip(raw, watched, ratios, strict=True)):
        lines.append(f"| {index} | {r:.1f} | {w:.1f} | {q:.4f} |")
    lines += [
        "",
        f"median watched/raw: {ratio:.4f} (slowdown {(1 - ratio) * 100:+.2f}%; goal < 1%)",
        "",
        "What watch() adds, measured alone in the same run:",
        f"- per batch: {costs['per_batch_ns']:.0f} ns (one generator step)",
        f"- per epoch: {costs['epoch_boundary_ms']:.2f} ms at the epoch boundaries "
        f"({costs['epoch_boundary_pct_of_epoch']:.2f}% of a {epoch_ms:.0f} ms epoch)",
        f"- sampler thread: {costs['sampler_tick_ms']:.3f} ms per tick every "
        f"{args.interval * 1000:.0f} ms ({costs['sampler_cpu_pct_of_one_core']:.2f}% of one core)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_result(f"watch-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}", payload, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
