"""Overhead of the pytest plugin per test: flag off, flag on, and pytest-memray's --memray.

Generates a suite of small tests (500 by default: plain, parametrized, class-based, with
function and module fixtures) in a temporary folder, then runs pytest on it in subprocesses,
configurations interleaved round by round (the order rotates from round to round):

- ``baseline``: the plugin not loaded (``-p no:leakcheck``);
- ``flag off``: the plugin loaded, check off (what every user of the package pays);
- ``flag on``: ``--gpu-leak-check``;
- ``memray``: ``--memray`` (pytest-memray), plugin not loaded, for scale.

Two clocks per run: the whole process (wall, startup included) and the test loop alone
(``pytest_runtestloop``, timed by a conftest in the generated suite). Per-test overhead is
``(median loop time - median baseline loop time) / tests``.

Usage: python benchmarks/bench_plugin.py [--tests 500] [--rounds 5] [--write]
       (--write: benchmarks/results/plugin-<machine>.md, see results_io.py)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from results_io import result_stem, write_result

REPO = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, list[str]] = {
    "baseline": ["-p", "no:leakcheck"],
    "flag off": [],
    "flag on": ["--gpu-leak-check"],
    "memray": ["-p", "no:leakcheck", "--memray"],
}

CONFTEST = """
import json, os, time
import pytest

@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        with open(os.environ["BENCH_TIMING_FILE"], "w") as handle:
            json.dump({"loop_s": time.perf_counter() - start}, handle)
"""

MODULE = """
import pytest

@pytest.fixture
def numbers():
    return list(range(10))

@pytest.fixture(scope="module")
def table():
    return {{i: i * i for i in range(100)}}

def test_plain():
    assert sum(range(10)) == 45

def test_fixture(numbers):
    assert len(numbers) == 10

def test_module_fixture(table):
    assert table[9] == 81

@pytest.mark.parametrize("value", range({params}))
def test_param(value, numbers):
    assert value in range({params})

class TestGroup:
    def test_a(self):
        assert "leak".upper() == "LEAK"

    def test_b(self, table):
        assert len(table) == 100
"""
TESTS_PER_MODULE_FIXED = 5  # every test of MODULE but the parametrized one


def write_suite(folder: Path, tests: int) -> int:
    """Write modules of 50 tests each; returns the number of tests written."""
    per_module = 50
    modules = max(1, round(tests / per_module))
    params = per_module - TESTS_PER_MODULE_FIXED
    for index in range(modules):
        (folder / f"test_mod{index:03d}.py").write_text(MODULE.format(params=params))
    (folder / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (folder / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return modules * per_module


def _plugin_installed() -> bool:
    return any(ep.name == "leakcheck" for ep in importlib.metadata.entry_points(group="pytest11"))


def _environment(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAKCHECK_", "PYTEST_"))}
    paths = [str(site), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _entry_point_shim(site: Path) -> None:
    # Declares the pytest11 entry point as an installed leakcheck would, so that
    # -p no:leakcheck works before the package is installed.
    dist = site / "leakcheck_bench_shim-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: leakcheck-bench-shim\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nleakcheck = leakcheck.adapters.plugin\n")


def run_once(folder: Path, args: list[str], env: dict[str, str], expected: int) -> dict[str, float]:
    timing = folder / "timing.json"
    env = {**env, "BENCH_TIMING_FILE": str(timing)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
    )
    wall_s = time.perf_counter() - start
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    if done.returncode != 0 or f"{expected} passed" not in tail[0]:
        raise SystemExit(f"pytest {' '.join(args)} failed: {tail[0]}\n{done.stderr[-2000:]}")
    loop_s = float(json.loads(timing.read_text())["loop_s"])
    return {"wall_s": wall_s, "loop_s": loop_s}


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("pytest", "pytest-memray", "memray", "pytest-xdist", "leakcheck", "torch"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    sys.path.insert(0, str(REPO))
    from leakcheck.observe import nvml
    ok, reason = nvml.availability()
    gpus = [d.name for d in nvml.get().memory()] if ok else []
    return {
        "load_average_1m": round(os.getloadavg()[0], 2),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpus": gpus,
        "nvml": "available" if ok else reason,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    configs = dict(CONFIGS)
    if importlib.util.find_spec("pytest_memray") is None:
        # The comparison is for scale only: measure the rest rather than stop.
        print("pytest-memray is not installed: its arm is skipped", file=sys.stderr)
        del configs["memray"]

    with tempfile.TemporaryDirectory(prefix="leakcheck-bench-") as tmp:
        folder = Path(tmp) / "suite"
        folder.mkdir()
        site = Path(tmp) / "site"
        if not _plugin_installed():
            _entry_point_shim(site)
        tests = write_suite(folder, args.tests)
        env = _environment(site)
        for config_args in configs.values():  # warm the file cache and .pyc files
            run_once(folder, config_args, env, tests)
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        names = list(configs)
        for round_index in range(args.rounds):
            # Rotate the order: no configuration always runs right after the heavy one.
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(run_once(folder, configs[name], env, tests))

    rows: dict[str, dict[str, float]] = {}
    base_loop = statistics.median(s["loop_s"] for s in samples["baseline"])
    base_wall = statistics.median(s["wall_s"] for s in samples["baseline"])
    for name, runs in samples.items():
        loop = statistics.median(s["loop_s"] for s in runs)
        wall = statistics.median(s["wall_s"] for s in runs)
        rows[name] = {
            "loop_s": loop,
            "wall_s": wall,
            "loop_min_s": min(s["loop_s"] for s in runs),
            "per_test_ms": loop / tests * 1000,
            "overhead_per_test_ms": (loop - base_loop) / tests * 1000,
            "wall_overhead_s": wall - base_wall,
            "loop_ratio": loop / base_loop,
        }
    on_vs_off = rows["flag on"]["loop_s"] / rows["flag off"]["loop_s"]
    result = {
        "benchmark": "plugin",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tests": tests,
        "rounds": args.rounds,
        "machine": _machine(),
        "versions": _versions(),
        "configs": {name: " ".join(a) or "(none)" for name, a in configs.items()},
        "results": rows,
        "flag_on_vs_off_ratio": on_vs_off,
        "goal": "flag on: under 1 ms per test on CPU",
        "goal_met": rows["flag on"]["overhead_per_test_ms"] < 1.0,
    }
    text = render(result)
    print(text)
    if args.write:
        print("wrote", write_result(result_stem("plugin"), result, text))
    return 0


def render(result: dict[str, Any]) -> str:
    """Markdown table of one run."""
    machine = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines = [
        f"# pytest plugin overhead ({result['date']})",
        "",
        f"{result['tests']} small tests, median of {result['rounds']} interleaved runs per "
        f"configuration. Machine: {machine['cpu']}, {machine['cores']} cores, "
        f"GPUs: {', '.join(machine['gpus']) or 'none'} ({machine['nvml']}). "
        f"Load average at the end: {machine['load_average_1m']} (differences of a few "
        "hundredths of a ms per test are noise on a busy machine).",
        f"Versions: {versions}.",
        "",
        "| configuration | arguments | test loop (s) | per test (ms) | overhead per test (ms) "
        "| loop ratio | whole run (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["results"].items():
        lines.append(
            f"| {name} | `{result['configs'][name]}` | {row['loop_s']:.3f} | "
            f"{row['per_test_ms']:.3f} | {row['overhead_per_test_ms']:+.3f} | "
            f"{row['loop_ratio']:.2f}x | {row['wall_s']:.2f} |"
        )
    lines += [
        "",
        f"Flag on vs flag off (test loop): {result['flag_on_vs_off_ratio']:.2f}x. "
        f"Goal ({result['goal']}): {'met' if result['goal_met'] else 'NOT met'}.",
        "Overhead per test = (median test-loop time - baseline's) / tests; the baseline runs "
        "without the plugin.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
