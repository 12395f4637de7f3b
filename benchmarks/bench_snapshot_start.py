"""Whole-process wall time of ``leakcheck snapshot``, beside the interpreter's own start.

Issue 18, item 4: leakcheck's own share of a snapshot (its median wall time less that of
``python -c pass`` in the same environment) should be at most 30 ms on the GPU machine, with
``nvidia-smi --query-compute-apps`` beside it. Measured in one run, interleaved rounds (the
order rotates each round), after two warm-up rounds that are not counted:
- ``python -c pass`` and ``python -S -c pass``: the interpreter's start, with and without site;
- ``python -m leakcheck snapshot``: this checkout's leakcheck (PYTHONPATH set to it);
- ``leakcheck snapshot``: the console script next to this Python, where one is installed;
- ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv``: where nvidia-smi exists.

The own share's interval is a bootstrap over rounds (each resample takes whole rounds, so the
two medians come from the same rounds). ``--importtime`` adds one ``python -X importtime -m
leakcheck snapshot`` run: the modules it imports beyond ``python -c pass``, and the slowest.
``--phases`` adds where a snapshot's time goes inside the process, median over fresh
processes, as the command runs (NVML started on a thread before the snapshot's imports): its
imports, the read and its /proc scan, the text, and each NVML call by name (beside the rest).

leakcheck's bytecode is compiled first, as ``pip install`` does for an installed package
(``--from-source`` leaves it as it is: with ``PYTHONDONTWRITEBYTECODE`` set, every start then
compiles leakcheck's modules again, a cost no installed copy pays).

Usage: python benchmarks/bench_snapshot_start.py [--rounds 15] [--importtime] [--phases N]
       [--from-source]
       [--out PATH.md | --write]  (--write: benchmarks/results/snapshot-start-<machine>.md)
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import host_meta, result_stem, write_result
from stats import quantile

REPO = Path(__file__).resolve().parents[1]
GOAL_MS = 30.0
WARMUP_ROUNDS = 2
RESAMPLES = 2000


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def commands() -> dict[str, list[str]]:
    """The commands timed, by label (those whose program is missing are left out)."""
    python = sys.executable
    found = {
        "python -c pass": [python, "-c", "pass"],
        "python -S -c pass": [python, "-S", "-c", "pass"],
        "python -m leakcheck snapshot": [python, "-m", "leakcheck", "snapshot"],
    }
    script = Path(python).with_name("leakcheck")
    if script.exists():
        found["leakcheck snapshot (console script)"] = [str(script), "snapshot"]
    smi = shutil.which("nvidia-smi")
    if smi:
        found["nvidia-smi --query-compute-apps"] = [
            smi,
            "--query-compute-apps=pid,used_memory",
            "--format=csv",
        ]
    return found


def time_once(command: list[str], env: dict[str, str]) -> float:
    """Wall milliseconds of one run; the command must succeed."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = (time.perf_counter() - start) * 1000.0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-500:]!r}")
    return elapsed


def measure(rounds: int) -> dict[str, list[float]]:
    """Per-command wall times, one per round, interleaved with a rotating order."""
    env = _env()
    found = commands()
    labels = list(found)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(WARMUP_ROUNDS + rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            elapsed = time_once(found[label], env)
            if round_index >= WARMUP_ROUNDS:
                times[label].append(elapsed)
    return times


def own_share(snapshot: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """Median of the snapshot less median of the baseline, and a 95% bootstrap interval."""
    share = statistics.median(snapshot) - statistics.median(baseline)
    rng = random.Random(18)
    count = len(snapshot)
    draws = []
    for _ in range(RESAMPLES):
        picks = [rng.randrange(count) for _ in range(count)]
        draws.append(
            statistics.median(snapshot[i] for i in picks)
            - statistics.median(baseline[i] for i in picks)
        )
    draws.sort()
    return share, quantile(draws, 0.025), quantile(draws, 0.975)


def import_breakdown(top: int = 15) -> dict[str, Any]:
    """One ``-X importtime`` run of the snapshot against ``python -c pass``."""

    def modules(args: list[str]) -> list[tuple[str, int, int]]:
        run = subprocess.run(
            [sys.executable, "-X", "importtime", *args],
            env=_env(),
            capture_output=True,
            text=True,
        )
        rows = []
        for line in run.stderr.splitlines():
            if not line.startswith("import time:") or "|" not in line:
                continue
            own, total, name = line.removeprefix("import time:").split("|")
            if own.strip().isdigit():
                rows.append((name.strip(), int(own), int(total)))
        return rows

    baseline = {name for name, _, _ in modules(["-c", "pass"])}
    snapshot = modules(["-m", "leakcheck", "snapshot"])
    extra = [row for row in snapshot if row[0] not in baseline]
    return {
        "modules_beyond_python_c_pass": len(extra),
        "leakcheck_modules": sorted(name for name, _, _ in extra if name.startswith("leakcheck")),
        "own_us_sum": sum(own for _, own, _ in extra),
        "slowest_own_us": sorted(extra, key=lambda row: -row[1])[:top],
    }


# Run in a fresh process per sample: every NVML function the snapshot calls is wrapped to time
# it by name (before leakcheck's NVML module can cache a pointer), then the phases are timed.
_PHASES_SCRIPT = r"""
import json, sys, time
start = time.perf_counter()
from leakcheck.observe import nvml_lib
calls = {}
real = nvml_lib._nvmlGetFunctionPointer
def timed(name):
    function = real(name)
    def call(*args):
        began = time.perf_counter()
        try:
            return function(*args)
        finally:
            calls[name] = calls.get(name, 0.0) + time.perf_counter() - began
    return call
nvml_lib._nvmlGetFunctionPointer = timed
real_init = nvml_lib.nvmlInit
def init():
    began = time.perf_counter()
    try:
        real_init()
    finally:
        # Less nvmlInit_v2's own time, timed inside: what is left is loading the library.
        elapsed = time.perf_counter() - began
        calls["(load libnvidia-ml)"] = elapsed - calls.get("nvmlInit_v2", 0.0)
nvml_lib.nvmlInit = init
import leakcheck.commands.cli
from leakcheck.observe import nvml
nvml.start_in_background()  # as the command does, before the snapshot's imports
from leakcheck.observe import procs
scans = []
real_scan_all = procs.scan_all
def scan_all(**kwargs):
    began = time.perf_counter()
    try:
        return real_scan_all(**kwargs)
    finally:
        scans.append(time.perf_counter() - began)
procs.scan_all = scan_all
from leakcheck.observe.snapshot import take_snapshot
imported = time.perf_counter()
snapshot = take_snapshot(telemetry=False)  # as the command reads without --telemetry
taken = time.perf_counter()
text = snapshot.format()
done = time.perf_counter()
print(json.dumps({"imports_ms": (imported - start) * 1e3, "read_ms": (taken - imported) * 1e3,
                  "scan_ms": sum(scans) * 1e3, "text_ms": (done - taken) * 1e3,
                  "calls_ms": {name: value * 1e3 for name, value in calls.items()}}))
"""


def phase_breakdown(samples: int) -> dict[str, Any]:
    """Medians over ``samples`` fresh processes of the phases of one snapshot."""
    runs = []
    for _ in range(samples):
        done = subprocess.run(
            [sys.executable, "-c", _PHASES_SCRIPT], env=_env(), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"phases: {done.stderr.strip().splitlines()[-1:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    names = sorted({name for run in runs for name in run["calls_ms"]})
    calls = {
        name: statistics.median(run["calls_ms"].get(name, 0.0) for run in runs) for name in names
    }
    nvml_ms = [sum(run["calls_ms"].values()) for run in runs]
    return {
        "samples": samples,
        "imports_ms": statistics.median(run["imports_ms"] for run in runs),
        "nvml_ms": statistics.median(nvml_ms),
        "read_ms": statistics.median(run["read_ms"] for run in runs),
        "scan_ms": statistics.median(run["scan_ms"] for run in runs),
        "text_ms": statistics.median(run["text_ms"] for run in runs),
        "calls_ms": dict(sorted(calls.items(), key=lambda item: -item[1])),
    }


def bytecode_note() -> str:
    cached = any((REPO / "leakcheck" / "commands" / "__pycache__").glob("cli.*.pyc"))
    writes = "PYTHONDONTWRITEBYTECODE set" if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""
    state = "leakcheck's bytecode cached" if cached else "leakcheck compiled from source each run"
    return ", ".join(filter(None, [state, writes]))


def render(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [
        "# leakcheck snapshot: whole-process start",
        "",
        f"{meta['date']} on {meta['host']} ({meta['cpu_count']} CPUs), python {meta['python']}, "
        f"{data['rounds']} interleaved rounds after {WARMUP_ROUNDS} warm-up; "
        f"{data['bytecode']}",
        "",
        "| command | median ms | p90 ms |",
        "| --- | ---: | ---: |",
    ]
    for label, row in data["commands"].items():
        lines.append(f"| `{label}` | {row['median_ms']:.1f} | {row['p90_ms']:.1f} |")
    share = data["own_share"]
    gpu = "nvidia-smi --query-compute-apps" in data["commands"]
    met = "yes" if share["ms"] <= GOAL_MS else "no"
    verdict = f"met here: {met}" if gpu else "not judged here (no GPU: NVML's reads are missing)"
    lines += [
        "",
        f"leakcheck's own share (snapshot median less `python -c pass` median): "
        f"**{share['ms']:.1f} ms** [95% bootstrap {share['low_ms']:.1f}, "
        f"{share['high_ms']:.1f}]; goal <= {GOAL_MS:.0f} ms on the GPU machine, {verdict}",
    ]
    imports = data.get("imports")
    if imports:
        lines += [
            "",
            f"`-X importtime`: {imports['modules_beyond_python_c_pass']} modules beyond "
            f"`python -c pass` ({imports['own_us_sum'] / 1000:.1f} ms of their own time), "
            f"leakcheck's: {', '.join(imports['leakcheck_modules'])}",
            "",
            "| module | own ms | cumulative ms |",
            "| --- | ---: | ---: |",
        ]
        for name, own, total in imports["slowest_own_us"]:
            lines.append(f"| {name} | {own / 1000:.2f} | {total / 1000:.2f} |")
    phases = data.get("phases")
    if phases:
        lines += [
            "",
            f"Inside the process (median of {phases['samples']} fresh processes), as the "
            f"command runs: imports {phases['imports_ms']:.1f} ms, the read "
            f"{phases['read_ms']:.1f} ms (its /proc scan {phases['scan_ms']:.1f} ms), the text "
            f"{phases['text_ms']:.1f} ms; NVML's calls {phases['nvml_ms']:.1f} ms in all, on "
            "threads beside the imports and the scan (NOTE [overlapped start] in snapshot.py)",
            "",
            "| NVML call | median ms |",
            "| --- | ---: |",
        ]
        for name, value in phases["calls_ms"].items():
            lines.append(f"| {name} | {value:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--importtime", action="store_true", help="add an import breakdown")
    parser.add_argument(
        "--phases", type=int, default=0, metavar="N", help="add a phase breakdown over N processes"
    )
    parser.add_argument("--out", default=None, help="write the table (Markdown) and JSON here")
    parser.add_argument(
        "--write", action="store_true", help="write benchmarks/results/snapshot-start-<machine>"
    )
    parser.add_argument(
        "--from-source", action="store_true", help="do not compile leakcheck's bytecode first"
    )
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds: at least 2")
    if not args.from_source:
        compileall.compile_dir(str(REPO / "leakcheck"), quiet=1)
    times = measure(args.rounds)
    data: dict[str, Any] = {
        "meta": host_meta(),
        "rounds": args.rounds,
        "bytecode": bytecode_note(),
        "commands": {
            label: {
                "median_ms": statistics.median(values),
                "p90_ms": quantile(sorted(values), 0.9),
                "ms": values,
            }
            for label, values in times.items()
        },
    }
    share, low, high = own_share(times["python -m leakcheck snapshot"], times["python -c pass"])
    data["own_share"] = {"ms": share, "low_ms": low, "high_ms": high, "goal_ms": GOAL_MS}
    if args.importtime:
        data["imports"] = import_breakdown()
    if args.phases:
        data["phases"] = phase_breakdown(args.phases)
    text = render(data)
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {out} and {out.with_suffix('.json')}")
    if args.write:
        print("wrote", write_result(result_stem("snapshot-start"), data, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
