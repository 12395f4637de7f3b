"""Mailbox folders carry their owner's identity; those of owners that are gone are removed."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from leakcheck.core.model import ProcessKey
from leakcheck.observe import mailbox, procs

REPO = Path(__file__).resolve().parents[1]
# Above the kernel's largest pid_max (2**22): never a live process.
DEAD_PID = 2**22 + 1
NAME = re.compile(r"^leakcheck-mailbox-(\d+)-(\d+)-(\d+)-[a-z0-9_]+$")

_OWNER = """
import sys, time
from leakcheck.observe import mailbox
folder = mailbox.create()
mailbox.post("worker", {"pid": 1, "start_ticks": 100}, directory=folder)
print(folder, flush=True)
time.sleep(60)
"""


def _start_ticks(pid: int) -> int:
    key = procs.process_key(pid)
    assert key is not None
    return key.start_ticks


def _own_namespace() -> int:
    match = re.fullmatch(r"pid:\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
    assert match is not None
    return int(match.group(1))


def _start_owner(temp_dir: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "TMPDIR": str(temp_dir), "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], env=env, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    folder = Path(owner.stdout.readline().strip())
    return owner, folder


def _dead_owners_folder(temp_dir: Path, *, pid: int = DEAD_PID, ticks: int = 1) -> Path:
    folder = temp_dir / f"leakcheck-mailbox-{pid}-{ticks}-{_own_namespace()}-abc_123x"
    folder.mkdir(mode=0o700)
    (folder / "worker-1-1.0.json").write_text("{}")
    return folder


def test_folder_name_carries_the_owner_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = mailbox.create()
    try:
        assert os.path.dirname(folder) == str(tmp_path)
        match = NAME.match(os.path.basename(folder))
        assert match is not None, folder
        pid, ticks, namespace = (int(group) for group in match.groups())
        assert (pid, ticks, namespace) == (os.getpid(), _start_ticks(os.getpid()), _own_namespace())
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        mailbox.remove(folder)


def test_mailbox_of_a_killed_owner_is_removed(tmp_path: Path) -> None:
    owner, folder = _start_owner(tmp_path)
    try:
        assert folder.parent == tmp_path and NAME.match(folder.name)
        assert os.listdir(folder) != []
        # While the owner lives its folder stays.
        assert mailbox.remove_stale(str(tmp_path)) == []
        assert folder.is_dir()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    # SIGKILL: no cleanup ran in the owner; the folder and its record are left behind.
    assert folder.is_dir()
    assert mailbox.remove_stale(str(tmp_path)) == [str(folder)]
    assert not folder.exists()


def test_create_removes_stale_mailboxes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, stale = _start_owner(tmp_path)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fresh = mailbox.create()
    try:
        assert not stale.exists()
        assert os.listdir(tmp_path) == [os.path.basename(fresh)]
    finally:
        mailbox.remove(fresh)


def test_a_reused_pid_does_not_keep_a_dead_owners_folder(tmp_path: Path) -> None:
    # The PID is alive (this process), but with another start time: its owner is gone.
    reused = _dead_owners_folder(tmp_path, pid=os.getpid(), ticks=_start_ticks(os.getpid()) - 1)
    assert mailbox.remove_stale(str(tmp_path)) == [str(reused)]


def test_only_our_own_dead_owners_folders_are_removed(tmp_path: Path) -> None:
    own = tmp_path / f"leakcheck-mailbox-{os.getpid()}-{_start_ticks(os.getpid())}-"
    own = Path(str(own) + f"{_own_namespace()}-live0001")
    own.mkdir()
    kept = [own]
    # Not named like ours: an older leakcheck's folder, other shapes, another program's.
    for name in (
        "leakcheck-mailbox-x1y2z3ab",
        f"leakcheck-mailbox-{DEAD_PID}-1-abc",
        f"leakcheck-mailbox-{DEAD_PID}-1-{_own_namespace()}-ab-cd",
        f"other-{DEAD_PID}-1-{_own_namespace()}-abc",
    ):
        (tmp_path / name).mkdir()
        kept.append(tmp_path / name)
    # Another PID namespace: its PID names some other process here, or none.
    other_ns = tmp_path / f"leakcheck-mailbox-{DEAD_PID}-1-{_own_namespace() + 1}-abc"
    other_ns.mkdir()
    kept.append(other_ns)
    # Named like ours, but a file, and a link to a folder (whose content must survive).
    as_file = tmp_path / f"leakcheck-mailbox-{DEAD_PID}-2-{_own_namespace()}-afile"
    as_file.write_text("x")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.json").write_text("{}")
    as_link = tmp_path / f"leakcheck-mailbox-{DEAD_PID}-3-{_own_namespace()}-alink"
    as_link.symlink_to(target)
    kept += [as_file, as_link, target]
    stale = _dead_owners_folder(tmp_path)

    assert mailbox.remove_stale(str(tmp_path)) == [str(stale)]
    for path in kept:
        assert path.exists() or path.is_symlink(), path
    assert (target / "keep.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_another_users_folder_is_kept(tmp_path: Path) -> None:
    theirs = _dead_owners_folder(tmp_path)
    os.chown(theirs, 65534, 65534)
    assert mailbox.remove_stale(str(tmp_path)) == []
    assert theirs.is_dir()


def test_remove_stale_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert mailbox.remove_stale(str(tmp_path / "missing")) == []
    stale = _dead_owners_folder(tmp_path)

    def broken(pid: int) -> None:
        raise OSError("unreadable")

    monkeypatch.setattr(procs, "process_key", broken)
    # An owner that cannot be judged is kept, and create() still makes a folder.
    assert mailbox.remove_stale(str(tmp_path)) == []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fresh = mailbox.create()
    assert os.path.isdir(fresh) and stale.is_dir()
    mailbox.remove(fresh)


def test_teardown_record_reads_host_memory_and_unknowns() -> None:
    key = ProcessKey(4321, 150)
    record = mailbox.teardown_record(
        {
            "cuda_initialized": False,
            "host_uss_bytes": 10,
            "host_pss_bytes": 20,
            "host_rss_bytes": 30,
            "host_rss_peak_bytes": "oops",  # malformed: unknown, never 0
            "peak_reserved_bytes": float("nan"),  # JSON's NaN and Infinity: unknown, no raise
            "monotonic_s": float("inf"),
        },
        key,
    )
    assert record.peak_reserved_bytes is None and record.monotonic_s is None
    assert (record.host_uss_bytes, record.host_pss_bytes, record.host_rss_bytes) == (10, 20, 30)
    assert record.host_rss_peak_bytes is None
    # An older worker's record without them: unknown.
    assert mailbox.teardown_record({}, key).host_uss_bytes is None


def test_worker_birth_reads_forked_and_the_dirty_figures_or_says_unknown() -> None:
    forked, memory = mailbox.worker_birth(
        {
            "forked": True,
            "host_uss_bytes": 9,
            "host_rss_bytes": 210,
            "host_shared_dirty_bytes": 200,
            "host_private_dirty_bytes": 8,
        }
    )
    assert forked is True and memory is not None
    assert (memory.uss_bytes, memory.shared_dirty_bytes, memory.private_dirty_bytes) == (9, 200, 8)
    # An older worker's record, a malformed field, a birth it could not read: unknown.
    assert mailbox.worker_birth({}) == (None, None)
    assert mailbox.worker_birth({"forked": "yes", "host_uss_bytes": 9}) == (None, None)
    spawned = mailbox.worker_birth(
        {"forked": False, "host_uss_bytes": 9, "host_shared_dirty_bytes": True,
         "host_private_dirty_bytes": 8}
    )  # fmt: skip
    assert spawned == (False, None)


def test_births_are_read_from_outside_only_from_the_roots_own_folders(tmp_path: Path) -> None:
    from leakcheck.observe.hostmem import HostMemory

    own = tmp_path / f"{mailbox.MAILBOX_PREFIX}{os.getpid()}-{_start_ticks(os.getpid())}-"
    own = Path(f"{own}{_own_namespace()}-abc")
    other = _dead_owners_folder(tmp_path, pid=os.getpid(), ticks=1)  # a former PID's folder
    own.mkdir()
    memory = HostMemory(9, None, 210, None, "smaps_rollup", shared_dirty_bytes=200,
                        private_dirty_bytes=8)  # fmt: skip
    worker, spawned = ProcessKey(4001, 1250), ProcessKey(4002, 1300)
    assert mailbox.write_births(str(own), {worker: (True, memory), spawned: (False, None)})
    assert mailbox.write_births(str(other), {ProcessKey(4003, 100): (True, memory)})
    births = mailbox.read_births(os.getpid(), directory=str(tmp_path))
    assert births == {
        worker: (True, replace(memory, pss_bytes=None, swap_bytes=None)),
        spawned: (False, None),
    }
    # Never a record: the tracker's reads skip it.
    assert mailbox.Inbox(str(own)).read() == []
    assert mailbox.read_births(os.getpid(), directory=str(tmp_path / "nowhere")) == {}
