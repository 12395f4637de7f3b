"""Pool the rounds of several ``bench_watch.py`` results: one A/B over all of them.

One run of ``bench_watch.py`` has few rounds, and a round's A/B varies by several times the
goal, so a single run cannot tell a 1% slowdown from none. Rounds of runs on the same loader
are alike (each compares adjacent blocks), so this pools them: the median slowdown over every
round of the given runs, its 95% bootstrap interval, and the accounted bound's median and
worst round. Runs of another variant than ``--variant``, or of other batches per epoch than
``--batches`` where given, are left out.

``benchmarks/results/`` holds only the current run per machine; earlier runs are its earlier
versions in git, taken out one file per run, e.g.::

    git log --format=%h -- benchmarks/results/watch-h200.md
    git show REV:benchmarks/results/watch-h200.md > /tmp/watch-h200-REV.md

Usage: python benchmarks/pool_watch.py FILE.md [FILE.md ...] [--batches 1000]
       [--variant watch] [--write NAME]
       (--write: the section "pooled" of benchmarks/results/NAME.md, e.g. watch-h200)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stats
from bench_watch import GOAL_PCT, VARIANTS
from results_io import ResultName, read_results, write_result


def _variant(result: dict[str, Any]) -> str:
    # Results written before --variant existed ran watch() as users get it.
    return str(result["meta"].get("variant", "watch"))


def _load(path: str) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = read_results(path)
    if not results or any("ratio_per_round" not in r or "meta" not in r for r in results.values()):
        raise ValueError(f"{path}: not a bench_watch.py result (no ratio_per_round)")
    return results


def _chosen(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    chosen = []
    for path in args.files:
        stem = os.path.basename(path).removesuffix(".md")
        for setting, result in _load(path).items():
            batches = result["meta"].get("batches_per_epoch")
            if args.batches is not None and batches != args.batches:
                continue
            if _variant(result) != args.variant:
                continue
            chosen.append((f"{stem} ({setting})", result))
    return chosen


def _table(chosen: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| result | batches | rounds | A/B slowdown [95% CI] | accounted median, worst |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    ratios: list[float] = []
    accounted: list[float] = []
    for stem, result in chosen:
        ab = stats.slowdown_summary(result["ratio_per_round"])
        run_accounted = [row["accounted_pct"] for row in result.get("rounds_detail", [])]
        ratios += result["ratio_per_round"]
        accounted += run_accounted
        bound = (
            f"{stats.format_pct(stats.summarize(run_accounted).median, signed=False)}, "
            f"{max(run_accounted):.3f}%"
            if run_accounted
            else "-"
        )
        lines.append(
            f"| {stem} | {result['meta'].get('batches_per_epoch')} | {ab.n} | "
            f"{stats.format_pct(ab.median)} {stats.format_ci(ab)} | {bound} |"
        )
    pooled = stats.slowdown_summary(ratios)
    lines.append(
        f"| **pooled** | | **{pooled.n}** | **{stats.format_pct(pooled.median)}** "
        f"{stats.format_ci(pooled)} | "
        + (
            f"{stats.format_pct(stats.summarize(accounted).median, signed=False)}, "
            f"{max(accounted):.3f}%"
            if accounted
            else "-"
        )
        + " |"
    )
    lines += [
        "",
        f"- pooled A/B verdict against the {GOAL_PCT:g}% goal: {stats.verdict(pooled, GOAL_PCT)}",
    ]
    if accounted:
        bound = stats.bound_verdict(stats.summarize(accounted), GOAL_PCT)
        lines.append(f"- accounted bound over all {len(accounted)} rounds: {bound}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("files", nargs="+", help="bench_watch.py result files (.md)")
    parser.add_argument("--batches", type=int, default=None, help="only runs of this epoch")
    parser.add_argument("--variant", choices=VARIANTS, default="watch")
    parser.add_argument("--write", default=None, metavar="NAME", help="results/NAME.md (pooled)")
    args = parser.parse_args()
    try:
        chosen = _chosen(args)
    except (OSError, ValueError) as error:
        parser.error(str(error).splitlines()[0])
    if not chosen:
        parser.error("no bench_watch.py result matches the filters given")
    text = "\n".join(
        [
            f"# watch(loader) vs raw loader, pooled: {len(chosen)} runs, variant {args.variant}",
            "",
            "Command: `python benchmarks/pool_watch.py " + " ".join(sys.argv[1:]) + "`",
            "",
            *_table(chosen),
        ]
    )
    print(text)
    if args.write is not None:
        print("wrote", write_result(ResultName(args.write, "pooled"), None, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
