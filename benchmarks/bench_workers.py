"""The sweep's worker-count answer on this machine: throughput and memory per worker count.

Runs ``leakcheck sweep --json`` on the built-in workload (scenario ``clean``, then
``copy-on-read``) and records, per worker count, samples per second, the loop's share of time
waiting for batches and the memory each worker costs, with the sweep's recommendation (the
fewest workers within 5% of the best throughput). ``--write`` stores
``benchmarks/results/workers-<machine>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from results_io import host_meta, result_stem, write_result

MIB = 1024 * 1024
SCENARIOS = {"clean": [], "copy-on-read": ["--scenario", "copy-on-read"]}


def _sweep(extra: list[str], workers: str, epochs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "sweep.json")
        args = ["--workers", workers, "--epochs", str(epochs), "--json", path]
        done = subprocess.run(
            [sys.executable, "-m", "leakcheck", "sweep", *extra, *args],
            capture_output=True,
            text=True,
        )
        if done.returncode not in (0, 1):
            raise SystemExit(f"sweep failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(path) as handle:
            result: dict[str, Any] = json.load(handle)
            return result


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def _table(name: str, sweep: dict[str, Any]) -> list[str]:
    lines = [
        f"### {name}: {sweep['loader']}",
        "",
        "| workers | samples/s | waiting for batches | host MiB per worker | GPU MiB per worker "
        "| verdict |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for config in sweep["configurations"]:
        rate = config["throughput"] or {}
        wait = rate.get("wait_share")
        lines.append(
            f"| {config['num_workers']} | {rate.get('samples_per_s', 0):,.0f} | "
            f"{'-' if wait is None else f'{wait:.1%}'} | {_mib(rate.get('worker_host_bytes'))} | "
            f"{_mib(rate.get('worker_gpu_bytes'))} | {config['verdict']} |"
        )
    pick = sweep["recommendation"]
    if pick:
        lines += [
            "",
            f"Recommended: {pick['num_workers']} workers ({pick['rate_per_s']:,.0f} samples/s; "
            f"best {pick['best_workers']} at {pick['best_rate_per_s']:,.0f}); host "
            f"{_mib(pick['worker_host_bytes'])} MiB, GPU {_mib(pick['worker_gpu_bytes'])} MiB "
            "per worker.",
        ]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="0,2,4", help="worker counts (default 0,2,4)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="store the result")
    args = parser.parse_args()
    meta = host_meta()
    sweeps = {name: _sweep(extra, args.workers, args.epochs) for name, extra in SCENARIOS.items()}
    env = next(iter(sweeps.values()))["environment"]
    lines = [
        "# Worker counts: throughput and memory per worker (`leakcheck sweep`)",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), torch {env['torch']}, "
        f"GPUs: {', '.join(env['gpus']) or 'none'}; {args.epochs} epochs per worker count.",
        "",
    ]
    for name, sweep in sweeps.items():
        lines += _table(name, sweep)
    text = "\n".join(lines)
    print(text)
    if args.write:
        payload = {
            "meta": meta,
            "sweeps": {
                name: {key: sweep[key] for key in ("loader", "recommendation", "environment")}
                | {
                    "throughput": {
                        str(c["num_workers"]): c["throughput"] for c in sweep["configurations"]
                    }
                }
                for name, sweep in sweeps.items()
            },
        }
        print(write_result(result_stem("workers"), payload, text))


if __name__ == "__main__":
    main()
