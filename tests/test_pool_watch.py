"""benchmarks/pool_watch.py: the rounds of several bench_watch.py results pooled into one A/B."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pool_watch.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import results_io  # noqa: E402


def _result(
    path: Path,
    ratios: list[float],
    *,
    batches: int = 1000,
    variant: str | None = None,
    setting: str = "default",
) -> str:
    meta: dict[str, object] = {"batches_per_epoch": batches}
    if variant is not None:
        meta["variant"] = variant
    rounds = [{"accounted_pct": 0.5 + index / 100} for index in range(len(ratios))]
    payload = {"meta": meta, "ratio_per_round": ratios, "rounds_detail": rounds}
    name = results_io.ResultName(path.stem, setting)
    return results_io.write_result(name, payload, f"# {path.stem}", directory=str(path.parent))


def _pool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_rounds_of_the_chosen_runs_are_pooled_and_the_others_left_out(tmp_path: Path) -> None:
    first = _result(tmp_path / "watch-cuda-1.md", [0.99, 0.98, 0.97])
    second = _result(tmp_path / "watch-cuda-2.md", [0.96, 0.95, 1.0])
    other_epochs = _result(tmp_path / "watch-cuda-3.md", [0.5, 0.5, 0.5], batches=5000)
    # A section of another setting in the same file as the first: left out by its variant.
    _result(
        tmp_path / "watch-cuda-1.md", [0.5, 0.5, 0.5], variant="control", setting="control"
    )
    done = _pool(first, second, other_epochs, "--batches", "1000")
    assert done.returncode == 0, done.stderr
    pooled = next(line for line in done.stdout.splitlines() if "**pooled**" in line)
    # Six rounds, slowdowns 1..5% and 0%: the median is 2.5%.
    assert "**6**" in pooled
    assert "**+2.50%**" in pooled
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[2:] == ["| watch-cuda-1 (default)", "| watch-cuda-2 (default)", "| **pooled**"]
    assert "| 0.51%, 0.520% |" in done.stdout  # a run's accounted bound: median, worst round


def test_a_file_that_is_not_a_result_and_filters_that_match_nothing_are_usage_errors(
    tmp_path: Path,
) -> None:
    stray = tmp_path / "other.md"
    stray.write_text("<!-- setting: default -->\n# other\n\n```json\n{\"rows\": []}\n```\n")
    done = _pool(str(stray))
    assert done.returncode == 2
    assert "other.md: not a bench_watch.py result" in done.stderr
    result = _result(tmp_path / "watch-cuda-1.md", [0.99, 0.98])
    done = _pool(result, "--batches", "7")
    assert done.returncode == 2
    assert "no bench_watch.py result matches" in done.stderr
