"""The ``leakcheck`` command: real sweeps with real worker processes, usage errors, snapshot.

The slow parts (spawned workers import torch: 1-2 s each here) run once per module: the
default sweep is shared by the tests that read its text, JSON and PNG.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from leakcheck.commands import cli
from leakcheck.commands.cli import main
from leakcheck.commands.sweep import COLUMN_NAMES, TABLE_WIDTH, recommend_workers
from leakcheck.commands.workload import WorkloadSpec
from leakcheck.core.errors import UsageError
from leakcheck.core.model import MIB, ProcInfo
from leakcheck.core.units import format_mib
from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def leakcheck(*args: str, cwd: Path | None = None, timeout: float = 180) -> Run:
    """Run ``python -m leakcheck ARGS`` in a fresh interpreter, as a user would."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    done = subprocess.run(
        [sys.executable, "-m", "leakcheck", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(done.returncode, done.stdout, done.stderr)


def table_rows(text: str) -> list[list[str]]:
    """The cells of the sweep table (header excluded), split on runs of 2+ spaces."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("workers  epoch"))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


# --------------------------------------------------------------------------- default sweep


@pytest.fixture(scope="module")
def default_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, Any], Path]:
    folder = tmp_path_factory.mktemp("sweep")
    json_path, png_path = folder / "sweep.json", folder / "sweep.png"
    run = leakcheck(
        "sweep",
        "--workers",
        "0,2",
        "--epochs",
        "2",
        "--json",
        str(json_path),
        "--plot",
        str(png_path),
    )
    assert run.returncode == 0, run.stderr
    return run, json.loads(json_path.read_text()), png_path


def test_default_sweep_completes_clean(default_sweep: tuple[Run, dict[str, Any], Path]) -> None:
    run, data, _ = default_sweep
    assert data["verdict"] == "clean" and data["leak_count"] == 0
    assert [c["num_workers"] for c in data["configurations"]] == [0, 2]
    assert run.stdout.count("verdict CLEAN") == 2
    # Two workers per epoch were seen (exact identities from the mailbox).
    assert [row["worker_count"] for row in data["configurations"][1]["rows"]] == [2, 2]
    # Without a GPU: said once, briefly; no GPU column, no n/a cell.
    if not data["gpu"]["available"]:
        assert run.stdout.count("GPU: not checked (") == 1
        assert data["gpu"]["reason"] not in run.stdout and "n/a" not in run.stdout


def test_default_sweep_json_matches_text(default_sweep: tuple[Run, dict[str, Any], Path]) -> None:
    run, data, _ = default_sweep
    rows = [row for config in data["configurations"] for row in config["rows"]]
    cells = table_rows(run.stdout)
    assert len(cells) == len(rows) == 4

    header = next(line for line in run.stdout.splitlines() if line.startswith("workers  epoch"))
    # The table shows the columns with data here, in their order: no GPU column without one.
    shown = [name for name in COLUMN_NAMES if name in header]
    gpu_columns = {"GPU parent", "GPU wk peak", "GPU used", "temp °C"}
    assert bool(gpu_columns & set(shown)) == data["gpu"]["available"]
    for text, row in zip(cells, rows, strict=True):
        cell = dict(zip(shown, text, strict=True))
        assert cell["workers"] == str(row["num_workers"])
        assert cell["epoch"] == str(row["epoch"])
        assert cell["time s"] == f"{row['duration_s']:.2f}"
        if data["gpu"]["available"]:
            assert cell["GPU parent"] == format_mib(row["parent_gpu_bytes"])
            peak = row["workers_gpu_bytes_peak"]
            assert cell["GPU wk peak"] == ("?" if row["workers_peak_unknown"] else format_mib(peak))
        assert cell["alive after"] == str(row["alive_after"])
        assert cell["orphans"] == str(row["orphans"])
        # Host memory is read with or without a GPU: numbers, never n/a.
        assert [cell["host parent"], cell["host wk"], cell["host"]] == [
            format_mib(row["parent_host_bytes"]),
            format_mib(row["workers_host_bytes"]),
            row["host_source"],
        ]
        # USS: the sweep waits for each epoch end's reads.
        assert row["parent_host_bytes"] > 0 and row["host_source"] == "uss"
        if row["worker_count"]:
            assert row["workers_host_bytes"] > 0
    for config in data["configurations"]:
        assert config["summary"] in run.stdout
        assert config["report"]["verdict"] == config["verdict"]


def test_default_sweep_answers_how_many_workers(
    default_sweep: tuple[Run, dict[str, Any], Path],
) -> None:
    run, data, _ = default_sweep
    batch_size = WorkloadSpec().batch_size
    rates = {}
    for config in data["configurations"]:
        rows, throughput = config["rows"], config["throughput"]
        # Every epoch timed and counted: samples are the built-in batches' rows.
        assert [row["samples"] for row in rows] == [row["batches"] * batch_size for row in rows]
        assert all(0 < row["wait_s"] <= row["loop_s"] for row in rows)
        assert throughput["samples_per_s"] > 0 and 0 < throughput["wait_share"] <= 1
        if config["num_workers"]:
            assert throughput["worker_host_bytes"] > 0
        else:
            assert throughput["worker_host_bytes"] is None  # no workers: nothing per worker
        if not data["gpu"]["available"]:
            assert throughput["worker_gpu_bytes"] is None  # not read: unknown, never 0
        rates[config["num_workers"]] = throughput["samples_per_s"]
    answer = data["recommendation"]
    assert answer["num_workers"] == recommend_workers(rates) and answer["unit"] == "samples"
    assert answer["best_rate_per_s"] == max(rates.values())

    lines = run.stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("workers  samples/s")))
    table = lines[start : start + 3]
    assert [line.split()[0] for line in table[1:]] == ["0", "2"]
    assert ("GPU MiB/wk" in table[0]) == data["gpu"]["available"]
    assert all(len(line) <= TABLE_WIDTH for line in table)
    assert lines[start + 3].startswith(f"recommended: {answer['num_workers']} worker")


def test_progress_is_plain_lines_off_a_terminal(
    default_sweep: tuple[Run, dict[str, Any], Path],
) -> None:
    run, _, _ = default_sweep
    assert "\r" not in run.stderr
    progress = [line for line in run.stderr.splitlines() if line.startswith("leakcheck sweep:")]
    assert len(progress) == 4
    assert progress[-1].startswith(
        "leakcheck sweep: config 2/2 workers=2 epoch 1 (2 of 2): 16 batches"
    )


def test_plot_is_a_png(default_sweep: tuple[Run, dict[str, Any], Path]) -> None:
    _, _, png_path = default_sweep
    data = png_path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


# --------------------------------------------------------------------------- scenarios


def test_copy_on_read_scenario_is_found_in_epoch_0_though_flat_after(tmp_path: Path) -> None:
    json_path = tmp_path / "cor.json"
    run = leakcheck(
        "sweep", "--scenario", "copy-on-read", "--workers", "2", "--epochs", "4",
        "--json", str(json_path),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    data = json.loads(json_path.read_text())
    (config,) = data["configurations"]
    findings = config["report"]["findings"]
    (found,) = [f for f in findings if f["rule"] == "copy-on-read"]
    assert found["severity"] == "leak" and found["epoch"] == 0, run.stdout
    assert "2 forked workers of PID" in found["message"]
    assert found["host_bytes"] > 2 * 64 * MIB  # 128 MiB of objects, copied by each worker
    assert [f for f in findings if f["rule"] == "host-growth"] == []  # no growth to see
    assert "LEAK copy-on-read  2 forked workers" in run.stdout
    rows = config["rows"]
    copied = [row["workers_copied_bytes"] for row in rows]
    assert all(c is not None and c > 2 * 64 * MIB for c in copied), copied
    assert max(copied) - min(copied) < 16 * MIB  # flat from epoch 0 on
    assert all(row["workers_shared_bytes"] is not None for row in rows)
    assert data["options"]["copy_tolerance_bytes"] == 64 * MIB


def test_copy_on_read_growing_scenario_is_found_per_worker_in_mib_per_epoch(
    tmp_path: Path,
) -> None:
    json_path = tmp_path / "cor.json"
    run = leakcheck(
        "sweep",
        "--scenario",
        "copy-on-read-growing",
        "--workers",
        "2",
        "--epochs",
        "5",
        "--copy-tolerance",
        "1GiB",
        "--json",
        str(json_path),
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(json_path.read_text())
    (config,) = data["configurations"]
    findings = config["report"]["findings"]
    growth = [f for f in findings if f["rule"] == "host-growth"]
    # Each worker, not the parent (its USS climbs back as the workers stop sharing pages).
    assert sorted(f["role"] for f in growth) == ["worker", "worker"], run.stdout
    workers = {
        p["key"]["pid"]
        for e in config["report"]["epochs"]
        for p in e["processes"]
        if p["role"] == "worker"
    }
    assert {f["pid"] for f in growth} == workers
    for finding in growth:
        assert 20 * MIB < finding["bytes_per_epoch"] < 60 * MIB
        assert "host memory (USS) grows" in finding["message"]
        # Each worker named by its PID, the two on one line where they grew alike.
        assert any(
            line.lstrip().startswith("LEAK host-growth  ") and str(finding["pid"]) in line
            for line in run.stdout.splitlines()
        ), run.stdout
        assert "copy-on-read" in finding["remedy"]
    # Its copies stay below the 1 GiB copy tolerance given: no copy-on-read finding.
    assert [f for f in findings if f["rule"] == "copy-on-read"] == []
    assert "start method fork" in run.stdout and "verdict LEAK" in run.stdout
    rows = config["rows"]
    assert [row["host_source"] for row in rows] == ["uss"] * 5
    sums = [row["workers_host_bytes"] for row in rows]
    assert sums == sorted(sums) and sums[-1] - sums[1] > 2 * 64 * MIB


def test_orphan_scenario_found_and_cleaned_up(tmp_path: Path) -> None:
    from leakcheck.observe import procs

    json_path = tmp_path / "orphan.json"
    run = leakcheck(
        "sweep",
        "--scenario",
        "orphan",
        "--workers",
        "1",
        "--epochs",
        "1",
        "--grace",
        "0.5",
        "--fail-on-leak",
        "--json",
        str(json_path),
    )
    assert run.returncode == 1, run.stderr
    data = json.loads(json_path.read_text())
    for config in data["configurations"]:
        orphans = [f for f in config["report"]["findings"] if f["rule"] == "orphan"]
        assert len(orphans) == 1, config["report"]["findings"]
        finding = orphans[0]
        assert "leakcheck sweep --scenario orphan" in finding["cmdline"]
        # The sweep terminated its own orphan after judging, and said so.
        assert [(c["pid"], c["outcome"]) for c in config["cleanup"]] == [
            (finding["pid"], "terminated")
        ]
        assert f"cleanup: terminated PID {finding['pid']}" in run.stdout
        # Gone, or its PID names another process now.
        assert procs.process_key(finding["pid"]) != (finding["pid"], finding["start_ticks"])
    assert len(data["configurations"]) == 1
    assert "verdict LEAK" in run.stdout


# --------------------------------------------------------------------------- --loader

_LOADER_FILE = """
from torch.utils.data import DataLoader

def make(num_workers):
    context = "fork" if num_workers else None
    return DataLoader(list(range(12)), batch_size=3, num_workers=num_workers,
                      multiprocessing_context=context)
"""


def test_loader_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "my_loader.py").write_text(_LOADER_FILE)
    json_path = tmp_path / "out.json"
    run = leakcheck(
        "sweep",
        "--loader",
        str(tmp_path / "my_loader.py") + ":make",
        "--workers",
        "0,1",
        "--epochs",
        "2",
        "--json",
        str(json_path),
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(json_path.read_text())
    assert data["loader"].endswith("my_loader.py:make")
    counts = [[row["worker_count"] for row in c["rows"]] for c in data["configurations"]]
    assert counts == [[0, 0], [1, 1]]
    assert "leakcheck sweep: loader " in run.stdout


def test_loader_from_a_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"sweep_module_loader_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(
        "def make(num_workers):\n    return [[num_workers, i] for i in range(4)]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    json_path = tmp_path / "out.json"
    status = main(
        ["sweep", "--loader", f"{name}:make", "--workers", "0", "--epochs", "2",
         "--grace", "0.1", "--json", str(json_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    data = json.loads(json_path.read_text())
    assert data["loader"] == f"loader {name}:make"
    assert len(data["configurations"][0]["rows"]) == 2
    assert "verdict CLEAN" in out


# --------------------------------------------------------------------------- usage errors


@pytest.fixture
def broken_loaders(tmp_path: Path) -> Path:
    (tmp_path / "raises_on_call.py").write_text(
        "def make(num_workers):\n    raise RuntimeError('dataset missing')\n"
    )
    (tmp_path / "raises_on_import.py").write_text("import no_such_module_for_leakcheck\n")
    (tmp_path / "not_callable.py").write_text("make = 3\n")
    (tmp_path / "once.py").write_text("def make(num_workers):\n    return iter([1, 2, 3])\n")
    (tmp_path / "ignores_workers.py").write_text(
        "class Loader:\n    num_workers = 0\n\n    def __iter__(self):\n"
        "        return iter([1])\n\n\ndef make(num_workers):\n    return Loader()\n"
    )
    return tmp_path


BAD_VALUES = [
    (["--workers", "4,x"], "--workers: expected comma-separated integers >= 0 such as 0,4,8, "
     "got '4,x'"),
    (["--workers", ""], "--workers: expected comma-separated integers >= 0"),
    (["--workers", "-1"], "got '-1'"),
    (["--epochs", "0"], "--epochs: expected an integer >= 1 such as 5, got '0'"),
    (["--epochs", "five"], "--epochs: expected an integer >= 1 such as 5, got 'five'"),
    (["--loader", "no_colon"], "--loader: expected MODULE:FACTORY or path/to/file.py:FACTORY, "
     "got 'no_colon'"),
    (["--loader", "no_such_module_for_leakcheck:make"],
     "--loader: cannot import 'no_such_module_for_leakcheck': ModuleNotFoundError"),
    (["--loader", "{dir}/missing.py:make"], "--loader: expected an existing file.py"),
    (["--loader", "{dir}/raises_on_import.py:make"], "--loader: cannot import"),
    (["--loader", "{dir}/not_callable.py:make"], "is a int, expected a callable FACTORY"),
    (["--loader", "{dir}/not_callable.py:other"], "has no attribute 'other'"),
    (["--loader", "{dir}/raises_on_call.py:make"],
     "--loader {dir}/raises_on_call.py:make: calling make(0) failed: RuntimeError: dataset "
     "missing"),
    (["--loader", "x:make", "--scenario", "orphan"], "--scenario: applies to the built-in"),
    (["--scenario", "bogus"], "--scenario: expected one of clean, persistent-cache, orphan"),
    (["--start-method", "thread"], "--start-method: expected one of spawn, fork, forkserver"),
    (["--tolerance", "5 parsecs"], "--tolerance (command line): expected a size"),
    (["--grace", "soon"], "--grace (command line): expected seconds"),
    (["--grace", "inf"], "--grace (command line): expected a finite number of seconds"),
    # Negative values with a unit are values, not unknown options ("expected one argument").
    (["--tolerance", "-5MiB"], "--tolerance (command line): expected a size such as 16MiB, 1GB "
     "or 4096 (bytes), got '-5MiB'"),
    (["--grace", "-1s"], "--grace (command line): expected 0 seconds or more such as 2 or "
     "500ms, got '-1s'"),
    (["--interval", "inf"], "--interval: expected a finite number of seconds"),
    (["--cooldown-timeout", "1e400"], "--cooldown-timeout: expected a finite number"),
    (["--workers", "0,\u00b2"], "--workers: expected comma-separated integers >= 0"),
    (["--loader", "x:make", "--start-method", "fork"],
     "--start-method: applies to the built-in workload only"),
    (["--loader", "{dir}:make"], "--loader: expected an existing file.py, got '{dir}' (a "
     "folder)"),
    (["--loader", "{dir}/ignores_workers.py:make", "--workers", "2"], "make(2) returned a "
     "loader with num_workers=0, expected 2: pass the argument on to the DataLoader"),
    (["--loader", "x:make", "--persistent"], "--persistent: applies to the built-in workload "
     "only, not with --loader"),
    # Said before the value is checked: the option has no place beside --loader at all.
    (["--loader", "x:make", "--batches", "0"], "--batches: applies to the built-in workload "
     "only, not with --loader"),
    (["--json", "{dir}/same.png", "--plot", "{dir}/same.png"], "--plot: expected a file other "
     "than --json's"),
    (["--plot", "-"], "--plot: expected a file path, got '-' (standard output is not written "
     "to; give a file name)"),
    (["--device", "gpu0"], "--device: expected a GPU index >= 0"),
    (["--cooldown-temp", "hot"], "--cooldown-temp: expected degrees Celsius"),
    (["--plot", "{dir}/picture.jpg"], "--plot: expected a file name ending in .png"),
    (["--json", "{dir}/no/such/folder/out.json"], "--json: expected a path in an existing folder"),
    (["--bogus-option"], "unrecognized arguments: --bogus-option"),
    # Values that used to be taken silently, or to fail only after the whole sweep ran.
    (["--workers", "100000"], "--workers: 100000 workers is more than this machine should "
     "start (at most "),
    (["--workers", "0,64", "--max-workers", "32"],
     "--workers: 64 workers is more than --max-workers 32 allows"),
    (["--max-workers", "lots"], "--max-workers: expected an integer >= 0 such as 64, got 'lots'"),
    (["--workers", "9" * 5000], "--workers: expected comma-separated integers >= 0"),
    (["--tolerance", "1.5"], "--tolerance (command line): expected a whole number of bytes such "
     "as 4096, got '1.5'"),
    (["--tolerance", ""], "--tolerance (command line): expected a size such as 16MiB, 1GB or "
     "4096 (bytes), got ''"),
    (["--grace", ""], "--grace (command line): expected seconds such as 2 or 500ms, got ''"),
    (["--interval", ""], "--interval: expected seconds such as 2 or 500ms, got ''"),
    (["--interval", "1e-9"], "--interval: expected 1ms or more (a shorter interval makes the "
     "sampler spin"),
    (["--interval", "0"], "--interval: expected 1ms or more"),
    (["--grace", "1e9"], "--grace (command line): expected a finite number of seconds below 1e9"),
    (["--device", "99"], "--device: expected a GPU index"),
    (["--json", "/proc/leakcheck.json"], "--json: expected a path in a folder that takes new "
     "files, got '/proc/leakcheck.json' (cannot create a file in /proc: "),
    (["--plot", "/proc/leakcheck.png"], "--plot: expected a path in a folder that takes new files"),
    (["--json", "/dev/null"], "--json: expected a regular file to write, got '/dev/null'"),
    (["--json", "{dir}"], "--json: expected a file path, got the folder"),
    (["--json", "-"], "--json: expected a file path, got '-' (standard output is not "
     "written to"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), BAD_VALUES)
def test_bad_values_exit_2_with_one_line(
    args: list[str],
    expected: str,
    broken_loaders: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = [arg.replace("{dir}", str(broken_loaders)) for arg in args]
    expected = expected.replace("{dir}", str(broken_loaders))
    json_path = broken_loaders / "out.json"
    if "--json" not in args:
        args += ["--json", str(json_path)]
    status = main(["sweep", "--workers", "0", "--epochs", "1", *args])
    captured = capsys.readouterr()
    assert status == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("leakcheck sweep: ")
    assert expected in lines[0]
    assert not json_path.exists()
    assert captured.out == ""


def test_a_loader_that_is_no_dataloader_is_said_to_be_unchecked(
    broken_loaders: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (broken_loaders / "plain_list.py").write_text("def make(num_workers):\n    return [1, 2]\n")
    status = main(["sweep", "--loader", f"{broken_loaders}/plain_list.py:make", "--workers",
                   "0,1", "--epochs", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 0
    notes = [line for line in err.splitlines() if "not a DataLoader" in line]
    assert notes == [
        "leakcheck sweep: workers=1: the loader is a list, not a DataLoader: its worker count "
        "is not checked and its workers report nothing of themselves (their processes are "
        "still tracked)"
    ]


def test_a_loader_that_can_be_iterated_once_is_a_usage_error(
    broken_loaders: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its later epochs yield nothing: a sweep of empty epochs would read CLEAN."""
    json_path = broken_loaders / "out.json"
    status = main(["sweep", "--loader", f"{broken_loaders}/once.py:make", "--workers", "0",
                   "--epochs", "3", "--json", str(json_path)])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 2
    assert (
        captured.err.strip()
        .splitlines()[-1]
        .endswith(
            "the loader (workers=0) yielded no batches in epoch 1, where epoch 0 yielded 3: it "
            "can be iterated once (a generator or an iterator); return one that can be iterated "
            "again, such as a DataLoader"
        )
    )
    assert "UserWarning" not in captured.err
    assert not json_path.exists()


def test_bad_values_leave_no_probe_file(broken_loaders: Path) -> None:
    """The output check creates a probe file and removes it: nothing is left in the folder."""
    before = sorted(os.listdir(broken_loaders))
    assert main(["sweep", "--workers", "0", "--epochs", "0", "--json",
                 str(broken_loaders / "out.json")]) == 2  # fmt: skip
    assert sorted(os.listdir(broken_loaders)) == before


def _chattr(flag: str, path: Path) -> bool:
    try:
        done = subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
    except FileNotFoundError:
        return False
    return done.returncode == 0


@pytest.mark.parametrize("flag", ["+i", "+a"])
def test_immutable_or_append_only_output_is_refused_before_the_run(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Root may write any file by its mode, but not an immutable or append-only one: the
    sweep ran to its end and then lost its results."""
    ran = tmp_path / "ran"
    (tmp_path / "marker_loader.py").write_text(
        f"def make(n):\n    open({str(ran)!r}, 'w').close()\n    return [1]\n"
    )
    target = tmp_path / "old.json"
    target.write_text("{}")
    if not _chattr(flag, target):
        pytest.skip(f"chattr {flag} is not possible here (not root, or the filesystem)")
    try:
        status = main(["sweep", "--loader", f"{tmp_path}/marker_loader.py:make", "--workers",
                       "0", "--epochs", "1", "--json", str(target)])  # fmt: skip
    finally:
        _chattr(flag.replace("+", "-"), target)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err == [
        f"leakcheck sweep: --json: expected a writable file, got {str(target)!r} "
        "(Operation not permitted)"
    ]
    assert not ran.exists()  # refused before the loader was called
    assert target.read_text() == "{}"


_SABOTAGE = """
import os, shutil

def make(num_workers):
    # Runs after the outputs were checked: the place they were checked for goes away.
    {action}
    return [1, 2]
"""


def _sabotaged_sweep(tmp_path: Path, action: str, json_path: Path, name: str) -> int:
    loader = tmp_path / f"{name}.py"
    loader.write_text(_SABOTAGE.format(action=action))
    return main(["sweep", "--loader", f"{loader}:make", "--workers", "0", "--epochs", "1",
                 "--grace", "0", "--json", str(json_path)])  # fmt: skip


def test_json_that_cannot_be_written_at_the_end_goes_next_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    out.mkdir()
    json_path = out / "sweep.json"
    # A folder now stands where the file was to go: the final rename onto it fails.
    action = f"os.mkdir({str(json_path)!r})"
    status = _sabotaged_sweep(tmp_path, action, json_path, "folder_in_the_way")
    captured = capsys.readouterr()
    assert status == 2
    assert "verdict CLEAN" in captured.out  # the text report was printed
    lines = [line for line in captured.err.splitlines() if "--json" in line]
    assert len(lines) == 1, captured.err
    written = [name for name in os.listdir(out) if name != "sweep.json"]
    assert len(written) == 1 and written[0].startswith("sweep.leakcheck-"), written
    assert written[0].endswith(".json")
    saved = out / written[0]
    assert lines[0].startswith(
        f"leakcheck sweep: --json: cannot write {str(json_path)!r}: [Errno 21] Is a directory"
    )
    assert lines[0].endswith(f"; wrote it to {str(saved)!r} instead")
    data = json.loads(saved.read_text())
    assert data["configurations"][0]["verdict"] == "clean"


def test_json_falls_back_to_the_current_folder_then_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    out, cwd, temp = tmp_path / "out", tmp_path / "cwd", tmp_path / "temp"
    for folder in (out, cwd, temp):
        folder.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    json_path = out / "sweep.json"
    # The folder is removed during the run: the current folder takes the file.
    action = f"shutil.rmtree({str(out)!r})"
    assert _sabotaged_sweep(tmp_path, action, json_path, "folder_removed") == 2
    err = capsys.readouterr().err
    (saved,) = cwd.iterdir()
    assert saved.name.startswith("sweep.leakcheck-") and saved.suffix == ".json"
    assert err.splitlines()[-1].endswith(f"; wrote it to {str(saved)!r} instead")
    assert json.loads(saved.read_text())["leak_count"] == 0

    # The current folder is removed with it: the temporary folder takes the file.
    out.mkdir()
    monkeypatch.chdir(out)
    assert _sabotaged_sweep(tmp_path, action, json_path, "folder_and_cwd_removed") == 2
    err = capsys.readouterr().err
    (saved,) = temp.iterdir()
    assert err.splitlines()[-1].endswith(f"; wrote it to {str(saved)!r} instead")
    assert json.loads(saved.read_text())["leak_count"] == 0


def test_device_without_a_gpu_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from leakcheck.observe import nvml
    reason = "NVML unavailable: libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"
    monkeypatch.setattr(
        nvml,
        "availability",
        lambda: (False, f"{reason}; GPU memory is not checked, process checks still run"),
    )
    assert main(["sweep", "--workers", "0", "--epochs", "1", "--device", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"leakcheck sweep: --device: expected a GPU index, but NVML sees no GPU here ({reason}), "
        "got 0; leave out --device to run the host-side checks only"
    ]


# --------------------------------------------------------------------------- worker bound


def test_worker_bound_by_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_usable_cpus", lambda: 16)
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert cli.worker_bound() == (128, "16 CPUs x 8")
    args = cli.build_parser().parse_args(["sweep", "--workers", "0,129", "--loader", "m:f"])
    with pytest.raises(UsageError) as info:
        cli.resolve_sweep(args)
    assert str(info.value) == (
        "--workers: 129 workers is more than this machine should start (at most 128: "
        "16 CPUs x 8); pass --max-workers N to allow more"
    )
    args = cli.build_parser().parse_args(["sweep", "--workers", "0,128", "--loader", "m:f"])
    assert cli.resolve_sweep(args)[0].workers == (0, 128)
    args = cli.build_parser().parse_args(
        ["sweep", "--workers", "4,1000", "--max-workers", "1000", "--loader", "m:f"]
    )
    assert cli.resolve_sweep(args)[0].workers == (4, 1000)


def test_worker_bound_by_the_process_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setattr(cli, "_usable_cpus", lambda: 16)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (4096, 8192))
    monkeypatch.setattr(cli, "_tasks_of_user", lambda uid: 4059 if uid == 1000 else 0)
    assert cli.worker_bound() == (
        37, "RLIMIT_NPROC 4096 minus 4059 processes and threads this user runs"
    )
    # A roomy limit leaves the CPU bound.
    monkeypatch.setattr(cli, "_tasks_of_user", lambda uid: 10)
    assert cli.worker_bound()[0] == 128
    # Root, or no limit: the process limit does not apply.
    monkeypatch.setattr(cli, "_tasks_of_user", lambda uid: 4096)
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert cli.worker_bound()[0] == 128
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert cli.worker_bound()[0] == 128


def test_tasks_of_user_counts_this_process_threads() -> None:
    import threading

    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        count = cli._tasks_of_user(os.getuid())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert count is not None and count >= 4
    assert cli._tasks_of_user(2**31 - 7) == 0


def test_max_workers_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-workers N allow worker counts up to N (default: 8 per CPU" in text
    assert "RLIMIT_NPROC" in text


def test_tolerance_and_grace_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "env_loader.py").write_text("def make(n):\n    return [1, 2]\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("LEAKCHECK_TOLERANCE", "32MiB")
    monkeypatch.setenv("LEAKCHECK_GRACE", "0.1")
    json_path = tmp_path / "out.json"
    args = ["sweep", "--loader", f"{tmp_path}/env_loader.py:make", "--workers", "0"]
    assert main([*args, "--epochs", "1", "--json", str(json_path)]) == 0
    resolved = json.loads(json_path.read_text())["options"]
    assert (resolved["tolerance_bytes"], resolved["grace_s"]) == (32 * 2**20, 0.1)
    # The command line wins over the environment; a bad environment value is named.
    json_path.unlink()
    assert main([*args, "--epochs", "1", "--tolerance", "1MiB", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["options"]["tolerance_bytes"] == 2**20
    monkeypatch.setenv("LEAKCHECK_TOLERANCE", "lots")
    capsys.readouterr()
    assert main([*args, "--epochs", "1"]) == 2
    assert capsys.readouterr().err.startswith(
        "leakcheck sweep: LEAKCHECK_TOLERANCE (environment): expected a size"
    )


# --------------------------------------------------------------------------- entry points


def test_python_m_leakcheck_help() -> None:
    run = leakcheck("--help")
    assert run.returncode == 0
    assert "sweep" in run.stdout and "snapshot" in run.stdout
    run = leakcheck("sweep", "--help")
    assert run.returncode == 0
    for option in ("--workers", "--epochs", "--loader", "--fail-on-leak", "--cooldown-temp"):
        assert option in run.stdout


def test_no_command_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "expected a command: sweep, snapshot, run or explain" in err
    assert len(err.strip().splitlines()) == 1, err


def test_explain_tells_a_rules_whole_story(capsys: pytest.CaptureFixture[str]) -> None:
    """A finding is one line and one fix; `leakcheck explain RULE` tells every cause and fix."""
    from leakcheck.judge.verdict import RULES

    assert main(["explain", "orphan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("orphan (leak): ")
    assert "terminate_children=True" in out and "kill PID" in out
    assert "process group" in out  # a fix the finding's one line leaves out
    for rule in RULES:  # every rule has its story
        assert main(["explain", rule]) == 0
        assert capsys.readouterr().out.startswith(f"{rule} (")


def test_explain_lists_the_rules_and_refuses_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from leakcheck.judge.verdict import RULES

    assert main(["explain"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in listed[1:]) == sorted(RULES)
    assert main(["explain", "leak"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()  # one line, not the list again after it
    assert line.startswith("leakcheck explain: unknown rule 'leak'; the rules are: survivor, ")
    assert captured.out == ""


def test_snapshot_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    from leakcheck.observe import nvml
    assert main(["snapshot"]) == 0
    text = capsys.readouterr().out
    assert main(["snapshot", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema_version"] == 1
    available, reason = nvml.availability()
    if not available:
        assert data["attribution"] != "ok"
        assert reason.split(";")[0] in text
        assert data["devices"] == []


def test_snapshot_bad_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snapshot", "--bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["leakcheck snapshot: unrecognized arguments: --bogus"]


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("x", "expected a process ID > 0, got 'x'"),
        ("0", "expected a process ID > 0"),
        # Past 4300 digits int() raised ValueError: a traceback, not a usage error.
        ("9" * 5000, "expected a process ID > 0"),
        ("999999999", "no running process with PID 999999999"),
    ],
)
def test_snapshot_bad_pid_is_one_line(
    capsys: pytest.CaptureFixture[str], value: str, needle: str
) -> None:
    assert main(["snapshot", "--pid", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_threads_id_is_no_process_for_snapshot_or_tracker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/proc/TID is readable: a thread was shown as the job's root, with no descendants."""
    from leakcheck.track.tracker import Tracker

    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(60,))
    thread.start()
    try:
        tid = thread.native_id
        assert tid is not None and tid != os.getpid()
        assert main(["snapshot", "--pid", str(tid)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"leakcheck snapshot: --pid: expected a process ID, got {tid}, a thread's"
        ]
        with pytest.raises(UsageError, match=f"^root_pid: expected a process ID, got {tid}, a"):
            Tracker(root_pid=tid, use_nvml=False).start()
    finally:
        done.set()
        thread.join()


def test_snapshot_pid_lists_the_jobs_lineage_and_its_tagged_orphan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from leakcheck.observe.procs import new_session_id

    tag = new_session_id(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # A middle process starts a tagged sleeper and exits: the sleeper is reparented away.
    middle = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(p.pid)",
        ],
        env={**os.environ, "LEAKCHECK_SESSION": tag},
        capture_output=True,
        text=True,
        check=True,
    )
    orphan_pid = int(middle.stdout.strip())
    orphan = psutil.Process(orphan_pid)
    try:
        # Wait until the orphan runs its own program (its tag is read from its environment).
        assert wait_for(lambda: "time.sleep(30)" in " ".join(orphan.cmdline()))
        assert main(["snapshot", "--pid", str(os.getpid()), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        by_pid = {entry["pid"]: entry for entry in data["processes"]}
        assert data["root_pid"] == os.getpid()
        assert by_pid[os.getpid()]["role"] == "parent"
        # A direct child, but nothing says it is a loader worker (NOTE [roles from outside]).
        assert by_pid[child.pid]["role"] == "descendant"
        assert by_pid[orphan_pid]["role"] == "orphan"
        assert "orphan" in by_pid[orphan_pid]["flags"]
        assert by_pid[orphan_pid]["session"] == tag
    finally:
        child.kill()
        child.wait()
        with contextlib.suppress(psutil.Error):
            orphan.kill()


def _pids_passed_to(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Every PID the snapshot passes to ``procs.<name>`` from now on (the call still runs)."""
    from leakcheck.observe import procs
    seen: list[int] = []
    real = getattr(procs, name)

    def recording(pid: int) -> Any:
        seen.append(pid)
        return real(pid)

    monkeypatch.setattr(procs, name, recording)
    return seen


def test_snapshot_reads_no_environment_older_than_the_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job's processes are younger than its root: the tags of older processes (most of a
    machine's) are never read, except GPU holders', which are always shown."""
    from leakcheck.observe import procs, snapshot
    root_key = procs.process_key(os.getpid())
    assert root_key is not None
    read_tags_of = _pids_passed_to(monkeypatch, "tagged_session")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        taken = snapshot.take_snapshot(root_pid=os.getpid(), with_fds=False)
    finally:
        child.kill()
        child.wait()
    assert child.pid in read_tags_of  # the job's own: read
    gpu_holders = {e.info.key.pid for e in taken.processes if e.gpu_bytes or e.gpu_bytes_unknown}
    older = [
        pid
        for pid in read_tags_of
        if pid not in gpu_holders
        and (key := procs.process_key(pid)) is not None
        and key.start_ticks < root_key.start_ticks
    ]
    assert older == []
    assert len(procs.scan_all(with_cmdline=False)) > len(read_tags_of)  # most were skipped


def test_snapshot_lists_no_kernel_threads_descriptors(
    kernel_threads: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel thread has no descriptors to hold: the scan does not list its /proc/PID/fd."""
    from leakcheck.observe import snapshot
    listed_fds_of = _pids_passed_to(monkeypatch, "nvidia_fd_count")
    snapshot.take_snapshot(telemetry=False)
    assert os.getppid() in listed_fds_of  # an ordinary process: scanned
    assert not kernel_threads & set(listed_fds_of)


def test_snapshot_reads_no_kernel_threads_environment(
    kernel_threads: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nor its environment, which has no tag: with PID 1 as the root, every other process is
    in its lineage, and the kernel threads born since boot were the only ones read."""
    from leakcheck.observe import procs, snapshot
    init = procs.process_key(1)
    younger = {
        pid
        for pid in kernel_threads
        if init is not None
        and (key := procs.process_key(pid)) is not None
        and key.start_ticks > init.start_ticks
    }
    if not younger:
        pytest.skip("no kernel thread younger than PID 1 here")
    read_tags_of = _pids_passed_to(monkeypatch, "tagged_session")
    snapshot.take_snapshot(root_pid=1, with_fds=False, host_memory=False, telemetry=False)
    assert 1 in read_tags_of  # the root's lineage: read
    assert not younger & set(read_tags_of)


def test_snapshot_scans_proc_while_nvml_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [overlapped start]: NVML's read (its start, in a fresh process) runs beside the
    /proc scan, not before it; this process's own descriptors are counted after that read,
    since NVML opens descriptors of its own meanwhile."""
    from leakcheck.observe import procs, snapshot
    scanned = threading.Event()
    events: list[str] = []
    real_scan_all = procs.scan_all
    real_nvidia_fds = procs.nvidia_fds

    def scan_all(**kwargs: Any) -> list[ProcInfo]:
        found = real_scan_all(**kwargs)
        scanned.set()
        return found

    def read_gpu_processes(*args: Any, **kwargs: Any) -> Any:
        # An NVML start that lasts until /proc has been scanned (at most 5 s).
        events.append("nvml scanned-meanwhile" if scanned.wait(5) else "nvml alone")
        return "no-gpu", "no NVIDIA GPU is visible to NVML", (), ()

    def nvidia_fds(pid: int) -> dict[int, str] | None:
        if pid == os.getpid():
            events.append("own descriptors")
        return real_nvidia_fds(pid)

    monkeypatch.setattr(procs, "scan_all", scan_all)
    monkeypatch.setattr(procs, "nvidia_fds", nvidia_fds)
    monkeypatch.setattr(snapshot, "read_gpu_processes", read_gpu_processes)
    taken = snapshot.take_snapshot(telemetry=False)
    assert events == ["nvml scanned-meanwhile", "own descriptors"]
    assert taken.attribution == "no-gpu"


def test_the_snapshot_leaves_out_nvmls_own_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own process holds NVML's descriptors: not a descriptor holder for those alone; any
    other /dev/nvidia* descriptor of its own still counts (a tracked training process's)."""
    from leakcheck.observe import nvml, procs, snapshot
    real_nvidia_fds = procs.nvidia_fds
    own = {7: "/dev/nvidiactl", 8: "/dev/nvidia0", 9: "/dev/nvidia-uvm"}

    def nvidia_fds(pid: int) -> dict[int, str] | None:
        return dict(own) if pid == os.getpid() else real_nvidia_fds(pid)

    monkeypatch.setattr(procs, "nvidia_fds", nvidia_fds)
    monkeypatch.setattr(nvml, "own_descriptors", lambda: frozenset({7, 8, 9}))
    taken = snapshot.take_snapshot(telemetry=False)
    assert os.getpid() not in {entry.info.key.pid for entry in taken.processes}

    monkeypatch.setattr(nvml, "own_descriptors", lambda: frozenset({7, 8}))  # 9: not NVML's
    taken = snapshot.take_snapshot(telemetry=False)
    mine = [entry for entry in taken.processes if entry.info.key.pid == os.getpid()]
    assert len(mine) == 1 and mine[0].nvidia_fds == 1
    assert "descriptor-holder" in mine[0].flags


def test_without_a_thread_to_be_had_the_snapshot_reads_nvml_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no thread can start (a thread limit; interpreter shutdown, as in an atexit
    handler), the snapshot and NVML's early start read on the caller's thread: no raise."""
    from leakcheck.observe import nvml, snapshot
    calls: list[str] = []

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    def read_gpu_processes(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        return "no-gpu", "no NVIDIA GPU is visible to NVML", (), ()

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    monkeypatch.setattr(snapshot, "read_gpu_processes", read_gpu_processes)
    nvml.start_in_background()  # no raise
    taken = snapshot.take_snapshot(root_pid=os.getpid(), with_fds=False, telemetry=False)
    assert calls == [threading.current_thread().name]
    assert taken.attribution == "no-gpu"
    assert os.getpid() in {entry.info.key.pid for entry in taken.processes}


def test_snapshot_survives_an_nvml_read_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """read_gpu_processes never raises; were it to, on its thread, the snapshot still comes
    back with the device side unknown rather than lost."""
    from leakcheck.observe import snapshot
    def read_gpu_processes(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("driver fell over")

    monkeypatch.setattr(snapshot, "read_gpu_processes", read_gpu_processes)
    taken = snapshot.take_snapshot(root_pid=os.getpid(), with_fds=False, telemetry=False)
    assert taken.attribution == "nvml-unavailable"
    assert "RuntimeError: driver fell over" in taken.attribution_reason
    assert taken.devices == ()
    assert os.getpid() in {entry.info.key.pid for entry in taken.processes}


def test_orphan_judgement_goes_by_the_roots_identity_in_the_tag() -> None:
    """NOTE [process identity]: the tag names its root by start ticks, which no clock moves.
    Its live parent is the root; the same PID with other ticks (a reused PID) is not; where
    the tag's ticks are unknown (0), a root PID naming a younger process is reused."""
    from leakcheck.observe import procs, snapshot
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        key, own = procs.process_key(child.pid), procs.process_key(os.getpid())
        assert key is not None and own is not None
        tag = procs.new_session_id()  # names this process, the child's parent
        assert procs.session_root_pid(tag) == own
        assert not snapshot._is_orphaned(tag, key)
        assert snapshot._is_orphaned(f"{own.pid}-{own.start_ticks + 1}-0000beef", key)
        assert not snapshot._is_orphaned(f"{own.pid}-0-0000beef", key)
        assert snapshot._is_orphaned(f"{child.pid}-0-0000beef", own)
    finally:
        child.kill()
        child.wait()


def test_main_module_runs_main() -> None:
    source = (REPO / "leakcheck" / "__main__.py").read_text()
    assert 'if __name__ == "__main__":' in textwrap.dedent(source)


def test_the_default_worker_counts_fit_the_usable_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, expected in [(1, (0, 1, 2)), (2, (0, 2, 4)), (4, (0, 4, 8)), (64, (0, 4, 8))]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert cli.default_workers() == expected


# --------------------------------------------------------------------------- streams that fail


def _leakcheck_to(args: list[str], stdout: Any, stderr: Any, cwd: Path) -> int:
    """``python -m leakcheck ARGS`` (``-c ...``: a shell's) with these standard streams (a
    pipe: its reader left)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    command = ["sh", *args] if args[0] == "-c" else [sys.executable, "-m", "leakcheck", *args]
    proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=cwd, env=env)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()  # as `| head` that has read its lines
    return proc.wait(timeout=300)


@pytest.mark.parametrize("stderr", ["/dev/full", "a closed pipe", "closed"])
def test_the_programs_status_comes_through_a_report_that_cannot_be_written(
    stderr: str, tmp_path: Path
) -> None:
    """`leakcheck run -- ... 2>&1 | head`: the report met a closed pipe (or a full disk, or no
    stderr at all) and the program's status 3 became 1, with a traceback."""
    args = ["run", "--", "python", "-c", "import sys; sys.exit(3)"]
    with contextlib.ExitStack() as files:
        err: Any = subprocess.PIPE
        if stderr == "/dev/full":
            err = files.enter_context(open(stderr, "w"))
        elif stderr == "closed":  # `2>&-`: sys.stderr is None
            args = ["-c", 'exec "$0" -m leakcheck "$@" 2>&-', sys.executable, *args]
        status = _leakcheck_to(args, subprocess.DEVNULL, err, tmp_path)
    assert status == 3


def test_a_sweep_whose_stderr_is_full_still_writes_its_report_and_json(tmp_path: Path) -> None:
    """Progress lines that cannot be written are left out; the sweep was lost (exit 1)."""
    json_path = tmp_path / "sweep.json"
    args = ["sweep", "--workers", "0", "--epochs", "1", "--batches", "1", "--json", str(json_path)]
    with open(tmp_path / "out.txt", "w") as out, open("/dev/full", "w") as full:
        status = _leakcheck_to(args, out, full, tmp_path)
    assert status == 0
    assert "leakcheck sweep: 1 configuration, verdict clean" in (tmp_path / "out.txt").read_text()
    assert json.loads(json_path.read_text())["verdict"] == "clean"


def test_explain_to_a_full_disk_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    with open("/dev/full", "w") as full, open(tmp_path / "err.txt", "w") as err:
        status = _leakcheck_to(["explain", "orphan"], full, err, tmp_path)
    assert status == 2
    assert (tmp_path / "err.txt").read_text().splitlines() == [
        "leakcheck explain: could not write the output: [Errno 28] No space left on device"
    ]


def test_a_program_whose_reader_left_is_no_death(tmp_path: Path) -> None:
    """`leakcheck run -- yes | head -1`: SIGPIPE was a leak, "killed (sender unknown)"."""
    json_path = tmp_path / "run.json"
    args = ["run", "--json", str(json_path), "--", "yes"]
    status = _leakcheck_to(args, subprocess.PIPE, subprocess.DEVNULL, tmp_path)
    assert status == 128 + signal.SIGPIPE
    data = json.loads(json_path.read_text())
    assert data["program"]["signal"] == signal.SIGPIPE
    assert data["verdict"] == "clean", data["tree"]["report"]["findings"]


@pytest.mark.parametrize("how", ["raises KeyboardInterrupt", "SIGTERM to run", "kills itself"])
def test_a_program_ended_by_a_signal_run_passed_on_or_an_interrupt_is_no_death(
    how: str, tmp_path: Path
) -> None:
    """`timeout 60 leakcheck run -- ...` (SIGTERM passed on) and a program that raises
    KeyboardInterrupt itself (Python then ends by SIGINT) were leaks, "killed (sender
    unknown)"; a program that kills itself is one still: nothing says who sent it."""
    json_path = tmp_path / "run.json"
    body = {
        "raises KeyboardInterrupt": "raise KeyboardInterrupt",
        "SIGTERM to run": "print('ready', flush=True); time.sleep(120)",
        "kills itself": "os.kill(os.getpid(), signal.SIGTERM); time.sleep(120)",
    }[how]
    program = f"import os, signal, sys, time\n{body}\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    command = [sys.executable, "-m", "leakcheck", "run", "--json", str(json_path), "--"]
    proc = subprocess.Popen(
        [*command, sys.executable, "-c", program],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        if how == "SIGTERM to run":
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sent = signal.SIGINT if how == "raises KeyboardInterrupt" else signal.SIGTERM
    assert proc.returncode == 128 + sent, stderr
    data = json.loads(json_path.read_text())
    assert data["program"]["signal"] == sent
    died = [f for f in data["tree"]["report"]["findings"] if f["rule"] == "died"]
    assert len(died) == (how == "kills itself"), stderr
    assert data["verdict"] == ("leak" if how == "kills itself" else "clean"), stderr
