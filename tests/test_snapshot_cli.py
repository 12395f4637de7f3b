"""``leakcheck snapshot`` as a command: the lean start, and ``--watch`` on a pipe and a terminal.

The watch tests run the real command as a subprocess, read two frames, and stop it with
SIGINT sent to that subprocess by its PID, as Ctrl-C would.
"""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from leakcheck.commands import cli
from leakcheck.commands.cli import main
from leakcheck.commands.common import EXIT_CLEAN

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
COMMAND = [sys.executable, "-m", "leakcheck", "snapshot"]


def _read_until(fd: int, done: object, timeout_s: float = 60.0) -> bytes:
    """Read ``fd`` until ``done(data)`` holds (or the time is up); all that was read."""
    assert callable(done)
    data = b""
    deadline = time.monotonic() + timeout_s
    while not done(data) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty's reader gets EIO once the child is gone
                break
            if not chunk:
                break
            data += chunk
    return data


def _interrupt(process: subprocess.Popen[bytes]) -> int:
    os.kill(process.pid, signal.SIGINT)
    return process.wait(timeout=30)


def test_watch_on_a_pipe_prints_timestamped_frames_and_ctrl_c_exits_0() -> None:
    process = subprocess.Popen(
        [*COMMAND, "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )
    try:
        assert process.stdout is not None
        data = _read_until(process.stdout.fileno(), lambda d: d.count(b"--- ") >= 2)
        assert _interrupt(process) == 0
        assert process.stderr is not None
        assert process.stderr.read() == b""  # no traceback
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    frames = data.decode().split("--- ")[1:]
    assert len(frames) >= 2, data
    for frame in frames[:2]:
        stamp, _, body = frame.partition(" ---\n")
        time.strptime(stamp, "%Y-%m-%d %H:%M:%S")
        assert "\x1b[" not in body  # no screen control on a pipe
        # The same text a single snapshot prints (NVML's state and /proc differ, not the form).
        assert body.strip().splitlines()[-1].startswith("  ")


def test_watch_json_on_a_pipe_is_one_document_per_line() -> None:
    process = subprocess.Popen([*COMMAND, "--json", "--watch=0.2"], stdout=subprocess.PIPE, env=ENV)
    try:
        assert process.stdout is not None
        data = _read_until(process.stdout.fileno(), lambda d: d.count(b"\n") >= 2)
        assert _interrupt(process) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    documents = [json.loads(line) for line in data.decode().splitlines()[:2]]
    assert [d["schema_version"] for d in documents] == [1, 1]
    assert documents[0]["taken_unix_s"] < documents[1]["taken_unix_s"]


def test_watch_of_a_pid_ends_when_that_process_exits() -> None:
    """Frames while it lives, then one line that it exited (no frames of an empty tree, nor
    of another process that takes its PID), and exit 0."""
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = subprocess.Popen(
        [*COMMAND, "--pid", str(watched.pid), "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    try:
        assert watch.stdout is not None
        # Two frames while it lives (however long a loaded host takes to start the watch),
        # then it exits.
        frames = _read_until(watch.stdout.fileno(), lambda d: d.count(b"--- ") >= 2)
        watched.kill()
        watched.wait()
        out, err = watch.communicate(timeout=60)
    finally:
        for process in (watched, watch):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert watch.returncode == 0, err
    assert (frames + out).count(b"--- ") >= 2
    (notice,) = err.decode().strip().splitlines()
    assert f"PID {watched.pid} exited (seen gone at " in notice
    assert "the watch ends" in notice


def test_watch_on_a_terminal_redraws_in_place_and_ctrl_c_exits_0() -> None:
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [*COMMAND, "--watch", "0.2"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=ENV,
        start_new_session=True,  # the pty is not our terminal: its signals are not ours
    )
    os.close(terminal)
    clear = b"\x1b[H\x1b[2J"
    try:
        data = _read_until(controller, lambda d: d.count(clear) >= 2)
        assert _interrupt(process) == 0
        rest = _read_until(controller, lambda d: False, timeout_s=1.0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(controller)
    assert data.count(clear) >= 2, data
    assert data.startswith(clear)
    frame = data.split(clear)[1].decode().replace("\r\n", "\n")
    assert frame.startswith("leakcheck snapshot --watch 0.2  ")
    assert "(Ctrl-C stops)" in frame.splitlines()[0]
    assert b"Traceback" not in data + rest


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("0", "'0'"),
        ("0.05", "'0.05'"),
        ("-1", "'-1'"),
        ("x", "'x'"),
        ("nan", "'nan'"),
        ("inf", "'inf'"),
        ("1e10", "'1e10'"),  # time.sleep() overflows: was a traceback after the first frame
    ],
)
def test_bad_watch_value_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], value: str, shown: str
) -> None:
    assert main(["snapshot", "--watch", value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "leakcheck snapshot: --watch: expected a number of seconds >= 0.1 and below 1e9 such as "
        f"2, got {shown}"
    ]


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        ["--json"],
        ["--pid", "123"],
        ["--pid=123", "--json"],
        ["--watch", "2", "--pid", "7"],
        ["--watch=0.5", "--watch", "1"],
        ["--json", "--json"],
        ["--telemetry"],
        ["--telemetry", "--json", "--pid=9"],
    ],
)
def test_plain_lines_read_without_argparse_as_the_full_parser_reads_them(
    tokens: list[str],
) -> None:
    plain = cli._plain_snapshot_args(tokens)
    assert plain is not None
    full = cli.build_parser().parse_args(["snapshot", *tokens])
    assert vars(plain) == vars(full)


@pytest.mark.parametrize(
    "tokens",
    [["--help"], ["-h"], ["--js"], ["--pid"], ["--pid", "-5"], ["--bogus"], ["--", "--json"]],
)
def test_other_lines_go_to_the_full_parser(tokens: list[str]) -> None:
    assert cli._plain_snapshot_args(tokens) is None


def test_a_snapshot_imports_neither_argparse_nor_the_sweep_nor_pynvml() -> None:
    """Nor the report model and the host-memory reader: a plain snapshot needs neither."""
    # Through ``main`` (what ``python -m leakcheck`` imports, less the exit that would end the
    # probe before it prints: NOTE [quick exit]).
    probe = (
        "import sys, leakcheck.__main__\n"
        "from leakcheck.commands.cli import main\n"
        "main(['snapshot'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('argparse', 'pynvml', 'torch', 'json') or m in "
        "('leakcheck.commands.sweep', 'leakcheck.core.options', 'leakcheck.commands.workload', "
        "'leakcheck.commands.launcher', "
        "'leakcheck.core.model', 'leakcheck.observe.hostmem')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, check=True
    )
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_watch_keeps_going_when_a_frame_takes_longer_than_the_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot slower than the period (a busy host, or Ctrl-Z then fg) starts the next
    one at once; the third frame's Ctrl-C ends the watch with 0."""
    frames: list[float] = []

    def slow(root_pid: int | None, telemetry: bool, *, as_json: bool, indent: int | None) -> str:
        frames.append(time.monotonic())
        if len(frames) == 3:
            raise KeyboardInterrupt
        time.sleep(0.15)
        return "frame"

    monkeypatch.setattr(cli, "_snapshot_text", slow)
    out = io.StringIO()
    assert cli._watch(None, 0.1, False, as_json=False, out=out) == EXIT_CLEAN
    assert len(frames) == 3 and out.getvalue().count("frame") == 2


_ENTRY = """
import atexit, sys
atexit.register(print, "exit work ran", flush=True)
sys.argv = ["leakcheck", *sys.argv[1:]]
from leakcheck.commands.cli import command
command()
"""
# Buffered output, as on most machines: with PYTHONUNBUFFERED nothing would be left to flush.
BUFFERED_ENV = {key: value for key, value in ENV.items() if key != "PYTHONUNBUFFERED"}


def _entry(*args: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _ENTRY, *args],
        env=BUFFERED_ENV,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )


def test_a_snapshot_ends_without_the_interpreters_exit_work_and_keeps_its_output() -> None:
    """NOTE [quick exit]: the executable ends a snapshot once its text is flushed (the exit
    work of a process that used NVML is skipped), with the status main() gave."""
    done = _entry("snapshot", "--json")
    assert done.returncode == 0, done.stderr
    assert "exit work ran" not in done.stdout
    assert json.loads(done.stdout)["schema_version"] == 1  # the whole document, flushed

    bad = _entry("snapshot", "--pid", "abc")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "leakcheck snapshot: --pid: expected a process ID > 0, got 'abc'"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_snapshot_that_cannot_write_its_output_says_so_and_exits_2() -> None:
    with open("/dev/full", "w") as full:
        done = _entry("snapshot", stdout=full)
    assert done.returncode == 2
    assert done.stderr.startswith("leakcheck snapshot: could not write the output: [Errno 28]")
    assert len(done.stderr.splitlines()) == 1


# A snapshot text of 500 KB, far beyond the output buffer: written through at once.
_LONG_ENTRY = _ENTRY.replace(
    "from leakcheck.commands.cli import command",
    "from leakcheck.observe import snapshot\n"
    "real = snapshot.Snapshot.format\n"
    "snapshot.Snapshot.format = lambda self: real(self) + ('x' * 99 + '\\n') * 5000\n"
    "from leakcheck.commands.cli import command",
)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("watch", [(), ("--watch", "0.5")], ids=["once", "watch"])
def test_a_long_snapshot_that_cannot_be_written_says_so_and_exits_2(
    watch: tuple[str, ...],
) -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-c", _LONG_ENTRY, "snapshot", *watch],
            env=BUFFERED_ENV,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("leakcheck snapshot: could not write the output: [Errno 28]")
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("watch", [(), ("--watch", "0.5")], ids=["once", "watch"])
def test_a_snapshot_whose_reader_left_early_exits_0_quietly(watch: tuple[str, ...]) -> None:
    """`leakcheck snapshot | head -1` on a long text: the reader is gone, no traceback (and
    a watch ends with it)."""
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert reader.stdin is not None
    done = subprocess.run(
        [sys.executable, "-c", _LONG_ENTRY, "snapshot", *watch],
        env=BUFFERED_ENV,
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    reader.stdin.close()
    reader.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_ctrl_c_during_a_snapshot_exits_130_without_a_traceback() -> None:
    script = _ENTRY.replace(
        "from leakcheck.commands.cli import command",
        "from leakcheck.observe import snapshot\n"
        "def interrupted(**kwargs):\n    raise KeyboardInterrupt\n"
        "snapshot.take_snapshot = interrupted\n"
        "from leakcheck.commands.cli import command",
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "snapshot"],
        env=BUFFERED_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 130
    assert done.stdout == "" and done.stderr == ""


def test_other_commands_exit_normally() -> None:
    """Only a snapshot skips the exit work: every other command ends as Python ends."""
    done = _entry("--version")
    assert done.returncode == 0
    assert done.stdout.splitlines() == [f"leakcheck {cli_version()}", "exit work ran"]


def test_python_dash_m_and_the_console_script_both_end_a_snapshot_quickly(
    tmp_path: Path,
) -> None:
    """Both entry points go through ``command``: exit work registered at the interpreter's
    start (a sitecustomize) does not run after a snapshot, and does after ``--version``."""
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit\natexit.register(print, 'exit work ran', flush=True)\n"
    )
    env = {**BUFFERED_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    script = Path(sys.executable).parent / "leakcheck"
    assert script.exists(), f"no console script next to {sys.executable}: install leakcheck"
    for entry in ([sys.executable, "-m", "leakcheck"], [str(script)]):
        done = subprocess.run(
            [*entry, "snapshot"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() and "exit work ran" not in done.stdout
        version = subprocess.run(
            [*entry, "--version"], env=env, capture_output=True, text=True, timeout=60
        )
        assert version.stdout.splitlines()[-1] == "exit work ran"


def cli_version() -> str:
    from leakcheck import __version__

    return __version__
