"""The sweep engine in this process: rows, JSON, text, loader failures, cleanup, plot.

Loaders here are plain lists or DataLoaders without workers, so each test takes well under a
second; the CLI tests run real worker processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from leakcheck.commands.progress import Progress
from leakcheck.commands.sweep import (
    COLUMN_NAMES,
    TABLE_WIDTH,
    LoaderError,
    LoaderFactory,
    SweepOptions,
    SweepResult,
    cleanup_orphans,
    run_sweep,
    wait_for_cooldown,
)
from leakcheck.core.files import write_json
from leakcheck.core.model import MIB, ProcessKey
from leakcheck.core.units import format_mib
from leakcheck.observe import procs
from tests.polling import wait_for

NO_GPU = (False, "NVML unavailable: test without a GPU")
FAST = SweepOptions(workers=(0, 0), epochs=3, grace_s=0.2, interval_s=0.02)


def _list_factory(num_workers: int) -> list[int]:
    return list(range(5))


def _sweep(options: SweepOptions = FAST, factory: LoaderFactory = _list_factory) -> SweepResult:
    return run_sweep(options, factory, loader="test loader", gpu=NO_GPU)


def test_rows_per_configuration_and_epoch() -> None:
    result = _sweep()
    assert [config.num_workers for config in result.configs] == [0, 0]
    assert [[row.epoch for row in config.rows] for config in result.configs] == [[0, 1, 2]] * 2
    for config in result.configs:
        assert config.report.verdict == "clean"
        assert all(row.end_reason == "completed" for row in config.rows)
        # Without a GPU the GPU fields are unknown, not zero.
        assert all(row.parent_gpu_bytes is None for row in config.rows)
        assert all(row.device_used_bytes is None for row in config.rows)
    assert result.leak_count == 0
    assert result.verdict == "clean"


def test_json_has_schema_reports_and_is_serialisable(tmp_path: Path) -> None:
    result = _sweep()
    path = tmp_path / "sweep.json"
    write_json(str(path), result.to_dict())
    data = json.loads(path.read_text())
    assert data["schema"] == "leakcheck.commands.sweep"
    assert data["schema_version"] == 3
    assert data["gpu"] == {
        "available": False,
        "reason": NO_GPU[1],
        "reported_device": None,
        "devices": [],
    }
    assert data["options"]["workers"] == [0, 0]
    assert len(data["configurations"]) == 2
    config = data["configurations"][0]
    assert config["report"]["schema_version"] == 3
    assert len(config["report"]["epochs"]) == 3
    assert [row["epoch"] for row in config["rows"]] == [0, 1, 2]
    # GPU memory not read: unknown (null), never 0; the reason is why, not a switch.
    processes = [p for epoch in config["report"]["epochs"] for p in epoch["processes"]]
    assert processes and all(p["total_gpu_bytes_end"] is None for p in processes)
    assert all(p["total_gpu_bytes_peak"] is None for p in processes)
    assert "use_nvml" not in config["report"]["attribution_reason"]
    # Atomic write: no temporary file left beside it.
    assert os.listdir(tmp_path) == ["sweep.json"]


def test_text_has_table_verdicts_and_unavailable_gpu_columns() -> None:
    text = _sweep().format()
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("workers  epoch"))
    # Only the columns with data here: no GPU column without a GPU, no n/a cells.
    assert [cell.strip() for cell in header.split("  ") if cell.strip()] == [
        *("workers", "epoch", "time s", "alive after", "orphans", "host parent", "host wk"),
        "host",
    ]
    assert "GPU: not checked (test without a GPU): host memory and processes only" in text
    table = lines[lines.index(header) + 1 : lines.index(header) + 7]
    assert len(table) == 6 and not any("n/a" in line for line in table)
    assert all(len(line) <= TABLE_WIDTH for line in [header, *table])
    assert text.count("verdict CLEAN") == 2
    assert text.rstrip().endswith("verdict clean, 0 leaks")


def test_factory_failure_is_one_line_loader_error() -> None:
    def broken(num_workers: int) -> list[int]:
        raise FileNotFoundError("no data in /nowhere\nsecond line")

    with pytest.raises(LoaderError) as caught:
        _sweep(factory=broken)
    message = str(caught.value)
    assert "\n" not in message
    assert "broken(0) failed: FileNotFoundError: no data in /nowhere second line" in message


def test_factory_returning_non_iterable_is_refused() -> None:
    with pytest.raises(LoaderError, match=r"returned int, expected an iterable loader"):
        _sweep(factory=lambda num_workers: 42)  # type: ignore[arg-type, return-value]


def test_iteration_failure_names_configuration_and_epoch() -> None:
    def failing(num_workers: int) -> Iterable[int]:
        def batches() -> Iterator[int]:
            yield 1
            raise RuntimeError("worker died")

        class Loader:
            calls = 0

            def __iter__(self) -> Iterator[int]:
                Loader.calls += 1
                return iter([1, 2]) if Loader.calls == 1 else batches()

        return Loader()

    with pytest.raises(LoaderError, match=r"workers=0, epoch 1\) failed: RuntimeError: worker"):
        _sweep(factory=failing)


def test_persistent_workers_flag_only_with_workers() -> None:
    options = SweepOptions(workers=(0,), epochs=1, persistent=True, grace_s=0.1)
    result = _sweep(options)
    assert result.configs[0].persistent_workers is False


def test_plain_progress_lines_without_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(2, stream=stream)
    progress.begin("workers=0 epoch 1/2")
    progress.batch(1, 5)
    progress.end("5 batches")
    progress.close()
    assert stream.getvalue() == "leakcheck sweep: workers=0 epoch 1/2: 5 batches\n"


def test_bar_on_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(4, stream=stream, tty=True)
    progress.begin("workers=4 epoch 1/2")
    progress.end("done")
    progress.note("cooldown skipped")
    progress.close()
    text = stream.getvalue()
    assert "\r[" in text and "25%" in text and "workers=4 epoch 1/2" in text
    assert "leakcheck sweep: cooldown skipped\n" in text
    assert text.endswith("\r")  # the bar is erased, the terminal left clean


# --------------------------------------------------------------------------- cleanup

_LAUNCH = (
    "import subprocess, sys; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); "
    "time.sleep(60)'], stdout=sys.stdout); print(p.pid, flush=True)"
)


def _reparented_sleeper(session: str | None) -> psutil.Process:
    """A sleeper whose parent exited (so it is reparented away), tagged with ``session``."""
    env = {k: v for k, v in os.environ.items() if k != "LEAKCHECK_SESSION"}
    if session is not None:
        env["LEAKCHECK_SESSION"] = session
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH], stdout=subprocess.PIPE, text=True, env=env
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    launcher.stdout.readline()  # the sleeper runs
    launcher.wait()
    launcher.stdout.close()
    return psutil.Process(pid)


def test_cleanup_terminates_only_this_sessions_orphans() -> None:
    session = f"sweep-test-{os.getpid()}-{time.time_ns()}"
    ours = _reparented_sleeper(session)
    other = _reparented_sleeper(session + "-other")
    untagged = _reparented_sleeper(None)
    try:
        assert procs.tagged_session(ours.pid) == session
        key = procs.process_key(ours.pid)
        procs.boot_time_s.cache_clear()  # kept for the process's life: read at its start
        boot_before_s = psutil.boot_time()
        cleaned = cleanup_orphans(session)
        boots_s = (boot_before_s, psutil.boot_time())  # two where the wall clock stepped
        assert [(c.pid, c.outcome) for c in cleaned] == [(ours.pid, "terminated")]
        assert key is not None and cleaned[0].start_ticks == key.start_ticks
        # Shown as psutil shows it: start ticks over the clock rate, plus btime.
        ticks_s = key.start_ticks / os.sysconf("SC_CLK_TCK")
        assert cleaned[0].create_time in {ticks_s + boot_s for boot_s in boots_s}
        assert not ours.is_running() or ours.status() == psutil.STATUS_ZOMBIE
        assert other.is_running() and untagged.is_running()
    finally:
        for process in (ours, other, untagged):
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_cleanup_leaves_own_children_alone() -> None:
    session = f"sweep-child-{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "LEAKCHECK_SESSION": session}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        # Exec'd with the tag (before, it is not the session's to find at all).
        assert wait_for(lambda: procs.tagged_session(child.pid) == session)
        assert cleanup_orphans(session) == ()
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_builtin_orphan_without_workers_is_found_and_cleaned_up() -> None:
    """0 workers: the parent's own grandchild (through a launcher) is the orphan."""
    from leakcheck.commands.workload import WorkloadSpec, builtin_factory

    spec = WorkloadSpec(scenario="orphan", batches=2, orphan_lifetime_s=30)
    options = SweepOptions(workers=(0,), epochs=2, grace_s=0.3, interval_s=0.02)
    result = run_sweep(options, builtin_factory(spec), loader="built-in", gpu=NO_GPU)
    config = result.configs[0]
    orphans = [f for f in config.report.leaks if f.rule == "orphan"]
    assert len(orphans) == 1  # one per process that ran the dataset, not one per epoch
    assert orphans[0].cmdline is not None
    assert "leakcheck sweep --scenario orphan" in orphans[0].cmdline
    assert [(c.pid, c.outcome) for c in config.cleaned] == [(orphans[0].pid, "terminated")]
    assert orphans[0].pid is not None
    assert not procs.is_alive(ProcessKey(orphans[0].pid, orphans[0].start_ticks or 0))
    assert "cleanup: terminated PID" in result.format()


# --------------------------------------------------------------------------- fake GPU
# NVML faked at the pynvml boundary only: the GPU columns, telemetry and cooldown paths.


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from tests.fake_pynvml import FakeDevice, FakeProcess, FakePynvml, reset_nvml

    device = FakeDevice(
        used_bytes=2000 * MIB,
        total_bytes=80 * 1024 * MIB,
        compute=[FakeProcess(os.getpid(), 600 * MIB)],
        temperature_c=52,
        sm_clock_mhz=1410,
        power_mw=123_000,
    )
    monkeypatch.setitem(sys.modules, "leakcheck.observe.nvml_lib", FakePynvml([device]))
    reset_nvml()
    yield device
    reset_nvml()


def test_gpu_columns_with_nvml(fake_gpu: Any, tmp_path: Path) -> None:
    from leakcheck.observe import nvml
    options = SweepOptions(workers=(0,), epochs=2, grace_s=0.1, interval_s=0.02)
    result = run_sweep(options, _list_factory, loader="test loader", gpu=nvml.availability())
    assert result.gpu_available
    row = result.configs[0].rows[-1]
    assert row.parent_gpu_bytes == 600 * MIB
    assert (row.device_used_bytes, row.device_total_bytes) == (2000 * MIB, 80 * 1024 * MIB)
    assert (row.temperature_c, row.sm_clock_mhz, row.power_w) == (52, 1410, 123.0)
    text = result.format()
    assert "GPU 0: NVIDIA Fake H200, 81920 MiB" in text
    # The table row of workers=0, epoch 1.
    (line,) = [
        ln for ln in text.splitlines() if ln.split()[:3] == ["0", "1", f"{row.duration_s:.2f}"]
    ]
    assert line.split()[3:5] == ["600", "0"]  # the parent's GPU memory; no workers: peak 0
    # Host memory: the parent's, no workers, and what it is.
    assert line.split()[7:10] == [format_mib(row.parent_host_bytes), "0", row.host_source]
    assert line.split()[10:] == ["2000", "52"]  # the device's used memory, its temperature
    assert all(len(ln) <= TABLE_WIDTH for ln in text.splitlines() if ln.startswith(" ")), text
    assert result.to_dict()["gpu"]["devices"][0]["name"] == "NVIDIA Fake H200"
    if importlib.util.find_spec("matplotlib") is not None:
        from leakcheck.judge.plot import plot_sweep

        plot_sweep(result, str(tmp_path / "gpu.png"))
        assert (tmp_path / "gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cooldown_waits_until_cool(fake_gpu: Any) -> None:
    fake_gpu.temperature_c = 60
    calls = sys.modules["leakcheck.observe.nvml_lib"].calls
    reads = calls["nvmlDeviceGetTemperature"]

    def cool_down() -> None:
        # Cool once the wait has begun (read 60 °C twice), and 0.15 s into it at the least.
        assert wait_for(lambda: calls["nvmlDeviceGetTemperature"] >= reads + 2)
        time.sleep(0.15)
        fake_gpu.temperature_c = 40

    thread = threading.Thread(target=cool_down)
    thread.start()
    cooldown = wait_for_cooldown(45, 30.0, poll_s=0.02)
    thread.join()
    assert cooldown.reached and (cooldown.start_c, cooldown.end_c) == (60, 40)
    assert 0.1 < cooldown.waited_s < 30.0
    assert "cooldown to 45 °C reached: 60 -> 40 °C" in cooldown.describe()


def test_cooldown_gives_up_after_timeout(fake_gpu: Any) -> None:
    fake_gpu.temperature_c = 80
    cooldown = wait_for_cooldown(45, 0.1, poll_s=0.02)
    assert not cooldown.reached and cooldown.end_c == 80
    assert "NOT reached (timeout)" in cooldown.describe()


def test_cooldown_recorded_without_gpu() -> None:
    options = SweepOptions(workers=(0,), epochs=1, grace_s=0.1, cooldown_temp_c=45)
    result = _sweep(options)
    cooldown = result.configs[0].cooldown
    assert cooldown is not None and cooldown.note == "skipped: no GPU to read"
    assert result.to_dict()["configurations"][0]["cooldown"]["note"] == cooldown.note
    assert "cooldown to 45 °C: skipped: no GPU to read" in result.format()


# --------------------------------------------------------------------------- plot


def test_plot_writes_png_without_gpu(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from leakcheck.judge.plot import plot_sweep

    path = tmp_path / "sweep.png"
    plot_sweep(_sweep(), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert os.listdir(tmp_path) == ["sweep.png"]


def test_plot_does_not_touch_pyplot_backend() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    before = matplotlib.get_backend()
    from leakcheck.judge.plot import render

    render(_sweep(SweepOptions(workers=(0,), epochs=1, grace_s=0.1)))
    assert matplotlib.get_backend() == before


# --------------------------------------------------------------------------- --loader
# A user's DataLoader goes through watch()'s code path: the chained worker_init_fn gives
# exact identities through the mailbox, the workers' reports at exit, the teardown policy.

_USER_LOADER = """
import os
from pathlib import Path

from torch.utils.data import DataLoader


def _mark(worker_id):
    Path(os.environ["SWEEP_TEST_MARKS"], str(os.getpid())).write_text(str(worker_id))


def make(num_workers):
    return DataLoader(list(range(8)), batch_size=2, num_workers=num_workers,
                      multiprocessing_context="fork" if num_workers else None,
                      worker_init_fn=_mark)


def make_persistent(num_workers):
    return DataLoader(list(range(8)), batch_size=2, num_workers=num_workers,
                      multiprocessing_context="fork" if num_workers else None,
                      persistent_workers=num_workers > 0)
"""


@pytest.fixture
def user_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """A ``--loader`` file (unique module name) and the folder its workers mark."""
    marks = tmp_path / "marks"
    marks.mkdir()
    path = tmp_path / f"sweep_user_loader_{os.getpid()}_{time.monotonic_ns()}.py"
    path.write_text(_USER_LOADER)
    monkeypatch.setenv("SWEEP_TEST_MARKS", str(marks))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield path, marks


def _worker_keys(config: Any) -> list[ProcessKey]:
    return sorted(
        p.key for rec in config.report.epochs for p in rec.processes if p.role == "worker"
    )


def test_user_dataloader_gets_identities_and_the_teardown_policy(
    user_loader: tuple[Path, Path],
) -> None:
    from leakcheck.commands.cli import load_factory

    path, marks = user_loader
    # Every worker exits by its epoch's end or its configuration's: a grace for a loaded
    # host costs nothing (close() waits only for what is alive).
    options = SweepOptions(workers=(2,), epochs=2, grace_s=30, interval_s=0.02)
    result = run_sweep(options, load_factory(f"{path}:make"), loader="--loader", gpu=NO_GPU)
    (config,) = result.configs
    assert config.report.verdict == "clean", config.report.format()
    assert [row.worker_count for row in config.rows] == [2, 2]
    assert [row.batches for row in config.rows] == [4, 4]
    # Every worker reported at exit, and the policy ran in each (teardown on by default).
    teardowns = config.report.timeline.teardowns
    assert len(teardowns) == 4 and all(t.released for t in teardowns)
    assert sorted(t.worker_id for t in teardowns if t.worker_id is not None) == [0, 0, 1, 1]
    # The workers of the report are exactly those that reported through the mailbox...
    assert _worker_keys(config) == sorted(t.key for t in teardowns)
    # ... and exactly the processes that ran the user's own worker_init_fn (still chained).
    assert {key.pid for key in _worker_keys(config)} == {int(n) for n in os.listdir(marks)}
    summary = config.to_dict()["teardown"]
    assert (summary["workers"], summary["reported"]) == (4, 4)
    assert "teardown: 4 workers exited through the teardown policy" in result.format()


def test_user_dataloader_without_teardown_still_reports(user_loader: tuple[Path, Path]) -> None:
    from leakcheck.commands.cli import load_factory

    path, _ = user_loader
    options = SweepOptions(workers=(1,), epochs=2, grace_s=30, interval_s=0.02, teardown=False)
    result = run_sweep(options, load_factory(f"{path}:make"), loader="--loader", gpu=NO_GPU)
    (config,) = result.configs
    teardowns = config.report.timeline.teardowns
    assert len(teardowns) == 2 and not any(t.released for t in teardowns)
    assert _worker_keys(config) == sorted(t.key for t in teardowns)
    summary = config.to_dict()["teardown"]
    assert (summary["workers"], summary["reported"]) == (0, 2)
    text = result.format()
    assert "teardown policy off" in text
    assert "teardown: policy off; 2 workers reported what they held at exit" in text


def test_user_persistent_workers_exit_within_their_configuration(
    user_loader: tuple[Path, Path],
) -> None:
    """The loader's own persistent_workers counts; its workers stop before the tracker does."""
    from leakcheck.commands.cli import load_factory

    path, _ = user_loader
    options = SweepOptions(workers=(2,), epochs=3, grace_s=30, interval_s=0.02)
    factory = load_factory(f"{path}:make_persistent")
    result = run_sweep(options, factory, loader="--loader", gpu=NO_GPU)
    (config,) = result.configs
    assert config.persistent_workers is True
    assert config.report.verdict == "clean", config.report.format()
    assert [row.worker_count for row in config.rows] == [2, 2, 2]
    keys = set(_worker_keys(config))
    assert len(keys) == 2  # the same two workers in every epoch
    # They were shut down while this configuration was tracked: their reports are in it.
    assert {t.key for t in config.report.timeline.teardowns} == keys
    assert not any(procs.is_alive(key) for key in keys)


# --------------------------------------------------------------------------- unknown peaks


def _synthetic_result() -> SweepResult:
    """Three epochs of 2 workers on a GPU, built directly (no tracker, no processes).

    Epoch 0: both workers exited and reported 710 MiB each. Epoch 1: one reported, one
    exited unseen and reported nothing (unknown). Epoch 2: a parent of 3000 MiB and one
    worker alive at the end, sampled (100 MiB at the end, 1000 MiB peak).
    """
    from dataclasses import replace

    from leakcheck.commands.sweep import ConfigResult
    from leakcheck.core.model import RuleConfig
    from leakcheck.judge.report import build_report
    from tests import timelines as tl

    def reported(pid: int) -> Any:
        gone = tl.proc(pid, born=True, alive=False, gpu_mib=0, peak_mib=710)
        return replace(gone, gpu_bytes_end={}, gpu_peak_source="reported")

    unseen = replace(
        tl.proc(1004, born=True, alive=False), gpu_bytes_end={}, gpu_bytes_peak={},
        gpu_peak_source="unknown",
    )  # fmt: skip
    sampled = tl.proc(1005, born=True, alive=True, gpu_mib=100, peak_mib=1000)
    gpu = [tl.device(0, 4000, temp_c=40, sm_mhz=1980, power_w=120.0)]
    epochs = [
        tl.epoch(0, [tl.parent(700), reported(1001), reported(1002)], gpu),
        tl.epoch(1, [tl.parent(700), reported(1003), unseen], gpu),
        tl.epoch(2, [tl.parent(3000), sampled], gpu),
    ]
    final = tl.final_state([tl.parent(700)], gpu, after_last_epoch=epochs)
    report = build_report(tl.timeline(epochs, final=final), RuleConfig())
    config = ConfigResult(num_workers=2, persistent_workers=False, report=report)
    return SweepResult(
        options=SweepOptions(workers=(2,), epochs=3),
        loader="synthetic",
        configs=(config,),
        gpu_available=True,
        gpu_reason="",
        devices=tuple(gpu),
    )


def test_unknown_worker_peak_is_question_mark_and_null_never_zero() -> None:
    result = _synthetic_result()
    rows = result.configs[0].rows
    assert [row.workers_gpu_bytes_peak for row in rows] == [1420 * MIB, None, 1000 * MIB]
    assert [row.workers_peak_reported for row in rows] == [2, 1, 0]
    assert [row.workers_peak_unknown for row in rows] == [0, 1, 0]
    for row in rows:  # peak >= end, wherever the peak is known
        assert row.workers_gpu_bytes is not None
        if row.workers_gpu_bytes_peak is not None:
            assert row.workers_gpu_bytes_peak >= row.workers_gpu_bytes
    text = result.format()
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("workers  epoch"))
    names = [name for name in COLUMN_NAMES if name in header]
    assert names[:5] == ["workers", "epoch", "time s", "GPU parent", "GPU wk peak"]
    table = [line.split() for line in lines[lines.index(header) + 1 :][:3]]
    # workers, epoch, time, GPU parent, GPU wk peak
    assert [cells[4] for cells in table] == ["1420", "?", "1000"]
    assert "? = not known, not 0: 1 worker in 1 epoch exited before any read saw them" in text
    data = json.loads(json.dumps(result.to_dict()))
    row = data["configurations"][0]["rows"][1]
    assert row["workers_gpu_bytes_peak"] is None
    assert (row["workers_peak_reported"], row["workers_peak_unknown"]) == (1, 1)


def test_known_peaks_need_no_question_mark_note(fake_gpu: Any) -> None:
    from leakcheck.observe import nvml
    options = SweepOptions(workers=(0,), epochs=2, grace_s=0.1, interval_s=0.02)
    result = run_sweep(options, _list_factory, loader="test loader", gpu=nvml.availability())
    assert [row.workers_peak_unknown for row in result.configs[0].rows] == [0, 0]
    text = result.format()
    assert "? = not known" not in text
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("workers  epoch"))
    table = lines[lines.index(header) + 1 :][:2]
    assert not any("?" in line.split() for line in table)


def _memory_axes(figure: Any) -> Any:
    (axes,) = [a for a in figure.axes if a.get_ylabel() == "GPU memory (MiB)"]
    return axes


def _line(axes: Any, prefix: str) -> Any:
    (line,) = [ln for ln in axes.get_lines() if ln.get_label().startswith(prefix)]
    return line


def test_plot_worker_peak_is_stacked_on_its_bar_and_unknown_is_a_gap() -> None:
    pytest.importorskip("matplotlib")
    import math

    from leakcheck.judge.plot import render

    result = _synthetic_result()
    axes = _memory_axes(render(result))
    parent_bars, worker_bars, _others = axes.containers
    bar_tops = [patch.get_y() + patch.get_height() for patch in worker_bars.patches]
    assert bar_tops == pytest.approx([700, 700, 3100])
    assert [patch.get_y() for patch in worker_bars.patches] == pytest.approx(
        [patch.get_height() for patch in parent_bars.patches]
    )
    peak = _line(axes, "parent + workers' peak")
    x, y = list(peak.get_xdata()), [float(v) for v in peak.get_ydata()]
    assert x == [0, 1, 2]
    # Stacked on the parent, like the bar: never below the bar's top (3000 + 1000 here,
    # where the workers' peak alone, 1000, would run below the 3100 MiB bar).
    assert y[0] == pytest.approx(700 + 1420) and y[2] == pytest.approx(3000 + 1000)
    for value, top in zip(y, bar_tops, strict=True):
        assert math.isnan(value) or value >= top
    # The unknown peak is a gap in the line and a "?" on its bar, never a 0.
    assert math.isnan(y[1])
    marker = _line(axes, "workers' peak unknown")
    assert list(marker.get_xdata()) == [1]
    assert [float(v) for v in marker.get_ydata()] == pytest.approx([bar_tops[1]])
    assert marker.get_marker() == "$?$"
    for line in axes.get_lines():
        assert 0.0 not in [float(v) for v in line.get_ydata()], line.get_label()


def test_plot_module_never_imports_the_sweep() -> None:
    import ast

    import leakcheck.judge.plot

    tree = ast.parse(Path(leakcheck.judge.plot.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            imported.add(module)
            imported.update(f"{module}.{alias.name}" for alias in node.names)
    assert not [name for name in imported if name.split(".")[:2] == ["leakcheck", "sweep"]]


# --------------------------------------------------------------------------- output files


def test_output_never_replaces_a_fifo_or_a_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import stat

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=r"it is a FIFO \(named pipe\), not a regular file"):
        write_json(str(fifo), {"a": 1})
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bound by a relative name: a socket's path has room for 107 bytes, and the temp
        # folder's path may take more.
        monkeypatch.chdir(tmp_path)
        listener.bind("sock.png")
        pytest.importorskip("matplotlib")
        from leakcheck.judge.plot import plot_sweep

        with pytest.raises(OSError, match=r"it is a socket, not a regular file"):
            plot_sweep(_sweep(SweepOptions(workers=(0,), epochs=1, grace_s=0.1)),
                       str(tmp_path / "sock.png"))  # fmt: skip
        assert stat.S_ISSOCK(os.stat(tmp_path / "sock.png").st_mode)
    finally:
        listener.close()
    assert sorted(os.listdir(tmp_path)) == ["out.json", "sock.png"]  # no temporary left


def test_output_through_a_link_and_onto_a_folder(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_json(str(link), {"a": 1})
    assert link.is_symlink() and json.loads(real.read_text()) == {"a": 1}
    # A folder in the way: the error a rename onto it gives, nothing left behind.
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(IsADirectoryError, match=r"\[Errno 21\] Is a directory"):
        write_json(str(tmp_path / "folder.json"), {"a": 1})
    assert sorted(os.listdir(tmp_path)) == ["folder.json", "link.json", "real.json"]


@pytest.mark.parametrize("mode", [0o600, 0o444, 0o640])
def test_output_onto_an_existing_file_keeps_its_mode(tmp_path: Path, mode: int) -> None:
    """As ``open(path, "w")`` would: a private file stays private (through a link too)."""
    import stat

    real = tmp_path / "keep.json"
    real.write_text("{}")
    real.chmod(mode)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_json(str(link), {"a": 1})
    assert stat.S_IMODE(os.stat(real).st_mode) == mode
    assert json.loads(real.read_text()) == {"a": 1}
    new = tmp_path / "new.json"
    write_json(str(new), {"b": 2})
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o666 & ~umask


def test_host_rows_and_plot_panel_without_a_gpu() -> None:
    """Host memory per epoch: the rows say USS or RSS; the plot keeps one measure a line."""
    from dataclasses import replace

    from leakcheck.commands.sweep import ConfigResult
    from leakcheck.core.model import RuleConfig
    from leakcheck.judge.report import build_report
    from tests import timelines as tl

    unreported = replace(tl.proc(1003, born=True, alive=False), gpu_peak_source="unknown")
    epochs = [
        tl.epoch(0, [tl.parent(None, uss_mib=300, rss_mib=500), tl.proc(1001, uss_mib=50)]),
        tl.epoch(1, [tl.parent(None, uss_mib=310, rss_mib=500), tl.proc(1002, rss_mib=400)]),
        tl.epoch(2, [tl.parent(None, uss_mib=320, rss_mib=500), unreported]),
    ]
    report = build_report(tl.timeline(epochs, attribution="nvml-unavailable"), RuleConfig())
    config = ConfigResult(num_workers=1, persistent_workers=False, report=report)
    rows = config.rows
    assert [(r.parent_host_bytes, r.workers_host_bytes, r.host_source) for r in rows] == [
        (300 * MIB, 50 * MIB, "uss"),
        (310 * MIB, 400 * MIB, "uss+rss"),
        (320 * MIB, None, "uss"),
    ]
    result = SweepResult(
        options=SweepOptions(workers=(1,), epochs=3),
        loader="synthetic",
        configs=(config,),
        gpu_available=False,
        gpu_reason="no GPU here",
    )
    cells = [line.split() for line in result.format().splitlines() if line.startswith("      1")]
    assert [c[5:8] for c in cells] == [
        ["300", "50", "uss"],
        ["310", "400", "uss+rss"],
        ["320", "?", "uss"],
    ]
    pytest.importorskip("matplotlib")
    import math

    from leakcheck.judge.plot import render

    host = next(a for a in render(result).axes if a.get_ylabel().startswith("host memory"))

    def line(label: str) -> list[float | None]:
        ys = [float(v) for v in _line(host, label).get_ydata()]
        return [None if math.isnan(v) else v for v in ys]

    # One measure per line (issue 32): a worker's USS never continues as another's RSS, a
    # missing read is a gap, never a 0 or the other measure.
    assert line("parent USS") == [300, 310, 320]
    assert line("parent RSS") == [500, 500, 500]
    assert line("workers USS") == [50, None, None]
    assert line("workers RSS") == [None, 400, None]
    assert not host.containers  # no stacked bars mixing the measures


def test_copy_rows_and_the_plot_show_private_against_shared_per_worker() -> None:
    """Forked workers' copies of the parent's memory: summed per row, and one worker's
    private memory beside what it still shares."""
    from leakcheck.commands.sweep import ConfigResult
    from leakcheck.core.model import RuleConfig
    from leakcheck.judge.report import build_report
    from tests import timelines as tl

    epochs = [
        tl.epoch(i, [tl.parent(None, uss_mib=240), tl.copier(1001, 173), tl.copier(1002, 171)])
        for i in range(2)
    ] + [tl.epoch(2, [tl.parent(None, uss_mib=240), tl.copier(1003, None, forked=False)])]
    report = build_report(tl.timeline(epochs, attribution="nvml-unavailable"), RuleConfig())
    config = ConfigResult(num_workers=2, persistent_workers=True, report=report)
    rows = config.rows
    assert [(r.workers_copied_bytes, r.workers_shared_bytes) for r in rows] == [
        (344 * MIB, 56 * MIB), (344 * MIB, 56 * MIB), (None, None)
    ]  # fmt: skip
    data = json.loads(json.dumps(dataclasses.asdict(rows[0])))
    assert data["workers_copied_bytes"] == 344 * MIB
    pytest.importorskip("matplotlib")
    import math

    from leakcheck.judge.plot import render

    result = SweepResult(
        options=SweepOptions(workers=(2,), epochs=3),
        loader="synthetic",
        configs=(config,),
        gpu_available=False,
        gpu_reason="no GPU here",
    )
    host = next(a for a in render(result).axes if a.get_ylabel().startswith("host"))
    private = [float(v) for v in _line(host, "one worker: private").get_ydata()]
    shared = [float(v) for v in _line(host, "one worker: still shared").get_ydata()]
    assert private[:2] == pytest.approx([181, 181]) and shared[:2] == pytest.approx([28, 28])
    assert math.isnan(private[2]) and math.isnan(shared[2])  # spawned: nothing to tell


def test_progress_lines_give_no_gpu_memory_where_it_was_not_read() -> None:
    """Each epoch's progress line gives the parent's and workers' GPU MiB only where NVML
    read them per process: otherwise none (never 0; the header says why: NO_GPU)."""
    stream = io.StringIO()
    options = SweepOptions(workers=(0,), epochs=2, grace_s=0.2, interval_s=0.02)
    progress = Progress(options.epochs, stream=stream, tty=False)
    run_sweep(options, _list_factory, loader="test loader", progress=progress, gpu=NO_GPU)
    lines = [line for line in stream.getvalue().splitlines() if "batches in" in line]
    assert len(lines) == 2, stream.getvalue()
    assert all(", 0 workers; host " in line and "GPU" not in line for line in lines), lines


@pytest.mark.parametrize(
    ("epoch_s", "cost_s", "shown"),
    [
        (1.0, 0.06, True),  # 2% of 3 s of epochs: worth a line
        (1.0, 0.015, False),  # 0.5%: nothing to say
        (0.01, 0.02, False),  # 67% of 30 ms: a share of a loop too short to time
    ],
)
def test_the_cost_line_shows_only_where_it_means_something(
    epoch_s: float, cost_s: float, shown: bool
) -> None:
    """At least 1% of a loop of at least 1 s; the JSON has the cost either way."""
    from dataclasses import replace

    from leakcheck.core.model import TrackerCost

    result = _synthetic_result()
    config = result.configs[0]
    epochs = tuple(
        replace(rec, start_s=i * epoch_s, end_s=(i + 1) * epoch_s)
        for i, rec in enumerate(config.report.timeline.epochs)
    )
    report = replace(config.report, timeline=replace(config.report.timeline, epochs=epochs))
    cost = TrackerCost(
        samples=10,
        sample_wall_s=0.0,
        sampler_cpu_s=cost_s / 2,
        caller_wall_s=cost_s / 2,
        nvml_wall_s=0.0,
        nvml_cpu_s=0.0,
    )
    result = replace(result, configs=(replace(config, report=report, cost=cost),))
    assert ("tracker cost:" in result.format()) is shown
    data = result.to_dict()["configurations"][0]
    assert data["accounted_cost_fraction"] == pytest.approx(cost_s / (3 * epoch_s))
    assert data["tracker_ms_per_epoch"] == pytest.approx(cost_s / 2 * 1000 / 3)


def test_library_warnings_wait_for_the_progress_line_and_show_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torch warns of too many workers at every configuration's iterator: on a terminal that
    broke the progress line; held during the sweep, each text is shown once after it."""

    def warning_factory(num_workers: int) -> list[int]:
        class Warns(list[int]):
            def __iter__(self) -> Any:
                warnings.warn(
                    "This DataLoader will create too many workers", UserWarning, stacklevel=2
                )
                return super().__iter__()

        return Warns([1, 2, 3])

    class Closing(Progress):
        closed = False

        def close(self) -> None:
            super().close()
            self.closed = True

    progress = Closing(4, stream=io.StringIO(), tty=True)
    shown: list[tuple[str, bool]] = []  # each warning, and whether the bar was gone by then

    def show(message: Warning | str, *args: object, **kwargs: object) -> None:
        shown.append((str(message), progress.closed))

    options = SweepOptions(workers=(0, 0), epochs=2, grace_s=0.1, interval_s=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        run_sweep(options, warning_factory, loader="test loader", progress=progress, gpu=NO_GPU)
    assert shown == [("This DataLoader will create too many workers", True)], shown


# --------------------------------------------------------------------------- worker count


@pytest.mark.parametrize(
    ("rates", "chosen"),
    [
        ({0: 100.0, 2: 190.0, 4: 200.0, 8: 199.0}, 2),  # 190 is within 5% of 200
        ({0: 100.0, 2: 189.0, 4: 200.0, 8: 199.0}, 4),  # 189 is not: the best, fewer than 8
        ({4: 50.0, 0: 51.0}, 0),  # the smallest count, in whatever order the sweep ran
        ({0: None, 2: 10.0}, 2),  # not measured: left out
        ({0: None}, None),
        ({}, None),
    ],
)
def test_the_recommendation_is_the_fewest_workers_within_5_percent_of_the_best(
    rates: dict[int, float | None], chosen: int | None
) -> None:
    from leakcheck.commands.sweep import recommend_workers

    assert recommend_workers(rates) == chosen


def _timed_result(gpu: bool, rates: dict[int, tuple[int | None, int | None]]) -> SweepResult:
    """Configs of two 1.1-second epochs of 10 batches, each looped in 1 s, each worker count
    with its samples per epoch and its workers' host bytes per epoch (None: the workers'
    unknown); GPU peaks 300 MiB each."""
    from dataclasses import replace

    from leakcheck.commands.sweep import ConfigResult
    from leakcheck.core.model import RuleConfig
    from leakcheck.judge.report import build_report
    from tests import timelines as tl

    def config(n: int, samples: int | None, host: int | None) -> ConfigResult:
        uss_mib = None if host is None or not n else host / n / MIB
        epochs = [
            replace(tl.epoch(epoch, [tl.parent(None), *(
                tl.proc(1000 + 10 * epoch + i, uss_mib=uss_mib, peak_mib=300 if gpu else None)
                for i in range(n)
            )], duration_s=1.1), batches=10)
            for epoch in (0, 1)
        ]  # fmt: skip
        timeline = tl.timeline(epochs, attribution="ok" if gpu else "no-gpu")
        report = build_report(timeline, RuleConfig())
        timings = ((samples, 0.25, 1.0), (samples, 0.5, 1.0))
        return ConfigResult(num_workers=n, persistent_workers=False, report=report, timings=timings)

    configs = tuple(config(n, samples, host) for n, (samples, host) in rates.items())
    workers = tuple(rates)
    return SweepResult(
        options=SweepOptions(workers=workers, epochs=2),
        loader="synthetic",
        configs=configs,
        gpu_available=gpu,
        gpu_reason="" if gpu else "no GPU here",
    )


def test_the_worker_count_answer_in_text_and_json_from_recorded_numbers() -> None:
    result = _timed_result(
        gpu=False, rates={0: (1000, 0), 2: (1960, 80 * MIB), 4: (2000, None), 8: (1990, None)}
    )
    config = result.configs[1]
    assert config.throughput["samples_per_s"] == pytest.approx(1960.0)
    assert config.throughput["batches_per_s"] == pytest.approx(10.0)
    assert config.throughput["wait_share"] == pytest.approx(0.375)  # (0.25 + 0.5) s of 2 s
    assert config.throughput["worker_host_bytes"] == 40 * MIB  # per worker, not summed
    assert result.configs[2].throughput["worker_host_bytes"] is None  # unknown, never 0
    assert config.throughput["worker_gpu_bytes"] is None  # not read

    data = result.to_dict()
    assert data["recommendation"] == {
        "num_workers": 2,
        "rate_per_s": pytest.approx(1960.0),
        "unit": "samples",
        "best_workers": 4,
        "best_rate_per_s": pytest.approx(2000.0),
        "worker_host_bytes": 40 * MIB,
        "worker_gpu_bytes": None,
    }
    assert data["configurations"][1]["throughput"]["wait_share"] == pytest.approx(0.375)
    json.dumps(data)

    text = result.format().splitlines()
    start = text.index(next(line for line in text if line.startswith("workers  samples/s")))
    assert [line.split() for line in text[start : start + 5]] == [
        ["workers", "samples/s", "host", "MiB/wk"],  # no GPU column without one
        ["0", "1,000", "-"],
        ["2", "1,960", "40"],
        ["4", "2,000", "?"],
        ["8", "1,990", "?"],
    ]
    assert text[start + 5] == (
        "recommended: 2 workers (1,960 samples/s, within 5% of the best, 2,000 at 4); "
        "costs host 80 MiB (40 per worker)"
    )
    assert all(len(line) <= TABLE_WIDTH for line in text[start : start + 6])


def test_host_memory_never_read_is_a_dash_not_zero_in_the_sweep_table() -> None:
    """The sweep's table reads the report's row (``EpochRow``): where no host memory was read
    at all, the workers' cell is "-" as in the report's table, even without workers."""
    result = _timed_result(gpu=False, rates={0: (1000, 0), 2: (1960, 80 * MIB)})
    lines = result.format().splitlines()
    header = next(line for line in lines if line.startswith("workers  epoch"))
    names = [cell.strip() for cell in header.split("  ") if cell.strip()]
    rows = [line.split() for line in lines[lines.index(header) + 1 :][:4]]
    column = names.index("host wk")
    assert [row[column] for row in rows] == ["-", "-", "80", "80"]


def test_the_answer_falls_back_to_batches_and_states_gpu_memory_where_read() -> None:
    # A batch whose size could not be read: batches per second, said so.
    result = _timed_result(gpu=True, rates={0: (None, 0), 4: (None, 4 * 50 * MIB)})
    assert result.configs[1].throughput["samples_per_s"] is None
    lines = result.format().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("workers  batches/s")))
    assert lines[start].split() == ["workers", "batches/s", "host", "MiB/wk", "GPU", "MiB/wk"]
    assert lines[start + 3] == "recommended: 0 workers (10 batches/s, the best); no worker memory"
    # Equal throughput: the fewest workers. With workers, both memories are their cost.
    answer = _timed_result(gpu=True, rates={2: (500, 2 * 50 * MIB)}).recommendation_line
    assert answer == (
        "recommended: 2 workers (500 samples/s, the best); costs host 100 MiB (50 per worker), "
        "GPU 600 MiB (300 per worker)"
    )


def test_batch_samples_reads_the_leading_dimension_of_the_first_tensor() -> None:
    import torch

    from leakcheck.commands.sweep import batch_samples

    x = torch.zeros(8, 3)
    assert batch_samples(x) == 8
    assert batch_samples((x, torch.zeros(8))) == 8
    assert batch_samples([{"image": x, "label": torch.zeros(8)}]) == 8
    assert batch_samples({"ids": torch.zeros(5, 2)}) == 5
    assert batch_samples(3) is None and batch_samples([]) is None
    assert batch_samples(torch.tensor(1.0)) is None  # 0-dim: no batch dimension
