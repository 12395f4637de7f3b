"""The sweep's own cost: the same loaders iterated with and without leakcheck, in one run.

For each worker count, a run builds the built-in workload's DataLoader and iterates it for
E epochs, bare or through ``WatchedLoader`` exactly as ``leakcheck sweep`` does (one tracker
per configuration, each ``iter()`` one epoch, workers known from the mailbox of the chained
``worker_init_fn``, sampling every 50 ms or ``--interval``). Each repeat is four runs,
bare, tracked, tracked, bare (the next repeat: tracked, bare, bare, tracked), so that a
steady drift (clocks, temperature, page cache) falls on both arms alike. Goal: the tracker
under 2% of the epochs' wall time. Two measures of it, per configuration, side by side
(``benchmarks/stats.py`` explains both):

* A/B: per repeat, its two bare and two tracked runs give a speed ratio bare s / tracked s
  (each arm's two runs summed), of the epochs (what a training loop pays) and of the whole
  configuration (loader, epochs, tracker start, close and report); the median slowdown
  ``1 - ratio`` in % over repeats, with its 95% bootstrap interval (with 3 repeats the
  interval is about their range: the honest answer that 3 repeats resolve little).
* Accounted cost: what the tracker itself spent, from ``tracker.cost()``:
  ``(caller_wall_s + sampler_cpu_s) / tracked epochs wall s``, the counters read just before
  the first epoch and just after the last; and over the whole configuration, adding the
  caller's own timing of the tracker's construction, start and report. The caller's time in
  tracker calls is paid in full; the sampler thread delays the loop at most by its CPU time
  (the GIL) where there are spare cores; so this bounds that part of the slowdown and does
  not drown in run-to-run noise. It does not see the workers waiting on the driver while
  the sampler's NVML calls run (``benchmarks/stats.py``).

``--tracker-nvml`` is a diagnostic that separates NVML's share of the A/B from the rest:
``full`` (the default, as users run it), ``memory`` (the tracker reads the devices' used
memory but never the per-process lists: every list comes back empty), ``off`` (a tracker
with ``use_nvml=False``, host-side only). Only ``full`` measures leakcheck as shipped.
``--nvml-share`` is another: the share of the time the sampler's NVML reads may work in the
driver, by their CPU time (NOTE [nvml pacing] in leakcheck/track/tracker.py); 1 reads on nearly
every tick whatever the reads cost.
Each repeat also shows the wall time of the tracker's NVML reads (``TrackerCost.nvml_wall_s``,
waits included: while the workers start and compute, those reads hold a driver lock the
workers may wait for) and their CPU time (``nvml_cpu_s``).

With persistent workers, the tracked run also times ``Tracker.sample()`` 20 times while the
workers are alive (the sampler's per-tick path); that probe is the benchmark's own, so its
wall time and its cost are left out of the total and of the accounted cost.

The loaders are identical in both arms: the teardown policy is off in both by default
(``--teardown`` turns it on in both: the bare arm installs ``leakcheck.worker_init_fn()``
itself), so only the measuring is compared; tracked workers still post their identity and
what they held at exit to the mailbox, which is part of what leakcheck costs.

Usage: python benchmarks/bench_sweep.py [--workers 0,4,8] [--epochs 3] [--repeats 5]
       [--batches 128] [--features 1024] [--start-method spawn] [--teardown] [--write]
       (--write: benchmarks/results/sweep-<machine>.md, see results_io.py; rewritten
       after each configuration, so a run stopped at a time limit keeps what it finished)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nvml_share
import stats
from results_io import gpu_meta, host_meta, result_stem, write_result

import leakcheck
from leakcheck.adapters.dataloader import WatchedLoader
from leakcheck.commands.workload import WorkloadSpec, builtin_factory
from leakcheck.core.model import GpuProcess
from leakcheck.observe import nvml
from leakcheck.track.tracker import Tracker

GOAL_PCT = 2.0
PROBE_SAMPLES = 20


def _iterate(loader: Any) -> int:
    """One epoch: bare, or through ``WatchedLoader`` (each ``iter()`` is one epoch)."""
    batches = 0
    for _ in loader:
        batches += 1
    return batches


def _run(
    spec: WorkloadSpec,
    workers: int,
    epochs: int,
    tracked: bool,
    *,
    interval_s: float = 0.05,
    use_nvml: bool = True,
    teardown: bool = False,
) -> dict[str, Any]:
    """One configuration, bare or tracked: wall seconds of the epochs and of everything.

    ``interval_s`` and ``use_nvml`` (with ``spec.gpu``) configure the tracked arm's tracker;
    ``teardown`` installs the teardown policy, in either arm (``--teardown``).

    Tracked, also what the tracker spent: over the epochs (``epochs_cost``) and over the
    whole configuration (``total_cost``, with ``own_s``: construction, start and report,
    timed here), the probe of ``Tracker.sample()`` left out of both and of ``total_s``.
    """
    started = time.perf_counter()
    tracker = None
    own_s = 0.0
    loader: Any = builtin_factory(spec)(workers)
    if tracked:
        tracker = Tracker(
            interval=interval_s,
            grace=2.0,
            persistent_workers=spec.persistent_workers and workers > 0,
            use_nvml=spec.gpu and use_nvml,
        )
        # As the sweep: the wrapper starts the tracker and chains the worker_init_fn.
        loader = WatchedLoader(loader, tracker=tracker, on_leak="ignore", teardown=teardown)
        loader.__enter__()
        own_s += time.perf_counter() - started
        after_start = stats.cost_counters(tracker)
    elif teardown and workers > 0:
        loader.worker_init_fn = leakcheck.worker_init_fn()
    epochs_s = 0.0
    if tracker is not None:
        before_epochs = stats.cost_counters(tracker)
    for _ in range(epochs):
        epoch_start = time.perf_counter()
        _iterate(loader)
        epochs_s += time.perf_counter() - epoch_start
    result: dict[str, Any] = {"epochs_s": epochs_s}
    probe_s = 0.0
    probe = dict.fromkeys(stats.COST_FIELDS, 0.0)
    if tracker is not None:
        result["epochs_cost"] = stats.cost_delta(before_epochs, stats.cost_counters(tracker))
        if spec.persistent_workers and workers:
            # Workers are alive between epochs: time the sampler's per-tick path on them.
            probe_start = time.perf_counter()
            before_probe = stats.cost_counters(tracker)
            sample_ms: list[float] = []
            for _ in range(PROBE_SAMPLES):
                tick = time.perf_counter()
                tracker.sample()
                sample_ms.append((time.perf_counter() - tick) * 1000)
            probe = stats.cost_delta(before_probe, stats.cost_counters(tracker))
            probe_s = time.perf_counter() - probe_start
            result["sample_ms"] = statistics.median(sample_ms)
    if tracker is not None:
        loader.drop_loader()  # persistent workers stop while tracked, as in the sweep
    del loader
    gc.collect()
    if tracker is not None:
        tracker.close()
        closed = stats.cost_counters(tracker)
        report_start = time.perf_counter()
        tracker.report()
        own_s += time.perf_counter() - report_start
        # The sampler's CPU from its start; the caller's counter from after start(), whose
        # time is in own_s (whether or not the counter includes it).
        total_cost = stats.cost_delta(after_start, closed)
        total_cost["sampler_cpu_s"] = closed["sampler_cpu_s"]
        result["total_cost"] = stats.cost_delta(probe, total_cost)
        result["own_s"] = own_s
    result["total_s"] = time.perf_counter() - started - probe_s
    return result


def _spent_s(cost: dict[str, float]) -> float:
    return cost["caller_wall_s"] + cost["sampler_cpu_s"]


def _by_repeat(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One arm's runs, two per repeat, summed per repeat (times and costs)."""
    merged: list[dict[str, Any]] = []
    for first, second in zip(runs[::2], runs[1::2], strict=True):
        both: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, dict):
                both[key] = {name: value[name] + second[key][name] for name in value}
            elif key != "sample_ms":
                both[key] = value + second[key]
        merged.append(both)
    return merged


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _configuration(
    runs: dict[str, list[dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, stats.Summary]]:
    """Medians per arm, per-repeat pairs, A/B and accounted summaries with verdicts.

    Returns the JSON-able entry and the summaries themselves (for the Markdown).
    """
    entry: dict[str, Any] = {"raw": runs}
    for key in ("epochs_s", "total_s"):
        bare_s = _median([r[key] for r in runs["bare"]])
        tracked_s = _median([r[key] for r in runs["tracked"]])
        entry[key] = {"bare": bare_s, "tracked": tracked_s, "ratio": tracked_s / bare_s}
    samples = [r["sample_ms"] for r in runs["tracked"] if "sample_ms" in r]
    entry["sample_ms"] = _median(samples) if samples else None
    repeats: list[dict[str, Any]] = []
    for bare, tracked in zip(_by_repeat(runs["bare"]), _by_repeat(runs["tracked"]), strict=True):
        repeats.append(
            {
                "epochs_cost": tracked["epochs_cost"],
                "epochs_speed_ratio": bare["epochs_s"] / tracked["epochs_s"],
                "total_speed_ratio": bare["total_s"] / tracked["total_s"],
                "accounted_epochs_pct": _spent_s(tracked["epochs_cost"])
                / tracked["epochs_s"]
                * 100,
                "accounted_total_pct": (_spent_s(tracked["total_cost"]) + tracked["own_s"])
                / tracked["total_s"]
                * 100,
                "nvml_epochs_pct": tracked["epochs_cost"]["nvml_wall_s"]
                / tracked["epochs_s"]
                * 100,
            }
        )
    entry["repeats"] = repeats
    measures = {
        "ab_epochs": stats.slowdown_summary([r["epochs_speed_ratio"] for r in repeats]),
        "ab_total": stats.slowdown_summary([r["total_speed_ratio"] for r in repeats]),
        "accounted_epochs": stats.summarize([r["accounted_epochs_pct"] for r in repeats]),
        "accounted_total": stats.summarize([r["accounted_total_pct"] for r in repeats]),
        "nvml_epochs": stats.summarize([r["nvml_epochs_pct"] for r in repeats]),
    }
    for name, summary in measures.items():
        if name == "nvml_epochs":
            entry[name] = summary.to_dict()  # a diagnostic, not judged against the goal
            continue
        judge = stats.bound_verdict if name.startswith("accounted") else stats.verdict
        entry[name] = {**summary.to_dict(), "verdict": judge(summary, GOAL_PCT)}
    return entry, measures


MEASURES = (
    ("ab_epochs", "A/B slowdown, epochs", True),
    ("accounted_epochs", "accounted cost, epochs (GIL and CPU bound)", False),
    ("ab_total", "A/B slowdown, whole configuration", True),
    ("accounted_total", "accounted cost, whole configuration (GIL and CPU bound)", False),
)


def _render(
    meta: dict[str, Any],
    results: dict[str, Any],
    summaries: dict[str, dict[str, stats.Summary]],
    args: argparse.Namespace,
) -> str:
    lines = [
        "# Sweep overhead: the same loaders with and without leakcheck's Tracker",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), GPU: {meta['gpu']}, "
        f"driver {meta.get('driver', '-')}, torch {meta['torch']}, python {meta['python']}, "
        f"leakcheck {meta['leakcheck']}",
        "",
        f"{args.batches} batches of 64x{args.features} per epoch, {args.epochs} epochs, "
        f"{args.repeats} repeats of four runs, sampling every {args.interval * 1000:g} ms, "
        f"start method {args.start_method}, teardown "
        f"{'on' if args.teardown else 'off'} in both arms; medians. Goal: tracker under "
        f"{GOAL_PCT:g}% of the epochs' wall time.",
    ]
    if args.tracker_nvml != "full":
        lines += [
            "",
            f"**Diagnostic: the tracked arm's NVML use is `{args.tracker_nvml}`, not what "
            "leakcheck does (`--tracker-nvml`).**",
        ]
    lines += nvml_share.banner(meta["nvml_share"])
    if not meta["complete"]:
        lines += ["", "**Partial: the run has not finished (or stopped) after these rows.**"]
    lines += [
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
    lines += [
        "",
        "Per repeat (four adjacent runs, b = bare, t = tracked; slowdown = 1 - bare s / "
        "tracked s, each arm's two runs summed; accounted "
        "= tracker caller wall + sampler CPU over the tracked wall time):",
        "",
        "| configuration | repeat | order | epochs slowdown | total slowdown | "
        "caller ms (2 runs) | sampler CPU ms (2 runs) | NVML wall / CPU ms (2 runs) | "
        "samples (2 runs) | "
        "accounted epochs | accounted total | NVML share of the epochs |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, entry in results.items():
        for index, pair in enumerate(entry["repeats"]):
            cost = pair["epochs_cost"]
            order = "b/t/t/b" if index % 2 == 0 else "t/b/b/t"
            lines.append(
                f"| {name} | {index} | {order} | "
                f"{stats.slowdown_pct(pair['epochs_speed_ratio']):+.2f}% | "
                f"{stats.slowdown_pct(pair['total_speed_ratio']):+.2f}% | "
                f"{cost['caller_wall_s'] * 1000:.1f} | {cost['sampler_cpu_s'] * 1000:.1f} | "
                f"{cost['nvml_wall_s'] * 1000:.1f} / {cost['nvml_cpu_s'] * 1000:.1f} | "
                f"{cost['samples']:.0f} | {pair['accounted_epochs_pct']:.3f}% | "
                f"{pair['accounted_total_pct']:.3f}% | {pair['nvml_epochs_pct']:.3f}% |"
            )
    lines += [
        "",
        f"## Summary (goal: the tracker under {GOAL_PCT:g}% of the wall time)",
        "",
        "| configuration | measure | median | 95% CI of the median | over repeats | verdict |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for name, entry in results.items():
        for key, label, signed in MEASURES:
            summary = summaries[name][key]
            spread = (
                f"{summary.minimum:+.2f}% .. {summary.maximum:+.2f}%"
                if signed
                else f"max {summary.maximum:.3f}%"
            )
            lines.append(
                f"| {name} | {label} | {stats.format_pct(summary.median, signed=signed)} | "
                f"{stats.format_ci(summary, signed=signed)} | {spread} | "
                f"{entry[key]['verdict']} |"
            )
    lines += [
        "",
        "A/B: median over repeats of the paired slowdown, percentile bootstrap of the median "
        f"({stats.RESAMPLES} resamples, seed {stats.SEED}). Accounted: read from "
        "tracker.cost(); bounds what the loop pays through the GIL and the CPU where the "
        "sampler thread has a spare core, not the workers' waits in the driver while NVML is "
        "read (benchmarks/stats.py). The goal applies to the epochs; the whole "
        "configuration's rows add the tracker's start, close (its grace wait) and report.",
    ]
    return "\n".join(lines)


def _meta(args: argparse.Namespace, gpu: bool, gpu_reason: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        **host_meta(),
        "leakcheck": leakcheck.__version__,
        "torch": None,
        "gpu": gpu_reason or "available",
        "workers": args.workers,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "batches": args.batches,
        "features": args.features,
        "start_method": args.start_method,
        "teardown": args.teardown,
        "tracker_nvml": args.tracker_nvml,
        "nvml_share": args.nvml_share_used,
        "interval_s": args.interval,
        "goal_pct": GOAL_PCT,
        "complete": False,
    }
    if gpu:
        meta.update(gpu_meta())
    return meta


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workers", default=None, help="default 0,4,8 with a GPU, 0,2 without")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=128)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--start-method", default="spawn")
    parser.add_argument("--teardown", action="store_true")
    parser.add_argument(
        "--interval", type=float, default=0.05, help="the tracker's sampling interval, s"
    )
    parser.add_argument(
        "--tracker-nvml",
        choices=["full", "memory", "off"],
        default="full",
        help="diagnostic: what of NVML the tracked arm reads (see the module docstring)",
    )
    nvml_share.add_argument(parser)
    parser.add_argument(
        "--persistent",
        choices=["both", "on", "off"],
        default="both",
        help="configurations with workers: persistent, per-epoch workers, or both",
    )
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.tracker_nvml == "memory":
        # Diagnostic only: every per-process list comes back empty in this process.
        def no_processes(
            self: nvml.Nvml, devices: Sequence[int] | None = None, *, graphics: bool = True
        ) -> tuple[GpuProcess, ...]:
            return ()

        nvml.Nvml.processes = no_processes  # type: ignore[method-assign]

    args.nvml_share_used = nvml_share.apply(parser, args)
    gpu, gpu_reason = nvml.availability()
    workers_text = args.workers or ("0,4,8" if gpu else "0,2")
    worker_counts = [int(part) for part in workers_text.split(",")]
    args.workers = worker_counts
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.persistent]
    base = WorkloadSpec(
        batches=args.batches,
        features=args.features,
        start_method=args.start_method,
        gpu=gpu,
    )
    meta = _meta(args, gpu, gpu_reason)
    stem = result_stem(
        "sweep",
        nvml_share.variant(args.nvml_share_used),
        "" if args.tracker_nvml == "full" else f"nvml-{args.tracker_nvml}",
    )
    results: dict[str, Any] = {}
    summaries: dict[str, dict[str, stats.Summary]] = {}
    for workers in worker_counts:
        # Persistent workers too, so the sampler's cost with live workers is measured.
        for persistent in modes if workers else (False,):
            spec = dataclasses.replace(base, persistent=persistent)
            name = f"{workers} workers" + (" persistent" if persistent else "")
            runs: dict[str, list[dict[str, Any]]] = {"bare": [], "tracked": []}
            # Warm-up: imports, page cache, CUDA.
            _run(spec, workers, 1, tracked=False, teardown=args.teardown)
            for repeat in range(args.repeats):
                pair = ("bare", "tracked") if repeat % 2 == 0 else ("tracked", "bare")
                for arm in (*pair, *reversed(pair)):
                    runs[arm].append(
                        _run(
                            spec,
                            workers,
                            args.epochs,
                            tracked=arm == "tracked",
                            interval_s=args.interval,
                            use_nvml=args.tracker_nvml != "off",
                            teardown=args.teardown,
                        )
                    )
            results[name], summaries[name] = _configuration(runs)
            ab, accounted = summaries[name]["ab_epochs"], summaries[name]["accounted_epochs"]
            print(
                f"{name}: epochs {results[name]['epochs_s']['bare']:.3f} s bare, "
                f"{results[name]['epochs_s']['tracked']:.3f} s tracked; A/B slowdown "
                f"{stats.format_pct(ab.median)} {stats.format_ci(ab)}, accounted "
                f"{stats.format_pct(accounted.median, signed=False)} "
                f"(max {accounted.maximum:.3f}%), NVML "
                f"{stats.format_pct(summaries[name]['nvml_epochs'].median, signed=False)} "
                "of the epochs",
                file=sys.stderr,
            )
            meta["torch"] = sys.modules["torch"].__version__ if "torch" in sys.modules else None
            if args.write:
                # After each configuration: a run stopped at a time limit keeps these.
                text = _render(meta, results, summaries, args)
                write_result(stem, {"meta": meta, "results": results}, text)

    meta["complete"] = True
    text = _render(meta, results, summaries, args)
    print(text)
    if args.write:
        path = write_result(stem, {"meta": meta, "results": results}, text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
