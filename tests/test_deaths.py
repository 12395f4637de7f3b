"""A worker that dies by a signal is named with the evidence of why (the ``died`` rule).

Real DataLoaders with real forked workers; only the memory cgroup's counter is a fake file,
at the boundary where leakcheck reads the machine (``machine.CGROUP_ROOT``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.core.errors import LeakWarning
from leakcheck.core.model import Finding
from leakcheck.judge.stories import STORIES
from leakcheck.observe import machine
from tests.polling import wait_for

_BLOCK = 4 * 1024 * 1024


class Grows(Dataset[int]):
    """Keeps 4 MiB per item in the worker, and is slow enough to be killed mid-epoch.

    Its batches are lists of ints (``collate_fn=list``): a tensor in flight would reach the
    parent through a descriptor the killed worker can no longer send, and the DataLoader
    would fail on that instead (its error varies with the moment of the kill).
    """

    kept: ClassVar[list[bytearray]] = []

    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> int:
        Grows.kept.append(bytearray(b"x" * _BLOCK))
        time.sleep(0.02)
        return index


class StuckAt10(Grows):
    """As ``Grows``, then stuck in item 10 (``marker`` touched): a kill finds the worker in its
    own code, never inside torch's shared locks (one held at a SIGKILL hangs the parent)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __getitem__(self, index: int) -> int:
        if index >= 10:
            self.marker.touch()
            time.sleep(60)
        return super().__getitem__(index)


class Segfaults(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 0:  # the first: no batch in flight whose transfer the death would break
            ctypes.string_at(0)  # reads address 0: SIGSEGV in native code
        return torch.tensor([index])


def _cgroup(root: Path, kills: int) -> None:
    """A memory cgroup's counters, for v1 and v2 alike (whichever this machine has)."""
    (root / "memory").mkdir(parents=True, exist_ok=True)
    (root / "memory" / "memory.oom_control").write_text(
        f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n"
    )
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills}\n")


def _kill_a_worker_mid_epoch(loader: Any, marker: Path, before_kill: Any = None) -> int:
    """Iterate until the worker is known, has grown and is stuck in item 10, then SIGKILL it."""
    victim = 0
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for count, _ in enumerate(loader):
            if count == 3:
                assert wait_for(lambda: len(loader.tracker.worker_keys()) == 1)
                assert wait_for(marker.exists)
                victim = loader.tracker.worker_keys()[0].pid
                if before_kill is not None:
                    before_kill()
                os.kill(victim, signal.SIGKILL)
    return victim


def _died(loader: Any) -> list[Finding]:
    return [f for f in loader.report().findings if f.rule == "died"]


def test_a_worker_killed_while_the_cgroup_counts_an_oom_kill_is_named_oom(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cgroup(tmp_path, kills=0)
    monkeypatch.setattr(machine, "CGROUP_ROOT", str(tmp_path))
    stuck = StuckAt10(tmp_path / "stuck")
    loader = leakcheck.watch(DataLoader(stuck, num_workers=1, batch_size=2, collate_fn=list))
    with pytest.warns(LeakWarning, match="OOM killer"):
        victim = _kill_a_worker_mid_epoch(loader, stuck.marker, lambda: _cgroup(tmp_path, kills=1))
    [finding] = _died(loader)
    loader.close()
    assert finding.pid == victim
    assert "killed by the OOM killer (SIGKILL) in epoch 0" in finding.message
    assert "OOM kills of its memory cgroup +1" in finding.message
    assert "since birth" in finding.message  # its memory at the last read, and the growth
    assert finding.host_bytes is not None and finding.host_bytes > _BLOCK


def test_a_worker_killed_without_evidence_has_an_unknown_sender(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cgroup(tmp_path, kills=0)
    monkeypatch.setattr(machine, "CGROUP_ROOT", str(tmp_path))
    # A roomy machine, whatever this one's memory is now: no evidence of an OOM kill at all.
    roomy = machine.MachineMemory(total_bytes=64 * 2**30, available_bytes=32 * 2**30)
    monkeypatch.setattr(machine, "machine_memory", lambda: roomy)
    stuck = StuckAt10(tmp_path / "stuck")
    loader = leakcheck.watch(DataLoader(stuck, num_workers=1, batch_size=2, collate_fn=list))
    with pytest.warns(LeakWarning, match="sender unknown"):
        victim = _kill_a_worker_mid_epoch(loader, stuck.marker)
    loader.close()
    [finding] = _died(loader)
    assert finding.pid == victim
    assert "was killed by SIGKILL (sender unknown) in epoch 0" in finding.message
    assert "OOM" not in finding.message


def test_a_worker_that_segfaults_shows_its_python_stack() -> None:
    loader = leakcheck.watch(DataLoader(Segfaults(), num_workers=1, batch_size=2))
    with (
        pytest.warns(LeakWarning, match="crashed in native code"),
        pytest.raises(RuntimeError, match="DataLoader worker"),
    ):
        for _ in loader:
            pass
    loader.close()
    [finding] = _died(loader)
    assert "crashed in native code (SIGSEGV) in epoch 0; stack: string_at" in finding.message
    assert finding.stack is not None and "__getitem__" in finding.stack
    text = loader.report().format()
    assert "in __getitem__" in text  # the whole stack, under the finding


def _has_stack_file(folder: str) -> bool:
    return any(name.startswith("stack-") for name in os.listdir(folder))


def test_a_worker_that_exits_normally_leaves_no_stack_file() -> None:
    loader = leakcheck.watch(DataLoader(Grows(), num_workers=1, batch_size=2, collate_fn=list))
    folder = ""
    for count, _ in enumerate(loader):
        folder = loader.tracker.mailbox_dir or ""
        assert wait_for(functools.partial(_has_stack_file, folder))  # the worker's, as it runs
        if count == 2:
            break
    assert wait_for(lambda: not _has_stack_file(folder))
    loader.close()
    assert _died(loader) == []


def test_the_story_of_died_names_each_cause() -> None:
    text = STORIES["died"]
    for cause in ("OOM killer", "/dev/shm exhausted", "native code", "sender unknown"):
        assert cause in text


class BlocksAt(Dataset[int]):
    """Blocks in ``__getitem__`` at one item until a file appears (the test's release)."""

    def __init__(self, release: str) -> None:
        self.release = release

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        while index == 4 and not os.path.exists(self.release):
            time.sleep(0.01)
        return index


def _worker_stack(finding: Finding) -> str:
    """The worker's part of a hang finding's stacks ("" when none was written)."""
    stack = finding.stack or ""
    parts = stack.split("--- worker PID ")[1:]
    return "".join(part.split("--- the loop's process")[0] for part in parts)


def test_a_stalled_epoch_shows_the_stacks_of_the_loop_and_of_the_blocked_worker(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The loop waits inside ``next()`` for the batch that holds item 4, whose worker blocks;
    a thread releases it once the stall was reported with that worker's stack."""
    release = tmp_path / "release"
    loader = leakcheck.watch(
        DataLoader(BlocksAt(str(release)), num_workers=1, batch_size=2, collate_fn=list),
        hang_after=2.0,  # a slow first batch on a loaded machine is a stall too: above it
    )

    def blocked_worker_shown() -> bool:
        return any(
            "in __getitem__" in _worker_stack(f)
            for f in loader.report().findings
            if f.rule == "hang"
        )

    def release_when_shown() -> None:
        wait_for(blocked_worker_shown, timeout_s=120)
        release.touch()

    releaser = threading.Thread(target=release_when_shown)
    releaser.start()
    batches = [batch for batch in loader]
    releaser.join()
    hangs = [f for f in loader.report().findings if f.rule == "hang"]
    loader.close()
    assert batches == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the loop went on undisturbed
    [worker] = loader.tracker.worker_keys()
    [finding] = [f for f in hangs if f"worker PID {worker.pid}" in (f.stack or "")][-1:]
    assert "no batch for" in finding.message and "in epoch 0" in finding.message
    assert "in __getitem__" in _worker_stack(finding)
    assert "the loop's process" in (finding.stack or "")
    assert "test_a_stalled_epoch" in (finding.stack or "")  # the loop, waiting in next()
    assert "the stacks of the job" in capfd.readouterr().err  # written at once, to stderr


def test_no_stall_is_reported_with_the_hang_watch_off(tmp_path: Path) -> None:
    release = tmp_path / "release"
    loader = leakcheck.watch(
        DataLoader(BlocksAt(str(release)), num_workers=1, batch_size=2, collate_fn=list),
        hang_after=0,
    )
    # The loop waits in next() 1.5 s for item 4: a stall the watch would report, were it on.
    timer = threading.Timer(1.5, release.touch)
    timer.start()
    batches = list(loader)
    timer.join()
    loader.close()
    assert len(batches) == 4
    assert not [f for f in loader.report().findings if f.rule == "hang"]


def test_a_slow_training_step_is_the_loops_own_work_not_a_stall(tmp_path: Path) -> None:
    """Only the loop's waits for a batch count: a step (an evaluation, a checkpoint) that
    takes longer than ``hang_after`` is not a hang."""
    release = tmp_path / "release"
    release.touch()  # nothing blocks
    loader = leakcheck.watch(
        DataLoader(BlocksAt(str(release)), num_workers=1, batch_size=2, collate_fn=list),
        hang_after=0.3,
    )
    for count, _ in enumerate(loader):
        if count == 1:
            time.sleep(1.5)  # five times hang_after, inside the loop's body
    loader.close()
    stalls = [f for f in loader.report().findings if f.rule == "hang"]
    # A stall, if any, is a wait in next() (a slow first batch on a loaded machine), never
    # the step: none began in the body, where the loop took 1.5 s.
    assert all("__getitem__" not in _worker_stack(f) for f in stalls)
    assert all("time.sleep(1.5)" not in (f.stack or "") for f in stalls)


@pytest.mark.parametrize(
    ("line", "counter"),
    [
        ("4:memory:/job/7\n", "memory/job/7/memory.oom_control"),  # cgroup v1
        ("0::/job/7\n", "job/7/memory.events"),  # cgroup v2
    ],
)
def test_the_oom_kill_counter_is_read_from_the_process_own_memory_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, counter: str
) -> None:
    (tmp_path / "cgroup").write_text(line)
    _cgroup(tmp_path, kills=1)  # the root's: what a container without its own path reads
    (tmp_path / counter).parent.mkdir(parents=True)
    (tmp_path / counter).write_text("oom 9\noom_kill 7\n")
    monkeypatch.setattr(machine, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(machine, "_PROC_SELF_CGROUP", str(tmp_path / "cgroup"))
    assert machine.oom_kill_count() == 7
    (tmp_path / counter).unlink()
    assert machine.oom_kill_count() == 1  # the mount's root, where the own path is not there


# A worker's faulthandler dump: the signal taken by a helper thread, __getitem__ on the main one.
STUCK_WORKER_DUMP = (
    "--- worker PID 12 ---\n"
    "Current thread 0x1 (most recent call first):\n"
    '  File "/usr/lib/python3.11/socket.py", line 294 in accept\n\n'
    "Thread 0x2 (most recent call first):\n"
    '  File "/data/set.py", line 7 in __getitem__\n'
)


def test_a_stalled_worker_is_named_where_its_main_thread_waits_whichever_thread_dumped() -> None:
    """The stack signal reaches any thread of the worker; faulthandler marks that one "Current
    thread" and lists the threads newest first, the main one (``__getitem__``'s) last."""
    from dataclasses import replace

    from leakcheck.core.model import RuleConfig, Stall
    from leakcheck.judge.deaths import hang
    from tests.timelines import timeline

    dump = (
        STUCK_WORKER_DUMP + '  File "/torch/utils/data/_utils/fetch.py", line 56 in fetch\n\n'
        "--- the loop's process (PID 10) ---\nThread 'MainThread' (most recent call last):\n"
    )
    stalled = replace(timeline([]), stalls=(Stall(epoch=0, waited_s=3, at_s=1, stacks=dump),))
    [finding] = hang(stalled, RuleConfig())
    assert "worker PID 12 in __getitem__ (set.py:7);" in finding.message


def test_a_worker_hung_at_shutdown_is_named_where_its_main_thread_waits() -> None:
    """As for a stall: the thread that took the signal is not where ``__getitem__`` runs."""
    from dataclasses import replace

    from leakcheck.core.model import RuleConfig, Stall
    from leakcheck.judge.deaths import shutdown_hang
    from tests.timelines import timeline

    stall = Stall(epoch=0, waited_s=5, at_s=1, stacks=STUCK_WORKER_DUMP, pid=12)
    [finding] = shutdown_hang(replace(timeline([]), stalls=(stall,)), RuleConfig())
    assert finding.message.endswith("terminated in __getitem__ (set.py:7)"), finding.message


def test_no_shutdown_hang_is_said_in_an_epoch_a_ctrl_c_ended() -> None:
    """Its workers took the SIGINT too: one left its loop with batches queued to a parent that
    no longer reads them, and waits at exit to send them until the join's 5 s end it."""
    from dataclasses import replace

    from leakcheck.core.model import RuleConfig, Stall
    from leakcheck.judge.deaths import shutdown_hang
    from tests.timelines import epoch, timeline

    stalls = tuple(
        Stall(epoch=index, waited_s=5, at_s=1, stacks=STUCK_WORKER_DUMP, pid=12 + index)
        for index in (0, 1)
    )
    ended = timeline([epoch(0, []), epoch(1, [], end_reason="interrupt")])
    [finding] = shutdown_hang(replace(ended, stalls=stalls), RuleConfig())
    assert finding.pid == 12 and finding.epoch == 0


_SLOW_DUMPER = """
import os, signal, sys, time
from leakcheck.observe import mailbox, procs
path = mailbox.stack_path(sys.argv[1], procs.process_key(os.getpid()))
def dump(*_):  # a dump in two writes, as faulthandler's come a frame at a time
    with open(path, "a") as out:
        out.write("Current thread 0x1 (most recent call first):\\n")
        out.flush()
        time.sleep(0.05)
        out.write('  File "/data/set.py", line 7 in __getitem__\\n')
signal.signal(mailbox.STACK_SIGNAL, dump)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_workers_stack_written_in_parts_is_read_whole(tmp_path: Path) -> None:
    import subprocess
    import sys

    from leakcheck.observe import procs
    from leakcheck.track.hang import gather_stall

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    worker = subprocess.Popen(
        [sys.executable, "-c", _SLOW_DUMPER, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
        key = procs.process_key(worker.pid)
        assert key is not None
        stall = gather_stall([key], str(tmp_path), epoch=0, waited_s=1.0, at_s=0.0)
    finally:
        worker.kill()
        worker.wait()
    assert stall is not None and "line 7 in __getitem__" in stall.stacks


def test_a_worker_past_its_last_exit_step_is_slow_not_stuck(tmp_path: Path) -> None:
    """It ignores the stack signal (NOTE [exit watch]): no stall, no "(no stack written)"."""
    import subprocess
    import sys

    from leakcheck.observe import procs
    from leakcheck.track.hang import gather_stall

    exiting = subprocess.Popen(
        [sys.executable, "-c", _PAST_LAST_STEP], stdout=subprocess.PIPE, env=dict(os.environ)
    )
    try:
        assert exiting.stdout is not None and exiting.stdout.readline() == b"ready\n"
        key = procs.process_key(exiting.pid)
        assert key is not None
        stall = gather_stall([key], str(tmp_path), epoch=0, waited_s=5.0, at_s=0.0, pid=key.pid)
    finally:
        exiting.kill()
        exiting.wait()
    assert stall is None


_PAST_LAST_STEP = """
import signal, time
signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # as the worker's last exit step leaves it
print("ready", flush=True)
time.sleep(60)
"""


def test_a_dump_without_a_current_thread_line_names_one_threads_frames_only() -> None:
    """Frames of the next thread are not the first one's (a dump of threads, none marked)."""
    from leakcheck.judge.deaths import innermost_frames

    dump = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/app/loader.py", line 12 in read\n'
        "\n"
        "Thread 0x00007f02 (most recent call first):\n"
        '  File "/app/other.py", line 7 in poll\n'
        '  File "/app/other.py", line 3 in run\n'
    )
    assert innermost_frames(dump) == "read (loader.py:12)"
