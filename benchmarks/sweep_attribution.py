"""Check sweeps' JSON for exact attribution: each worker's epoch peak against its own report.

For every worker of every epoch of every configuration, the epoch's peak per device
(``gpu_bytes_peak``) is compared with what the worker reported at exit
(``teardowns[].gpu_bytes_by_device``); the table gives how many are within 2 MiB, the largest
difference, workers without a report, and the tracker's accounted cost per configuration.

    python benchmarks/sweep_attribution.py sweep-1.json sweep-2.json ... [--write NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MIB = 2**20
WITHIN_BYTES = 2 * MIB


def _key(entry: dict[str, Any]) -> tuple[int, float]:
    # Start ticks since report schema 3; a sweep saved before names processes by create time.
    return int(entry["pid"]), float(entry.get("start_ticks", entry.get("create_time", 0)))


def check(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration of one sweep."""
    rows = []
    for config in sweep["configurations"]:
        report = config["report"]
        reported = {
            _key(t["key"]): {int(d): int(b) for d, b in (t["gpu_bytes_by_device"] or {}).items()}
            for t in report["teardowns"]
            if t.get("gpu_bytes_by_device") is not None
        }
        within = unreported = unknown = 0
        worst = 0
        for epoch in report["epochs"]:
            for proc in epoch["processes"]:
                if proc["role"] != "worker":
                    continue
                held = reported.get(_key(proc["key"]))
                if proc["gpu_peak_source"] == "unknown":
                    unknown += 1
                if held is None:
                    unreported += 1
                    continue
                peak = {int(d): int(b) for d, b in proc["gpu_bytes_peak"].items()}
                devices = set(peak) | set(held)
                gap = max((abs(peak.get(d, 0) - held.get(d, 0)) for d in devices), default=0)
                worst = max(worst, gap)
                within += gap <= WITHIN_BYTES
        rows.append(
            {
                "workers": config["num_workers"],
                "verdict": config["verdict"],
                "within_2mib": within,
                "unreported": unreported,
                "unknown": unknown,
                "worst_gap_mib": worst / MIB,
                "accounted_pct": (config.get("accounted_cost_fraction") or 0.0) * 100,
                "caller_ms_per_epoch": (
                    (config.get("tracker_cost") or {}).get("caller_wall_s", 0.0)
                    * 1000
                    / max(1, len(report["epochs"]))
                ),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--write", type=Path, help="also write the table to this .md file")
    args = parser.parse_args(argv)
    lines = [
        "| sweep | workers | verdict | workers within 2 MiB of their report | no report "
        "| unknown peak | largest gap MiB | accounted cost | caller ms per epoch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in args.files:
        try:
            sweep = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"sweep_attribution: {path}: {exc}", file=sys.stderr)
            return 2
        for row in check(sweep):
            lines.append(
                f"| {path.stem} | {row['workers']} | {row['verdict']} | {row['within_2mib']} "
                f"| {row['unreported']} | {row['unknown']} | {row['worst_gap_mib']:.1f} "
                f"| {row['accounted_pct']:.2f}% | {row['caller_ms_per_epoch']:.1f} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
