"""``leakcheck run -- python train.py`` against ``python train.py``: what tracking costs.

The program is ``benchmarks/run_workload.py``, a small training script as users write it (a
train loader whose workers start each epoch, a validation loader, an MLP step per batch):
bare, and under ``leakcheck run --json``. Each round runs the two arms in the order bare,
run, run, bare (the next round mirrored), so a speed that drifts through the run weighs the
same on both sides; ``--warmup`` rounds are not counted. Three measures, side by side
(``benchmarks/stats.py`` explains the first two):

* whole process: the wall time of the command, start to exit, as a user waits for it
  (interpreter and torch start-up, the launcher, the report at the end included): the
  median over rounds of run/bare, with its 95% bootstrap interval;
* training loop: the loop's own wall time, which the script prints (from before its first
  epoch to after its last), run/bare: the A/B of what the loop pays;
* accounted cost: what the loaders' trackers inside the program spent during the loop,
  from the ``cost`` the shim writes into the run's JSON report (taken when the program's
  exit began, before the trackers are closed), over the loop's wall time::

      (sum over loaders of caller_wall_s + sampler_cpu_s + batches * per_batch_ns) / loop s

  where ``per_batch_ns`` (the patched ``__iter__``'s generator step) is measured alone in
  this process. The outside tracker runs in the launcher, another process: its CPU time is
  shown over the program's wall time, apart (on a machine without a spare core it competes
  with the program for one).

Also shown per round: the fixed costs of a run, the program's wall time between its start
and its end as the launcher saw it, the loaders' exit work (close, report, write), and
what the launcher added after the program ended (the tree's grace wait, reading and
printing the reports) = whole-process run time - program wall time - launcher start-up.

Usage: python benchmarks/bench_run.py [--epochs 4] [--workers 2] [--rounds 8] [--warmup 1]
       [--write]  (benchmarks/results/run-<machine>.md, see results_io.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stats
from results_io import host_meta, machine, result_stem, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = os.path.join(ROOT, "benchmarks", "run_workload.py")
GOAL_PCT = 1.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEAKCHECK_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def _run_arm(arm: str, epochs: int, workers: int, folder: str) -> dict[str, Any]:
    """One run of the workload; its wall time, the loop's, and (run) the JSON report."""
    program = [sys.executable, WORKLOAD, str(epochs), str(workers)]
    json_path = os.path.join(folder, "run.json")
    command = program
    if arm == "run":
        command = [sys.executable, "-m", "leakcheck", "run", "--json", json_path, "--", *program]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT)
    wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("{"))
    result: dict[str, Any] = {"wall_s": wall_s, **json.loads(line)}
    if arm == "run":
        with open(json_path) as handle:
            report = json.load(handle)
        os.unlink(json_path)
        result["program_wall_s"] = report["wall_s"]
        result["loaders"] = [
            {"label": item["label"], "cost": item["cost"], "exit_s": item["exit_s"]}
            for item in report["loaders"]
        ]
        result["tree_cost"] = report["tree"]["cost"]
        result["leak_count"] = report["leak_count"]
    return result


def _per_batch_ns(batches: int = 200_000) -> float:
    """The patched ``__iter__``'s step per batch, alone: its epoch iterator over a list."""
    from leakcheck.adapters.dataloader import EpochJudge, epoch_batches
    from leakcheck.commands.instrument import _EpochIterator
    from leakcheck.track.tracker import Tracker

    items = list(range(batches))
    tracker = Tracker(interval=3600.0)
    tracker.start()
    try:
        best_raw = best_run = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _item in items:
                pass
            best_raw = min(best_raw, time.perf_counter() - started)
            judge = EpochJudge(tracker, "ignore", None)
            stream = epoch_batches(items, lambda: iter(items), judge, release=False)
            epoch = _EpochIterator(items, [], stream)
            started = time.perf_counter()
            for _item in epoch:
                pass
            best_run = min(best_run, time.perf_counter() - started)
    finally:
        tracker.close()
    return max(best_run - best_raw, 0.0) / batches * 1e9


def _launcher_start_s(rounds: int = 5) -> float:
    """Start-up of ``python -m leakcheck run --help`` (interpreter, argparse, leakcheck)."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "leakcheck", "run", "--help"],
            capture_output=True,
            env=_env(),
            check=True,
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _accounted_pct(run: dict[str, Any], per_batch_ns: float) -> float:
    spent = sum(
        item["cost"]["caller_wall_s"] + item["cost"]["sampler_cpu_s"] for item in run["loaders"]
    )
    spent += run["batches"] * per_batch_ns * 1e-9
    return float(spent / run["loop_s"] * 100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    per_batch_ns = _per_batch_ns()
    launcher_s = _launcher_start_s()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-run-") as folder:
        for index in range(args.warmup + args.rounds):
            order = (
                ["bare", "run", "run", "bare"] if index % 2 == 0 else ["run", "bare", "bare", "run"]
            )
            results: dict[str, list[dict[str, Any]]] = {"bare": [], "run": []}
            for arm in order:
                results[arm].append(_run_arm(arm, args.epochs, args.workers, folder))
            if index < args.warmup:
                continue
            bare, run = results["bare"], results["run"]
            row = {
                "order": "/".join(order),
                "bare_wall_s": sum(r["wall_s"] for r in bare) / 2,
                "run_wall_s": sum(r["wall_s"] for r in run) / 2,
                "bare_loop_s": sum(r["loop_s"] for r in bare) / 2,
                "run_loop_s": sum(r["loop_s"] for r in run) / 2,
                "program_wall_s": sum(r["program_wall_s"] for r in run) / 2,
                "accounted_pct": max(_accounted_pct(r, per_batch_ns) for r in run),
                "tree_cpu_pct": max(
                    r["tree_cost"]["sampler_cpu_s"] / r["program_wall_s"] * 100 for r in run
                ),
                "loader_exit_ms": max(sum(i["exit_s"] for i in r["loaders"]) for r in run) * 1e3,
                "batches": run[0]["batches"],
                "leaks": max(r["leak_count"] for r in run),
                "runs": {"bare": bare, "run": run},
            }
            row["whole_ratio"] = row["run_wall_s"] / row["bare_wall_s"]
            row["loop_ratio"] = row["run_loop_s"] / row["bare_loop_s"]
            row["after_program_s"] = row["run_wall_s"] - row["program_wall_s"] - launcher_s
            rounds.append(row)
            print(
                f"round {len(rounds) - 1}: whole {row['bare_wall_s']:.2f} -> "
                f"{row['run_wall_s']:.2f} s, loop {row['bare_loop_s']:.2f} -> "
                f"{row['run_loop_s']:.2f} s, accounted {row['accounted_pct']:.2f}%",
                file=sys.stderr,
            )

    # Ratios of wall times (run / bare): > 1 is slower; as % extra time.
    whole = stats.summarize([(r["whole_ratio"] - 1) * 100 for r in rounds])
    loop = stats.summarize([(r["loop_ratio"] - 1) * 100 for r in rounds])
    accounted = stats.summarize([r["accounted_pct"] for r in rounds])
    extra_s = stats.summarize([r["run_wall_s"] - r["bare_wall_s"] for r in rounds])
    import torch

    meta = {
        **host_meta(),
        "torch": torch.__version__,
        "epochs": args.epochs,
        "workers": args.workers,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "per_batch_ns": per_batch_ns,
        "launcher_start_s": launcher_s,
    }
    text = _markdown(meta, rounds, whole, loop, accounted, extra_s)
    print(text)
    if args.write:
        payload = {
            "meta": meta,
            "rounds": rounds,
            "summary": {
                "whole_extra_pct": asdict(whole),
                "loop_extra_pct": asdict(loop),
                "accounted_pct": asdict(accounted),
                "whole_extra_s": asdict(extra_s),
            },
        }
        print("wrote", write_result(result_stem("run"), payload, text), file=sys.stderr)


def _markdown(
    meta: dict[str, Any],
    rounds: list[dict[str, Any]],
    whole: stats.Summary,
    loop: stats.Summary,
    accounted: stats.Summary,
    extra_s: stats.Summary,
) -> str:
    lines = [
        f"# leakcheck run vs the bare program: {machine()}",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), torch {meta['torch']}, "
        f"python {meta['python']}; benchmarks/run_workload.py {meta['epochs']} epochs, "
        f"{meta['workers']} train workers per epoch + 1 val worker; {meta['rounds']} rounds "
        f"(bare/run/run/bare, mirrored), {meta['warmup']} warm-up round(s) not counted",
        "",
        "| round | order | bare s | run s | run/bare | bare loop s | run loop s | loop run/bare "
        "| program s (seen by the launcher) | after the program s | loaders' exit ms "
        "| accounted (loop) | outside tracker CPU | leaks |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for index, row in enumerate(rounds):
        lines.append(
            f"| {index} | {row['order']} | {row['bare_wall_s']:.3f} | {row['run_wall_s']:.3f} "
            f"| {row['whole_ratio']:.4f} | {row['bare_loop_s']:.3f} | {row['run_loop_s']:.3f} "
            f"| {row['loop_ratio']:.4f} | {row['program_wall_s']:.3f} "
            f"| {row['after_program_s']:.3f} | {row['loader_exit_ms']:.1f} "
            f"| {row['accounted_pct']:.3f}% | {row['tree_cpu_pct']:.3f}% | {row['leaks']} |"
        )
    lines += [
        "",
        "## Summary",
        "",
        "| measure | median | 95% CI of the median | over rounds |",
        "| --- | ---: | ---: | ---: |",
        f"| whole process, run/bare - 1 | {stats.format_pct(whole.median)} | "
        f"{stats.format_ci(whole)} | {stats.format_pct(whole.minimum)} .. "
        f"{stats.format_pct(whole.maximum)} |",
        f"| whole process, run - bare | {extra_s.median:+.3f} s | "
        f"[{extra_s.ci_low:+.3f}, {extra_s.ci_high:+.3f}] s | {extra_s.minimum:+.3f} .. "
        f"{extra_s.maximum:+.3f} s |",
        f"| training loop, run/bare - 1 | {stats.format_pct(loop.median)} | "
        f"{stats.format_ci(loop)} | {stats.format_pct(loop.minimum)} .. "
        f"{stats.format_pct(loop.maximum)} |",
        f"| accounted cost in the loop (loaders' trackers) | "
        f"{stats.format_pct(accounted.median, signed=False)} | "
        f"{stats.format_ci(accounted, signed=False)} | max "
        f"{stats.format_pct(accounted.maximum, signed=False)} |",
        "",
        f"- accounted: (loaders' caller wall s + sampler CPU s + batches x "
        f"{meta['per_batch_ns']:.0f} ns per batch) / the loop's wall s, from the cost the "
        "shim wrote into the run's JSON (taken as the program's exit began); the worst of "
        "the round's two runs. Goal of watch(): under "
        f"{GOAL_PCT:g}%: {stats.bound_verdict(accounted, GOAL_PCT)} (every round).",
        "- outside tracker CPU: the launcher's sampler thread, another process, over the "
        "program's wall time; on this machine it competes with the program for 2 cores.",
        f"- launcher start-up (python -m leakcheck run --help): {meta['launcher_start_s']:.3f} s; "
        "'after the program' = run wall - program wall - that: the tree's close (no grace "
        "wait when nothing outlived the program), reading and printing the reports, the JSON.",
        "- whole process includes the fixed costs of a run: the launcher's start-up, the shim "
        "in each Python start (a compile of 10 KiB where bytecode is not cached), leakcheck's "
        "import in the program at the first iteration, the trackers' exit work and the report.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
