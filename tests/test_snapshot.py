"""Roles in ``snapshot --pid``: no child is a worker unless known; runtime helpers flagged.

The job here is a real Python process that starts what jobs start beside their loader
workers: multiprocessing's resource tracker, a plain ``sleep`` and a shell with a child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from leakcheck.commands.cli import main
from leakcheck.core.model import ProcessKey
from leakcheck.observe import procs
from leakcheck.observe.snapshot import ProcessSnapshot, take_snapshot
from tests.polling import wait_for

_JOB = """
import subprocess, sys, time
from multiprocessing import resource_tracker

resource_tracker.ensure_running()  # the tracker is started as a child of this process
sleeper = subprocess.Popen(["sleep", "60"])
shell = subprocess.Popen(["sh", "-c", "sleep 60; :"])  # `; :` keeps sh from exec'ing sleep
print(resource_tracker._resource_tracker._pid, sleeper.pid, shell.pid, flush=True)
time.sleep(60)
"""


@dataclass
class Job:
    root: int
    tracker: int
    sleeper: int
    shell: int
    shell_child: int


@pytest.fixture
def job() -> Iterator[Job]:
    # Its own process group: the whole job is killed by the group this test started.
    process = subprocess.Popen(
        [sys.executable, "-c", _JOB], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout is not None
        tracker, sleeper, shell = (int(pid) for pid in process.stdout.readline().split())
        # The shell starts its sleep a moment later.
        assert wait_for(lambda: bool(procs.descendants(shell))), "the shell started no child"
        shell_child = procs.descendants(shell)[0].key.pid
        yield Job(process.pid, tracker, sleeper, shell, shell_child)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _by_pid(entries: tuple[ProcessSnapshot, ...]) -> dict[int, ProcessSnapshot]:
    return {entry.info.key.pid: entry for entry in entries}


def test_no_direct_child_is_called_a_worker_from_outside(job: Job) -> None:
    snapshot = take_snapshot(root_pid=job.root, with_fds=False)
    by_pid = _by_pid(snapshot.processes)
    assert by_pid[job.root].role == "parent"
    for pid in (job.tracker, job.sleeper, job.shell, job.shell_child):
        assert by_pid[pid].role == "descendant", by_pid[pid]
    assert [e for e in snapshot.processes if e.role == "worker"] == []
    # The resource tracker is a runtime helper; the others are not.
    assert "from multiprocessing.resource_tracker import main" in by_pid[job.tracker].info.cmdline
    assert by_pid[job.tracker].flags == ("helper",)
    for pid in (job.root, job.sleeper, job.shell, job.shell_child):
        assert "helper" not in by_pid[pid].flags


def test_a_known_worker_is_a_worker(job: Job) -> None:
    sleeper_key = procs.process_key(job.sleeper)
    assert sleeper_key is not None
    stale_key = ProcessKey(job.shell, 100)  # the shell's PID with another start: not it
    snapshot = take_snapshot(
        root_pid=job.root, with_fds=False, known_workers={sleeper_key, stale_key}
    )
    by_pid = _by_pid(snapshot.processes)
    assert by_pid[job.sleeper].role == "worker"
    assert by_pid[job.shell].role == "descendant"
    assert by_pid[job.tracker].role == "descendant"


def test_snapshot_pid_text_and_json(job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snapshot", "--pid", str(job.root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_pid = {entry["pid"]: entry for entry in data["processes"]}
    assert by_pid[job.root]["role"] == "parent"
    assert {by_pid[pid]["role"] for pid in (job.tracker, job.sleeper, job.shell)} == {"descendant"}
    assert by_pid[job.tracker]["flags"] == ["helper"]
    assert by_pid[job.sleeper]["flags"] == [] and by_pid[job.shell]["flags"] == []

    assert main(["snapshot", "--pid", str(job.root)]) == 0
    text = capsys.readouterr().out
    assert "[worker]" not in text
    tracker_line = next(line for line in text.splitlines() if f"PID {job.tracker} " in line)
    assert "[descendant]" in tracker_line and "— helper; host USS " in tracker_line
    sleeper_line = next(line for line in text.splitlines() if f"PID {job.sleeper} " in line)
    assert "[descendant] sleep 60" in sleeper_line
    # A helper is no cause for concern: it is not listed among the flagged processes.
    assert f"PID {job.tracker} (" not in text


def test_snapshot_pid_reads_the_jobs_host_memory_and_only_its(
    job: Job, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["snapshot", "--pid", str(job.root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_pid = {entry["pid"]: entry for entry in data["processes"]}
    for pid in (job.root, job.tracker, job.sleeper, job.shell):
        entry = by_pid[pid]
        assert entry["host_source"] == "smaps_rollup"
        assert 0 < entry["host_uss_bytes"] <= entry["host_rss_bytes"]
        assert entry["host_rss_peak_bytes"] >= entry["host_rss_bytes"]
    assert main(["snapshot", "--pid", str(job.root)]) == 0
    sleeper_line = next(
        line for line in capsys.readouterr().out.splitlines() if f"PID {job.sleeper} " in line
    )
    assert "host USS " in sleeper_line and " MiB (RSS " in sleeper_line
    # Without a job, a snapshot reads nobody's host memory: it stays cheap.
    assert all(entry.host is None for entry in take_snapshot().processes)


def test_a_multiline_command_line_stays_on_its_process_line(
    job: Job, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job's `python -c` script has newlines: the parent's line was broken in three."""
    assert main(["snapshot", "--pid", str(job.root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    script_lines = [line.strip() for line in _JOB.strip().splitlines()]
    assert not [line for line in lines if line.strip() in script_lines]
    root_line = next(line for line in lines if f"PID {job.root} " in line)
    assert "[parent]" in root_line and 'python -c "import subprocess, sys, time' in root_line


def test_the_text_draws_each_tree_with_its_branches() -> None:
    """A parent's children hang below it by PID, the last with a corner; a process whose
    parent is not shown starts a tree of its own."""
    from leakcheck.core.readings import ProcInfo
    from leakcheck.observe.snapshot import Snapshot

    def entry(pid: int, ppid: int) -> ProcessSnapshot:
        return ProcessSnapshot(ProcInfo(ProcessKey(pid, pid), ppid, "p", f"cmd{pid}"), None, {})

    family = (entry(10, 1), entry(12, 10), entry(11, 10), entry(13, 11), entry(20, 99))
    assert Snapshot(0.0, "ok", "", (), family).format().splitlines() == [
        "  PID 10 cmd10",
        "  ├─ PID 11 cmd11",
        "  │  └─ PID 13 cmd13",
        "  └─ PID 12 cmd12",
        "  PID 20 cmd20",
    ]
