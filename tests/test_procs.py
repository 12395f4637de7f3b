"""leakcheck.observe.procs on real processes: identities, lineage, tags, descriptors, /dev/shm."""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from leakcheck.core.model import ProcessKey, ProcInfo
from leakcheck.observe import procs
from tests.polling import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

HELPER = str(Path(__file__).with_name("helpers_procs.py"))
PYTHON = [sys.executable, "-I", "-S"]
WAIT_STDIN = "import sys; sys.stdin.buffer.read()"

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start real processes (stdin is a pipe: closing it ends every helper here), and
    always stop and reap them, only them, when the test ends."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        kwargs.setdefault("stdin", subprocess.PIPE)
        proc = subprocess.Popen(argv, **kwargs)
        started.append(proc)
        # Popen returns once exec began; /proc shows the new command line and environment
        # only when the kernel has set up the new image. Wait for that.
        assert wait_for(lambda: exec_done(proc.pid, argv[0]))
        return proc

    yield start
    for proc in reversed(started):
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()  # only a process this test started, by its own handle
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def start_helper(
    spawn: Spawn, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = spawn([*PYTHON, HELPER, *args], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def exec_done(pid: int, argv0: str) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == argv0.encode()
    except OSError:
        return False


def reaped_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def pids_of(infos: list[ProcInfo]) -> list[int]:
    return [info.key.pid for info in infos]


def tree_pids(record: dict[str, Any]) -> set[int]:
    """Every process below a `tree` helper, from what it reported."""
    pids = set(record["sleepers"]) | set(record["thread_sleepers"])
    for sub in record["subtrees"]:
        pids |= {sub["pid"]} | tree_pids(sub)
    return pids


# --- identities -----------------------------------------------------------------------------


def _steady_clock(call: Callable[[], Any]) -> Any:
    """``call()``'s result from a call across which /proc/stat's btime held: a step of the
    wall clock (a resumed VM, NTP) moves it, and every create time computed from it. The
    boot time leakcheck keeps for the process's life is read anew for each try."""
    for _ in range(5):
        procs.boot_time_s.cache_clear()
        before = psutil.boot_time()
        result = call()
        if psutil.boot_time() == before:
            return result
    raise AssertionError("/proc/stat's btime moved during each of 5 tries")


def test_clock_ticks_and_boot_time_match_their_sources() -> None:
    assert procs.clock_ticks() == os.sysconf("SC_CLK_TCK")
    ours, theirs = _steady_clock(lambda: (procs.boot_time_s(), psutil.boot_time()))
    assert ours == theirs


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat, read here without leakcheck."""
    line = Path(f"/proc/{pid}/stat").read_bytes()
    return int(line[line.rfind(b")") + 2 :].split()[19])


def _create_times(pid: int) -> tuple[float, float]:
    """``pid``'s create time as leakcheck shows it, and as psutil does."""
    return procs.create_time_s(_start_ticks(pid)), psutil.Process(pid).create_time()


def test_process_key_is_the_start_ticks_of_proc_stat(spawn: Spawn) -> None:
    """NOTE [process identity]: the kernel's own number, shown as psutil's create time."""
    child = spawn(["sh", "-c", "read x"])
    for pid in (os.getpid(), child.pid):
        key = procs.process_key(pid)
        assert key == ProcessKey(pid, _start_ticks(pid))
        ours, theirs = _steady_clock(functools.partial(_create_times, pid))
        assert ours == theirs
    compared = 0
    for info in procs.scan_all(with_cmdline=False):
        try:
            expected = _start_ticks(info.key.pid)
        except FileNotFoundError:
            continue
        assert info.key.start_ticks == expected, info
        compared += 1
    assert compared >= 3


def test_identities_do_not_depend_on_the_boot_time(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/stat's btime moves with the wall clock: keys read before and after it moved
    are equal, and only the create time shown for people moves."""
    child = spawn(["sh", "-c", "read x"])
    before = procs.process_key(child.pid)
    info = procs.read_proc(child.pid)
    boot_s = procs.boot_time_s()
    shown = procs.create_time_s(_start_ticks(child.pid), boot_s)
    monkeypatch.setattr(procs, "boot_time_s", lambda: boot_s + 1.0)
    assert procs.process_key(child.pid) == before and before is not None
    assert procs.read_proc(child.pid) == info and procs.is_alive(before)
    assert procs.create_time_s(before.start_ticks) == shown + 1.0


def test_gone_pid_gives_none_and_empty_answers() -> None:
    pid = reaped_pid()
    assert procs.process_key(pid) is None
    assert procs.read_proc(pid, session_id="s") is None
    assert procs.tagged_session(pid) is None
    assert procs.nvidia_fd_count(pid) is None
    assert procs.descendants(pid) == []
    assert procs.pid_exists_here(pid) is False
    assert procs.is_ancestor(os.getpid(), pid) is False
    assert procs.shm_open_by([pid]) == {}


def _state(pid: int) -> bytes | None:
    """The state letter of /proc/PID/stat (``Z``: a zombie); None once the PID is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rsplit(b") ", 1)[1][:1]
    except FileNotFoundError:
        return None


def test_is_alive_false_after_exit_for_zombie_and_for_reused_pid(spawn: Spawn) -> None:
    child = spawn(["sh", "-c", "read x"])
    key = procs.process_key(child.pid)
    assert key is not None
    assert procs.is_alive(key)
    # Same PID, another start: what a reused PID looks like.
    assert not procs.is_alive(ProcessKey(key.pid, key.start_ticks + procs.clock_ticks()))
    assert not procs.is_alive(ProcessKey(key.pid, key.start_ticks - 1))

    assert child.stdin is not None
    child.stdin.close()  # it exits; not reaped yet: a zombie
    assert wait_for(lambda: _state(child.pid) == b"Z")
    assert not procs.is_alive(key)
    assert procs.read_proc(child.pid) is not None  # it still exists ...
    assert child.pid not in pids_of(procs.descendants(os.getpid()))  # ... but is not live
    assert child.pid not in pids_of(procs.scan_all())

    child.wait()
    assert _state(child.pid) is None  # reaped
    assert not procs.is_alive(key)


# --- one process --------------------------------------------------------------------------


def test_read_proc_fields_and_whole_cmdline(spawn: Spawn) -> None:
    """Whole, not cut at 300 characters: decisions read it (a helper's module comes after its
    interpreter's path); only a bound far above any real one applies."""
    long_arg = "x" * 4000
    child = spawn(["sh", "-c", "read x", "sh", long_arg])
    info = procs.read_proc(child.pid)
    assert info is not None
    assert info.key == procs.process_key(child.pid)
    assert info.ppid == os.getpid()
    assert info.name == "sh"
    assert info.cmdline == f"sh -c read x sh {long_arg}"
    huge = spawn(["sh", "-c", "read x", "sh", "y" * (procs.CMDLINE_MAX_CHARS + 100)])
    cut = procs.read_proc(huge.pid)
    assert cut is not None and len(cut.cmdline) == procs.CMDLINE_MAX_CHARS
    assert info.tagged is False
    bare = procs.read_proc(child.pid, with_cmdline=False)
    assert bare is not None and bare.cmdline == "" and bare.key == info.key


def test_name_with_spaces_and_parentheses(spawn: Spawn, tmp_path: Path) -> None:
    odd = tmp_path / "a b) (c"
    odd.symlink_to(sys.executable)
    child = spawn([str(odd), "-I", "-S", "-c", WAIT_STDIN])
    info = procs.read_proc(child.pid)
    assert info is not None
    assert info.name == "a b) (c"
    assert info.ppid == os.getpid()  # fields after the name were not shifted
    assert info.key.start_ticks == _start_ticks(child.pid)


def test_a_kernel_thread_is_told_by_its_flags(kernel_threads: set[int]) -> None:
    kernel = 2 if 2 in kernel_threads else min(kernel_threads)  # kthreadd, on a host
    listed = {info.key.pid for info in procs.scan_all(with_cmdline=False)}
    users = {info.key.pid for info in procs.scan_all(with_cmdline=False, kernel_threads=False)}
    assert kernel in listed and kernel not in users
    assert os.getpid() in users
    assert not kernel_threads & users


def test_session_tag_from_exec_environment(spawn: Spawn) -> None:
    sid = uuid.uuid4().hex
    tagged = spawn(["sh", "-c", "read x"], env={**os.environ, procs.SESSION_ENV: sid})
    plain_env = {k: v for k, v in os.environ.items() if k != procs.SESSION_ENV}
    plain = spawn(["sh", "-c", "read x"], env={**plain_env, "X" + procs.SESSION_ENV: sid})
    first = spawn(["sh", "-c", "read x"], env={procs.SESSION_ENV: sid, **plain_env})

    assert procs.tagged_session(tagged.pid) == sid
    assert procs.tagged_session(plain.pid) is None  # a longer name that ends alike is not it
    assert procs.tagged_session(first.pid) == sid  # first in the block
    info = procs.read_proc(tagged.pid, session_id=sid)
    assert info is not None and info.tagged
    other = procs.read_proc(tagged.pid, session_id=sid + "0")
    assert other is not None and not other.tagged
    untold = procs.read_proc(tagged.pid)
    assert untold is not None and not untold.tagged
    plain_info = procs.read_proc(plain.pid, session_id=sid)
    assert plain_info is not None and not plain_info.tagged


def test_exec_in_place_changes_cmdline_and_tag(spawn: Spawn) -> None:
    # Same PID and create time, new image: nothing read before the exec may be reused.
    sid = uuid.uuid4().hex
    script = f"read x; exec env {procs.SESSION_ENV}={sid} sh -c 'read y'"
    child = spawn(["sh", "-c", script])
    before = procs.read_proc(child.pid, session_id=sid)
    assert before is not None and not before.tagged
    assert before.cmdline == f"sh -c {script}"
    again = procs.read_proc(child.pid, session_id=sid)
    assert again == before

    assert child.stdin is not None
    child.stdin.write(b"go\n")
    child.stdin.flush()
    assert wait_for(lambda: getattr(procs.read_proc(child.pid), "cmdline", "") == "sh -c read y")
    after = procs.read_proc(child.pid, session_id=sid)
    assert after is not None
    assert after.key == before.key
    assert after.tagged
    # A walk reads the new image too (its command line; walks leave tags to read_proc).
    walked = [i for i in procs.descendants(os.getpid()) if i.key == after.key]
    assert walked == [after._replace(tagged=False)]


def _wait_event(event: Any) -> None:
    event.wait(10)


def test_forked_child_shows_initial_environment_not_later_setenv(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [session tag]: a variable set after start reaches exec'd children only.
    sid = uuid.uuid4().hex
    monkeypatch.setenv(procs.SESSION_ENV, sid)
    context = multiprocessing.get_context("fork")
    event = context.Event()
    forked = context.Process(target=_wait_event, args=(event,))
    forked.start()
    try:
        exec_child = spawn(["sh", "-c", "read x"])
        assert forked.pid is not None
        assert procs.tagged_session(exec_child.pid) == sid
        assert procs.tagged_session(forked.pid) != sid
        # Lineage still finds the forked child while its parent lives.
        assert forked.pid in pids_of(procs.descendants(os.getpid()))
    finally:
        event.set()
        forked.join(5)
    assert forked.exitcode == 0


# A tree with every kind of child: sleepers, a thread's sleepers, a subtree (7 processes).
_FULL_TREE = (
    "tree",
    "--sleepers=2",
    "--thread-sleepers=2",
    "--subtrees=1",
    "--subtree-sleepers=2",
)


# --- lineage ------------------------------------------------------------------------------


def test_descendants_find_children_grandchildren_and_thread_children(spawn: Spawn) -> None:
    helper, record = start_helper(spawn, *_FULL_TREE)
    expected = tree_pids(record)
    assert len(expected) == 7
    # The thread's children are in its own task's file, not the main thread's.
    main_file = Path(f"/proc/{helper.pid}/task/{helper.pid}/children").read_text().split()
    thread_file = Path(f"/proc/{helper.pid}/task/{record['thread_id']}/children").read_text()
    assert set(record["thread_sleepers"]) == {int(p) for p in thread_file.split()}
    assert not set(record["thread_sleepers"]) & {int(p) for p in main_file}

    found = procs.descendants(helper.pid)
    assert set(pids_of(found)) == expected
    assert len(found) == len(expected)  # each once
    subtree = record["subtrees"][0]
    order = pids_of(found)
    assert all(order.index(subtree["pid"]) < order.index(p) for p in subtree["sleepers"])
    by_pid = {info.key.pid: info for info in found}
    assert {by_pid[p].ppid for p in subtree["sleepers"]} == {subtree["pid"]}

    direct = set(record["sleepers"]) | set(record["thread_sleepers"]) | {subtree["pid"]}
    assert {info.key.pid for info in found if info.ppid == helper.pid} == direct
    assert expected | {helper.pid} <= set(pids_of(procs.descendants(os.getpid())))


def test_lineage_fallback_full_scan_matches_children_files(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    helper, record = start_helper(
        spawn, "tree", "--sleepers=1", "--thread-sleepers=1", "--subtrees=1"
    )
    with_files = {(info.key, info.ppid, info.cmdline) for info in procs.descendants(helper.pid)}
    # The snapshot's lineage: the same walk over one scan of user processes.
    scanned = procs.tree_below(helper.pid, procs.scan_all(kernel_threads=False))
    assert {(info.key, info.ppid, info.cmdline) for info in scanned} == with_files
    monkeypatch.setattr(procs, "_children_supported", False)
    found = procs.descendants(helper.pid)
    by_scan = {(info.key, info.ppid, info.cmdline) for info in found}
    assert by_scan == with_files and {key.pid for key, _, _ in by_scan} == tree_pids(record)
    order = pids_of(found)  # parents before their children
    assert all(
        order.index(info.ppid) < order.index(info.key.pid)
        for info in found[1:]
        if info.ppid != helper.pid
    )
    assert {info.cmdline for info in procs.descendants(helper.pid, with_cmdline=False)} == {""}


def test_is_ancestor(spawn: Spawn) -> None:
    helper, record = start_helper(spawn, "tree", "--subtrees=1", "--subtree-sleepers=1")
    grandchild = record["subtrees"][0]["sleepers"][0]
    assert procs.is_ancestor(helper.pid, grandchild)
    assert procs.is_ancestor(os.getpid(), grandchild)
    assert not procs.is_ancestor(grandchild, helper.pid)
    assert not procs.is_ancestor(helper.pid, helper.pid)
    assert not procs.is_ancestor(helper.pid, grandchild, max_depth=1)
    assert procs.is_ancestor(helper.pid, grandchild, max_depth=2)


def test_orphan_leaves_lineage_but_scan_all_finds_it_by_tag(spawn: Spawn) -> None:
    sid = uuid.uuid4().hex
    # subreaper -> root -> middle (sh) -> orphan (sleep), all exec'd with the tag.
    helper, record = start_helper(spawn, "reaper", env={**os.environ, procs.SESSION_ENV: sid})
    root, middle, orphan = record["root"], record["middle"], record["orphan"]
    before = {info.key.pid: info for info in procs.descendants(root)}
    assert set(before) == {middle, orphan}
    assert before[orphan].ppid == middle
    assert getattr(procs.read_proc(orphan, session_id=sid), "tagged", False)
    orphan_key = before[orphan].key

    assert helper.stdin is not None and helper.stdout is not None
    helper.stdin.write(b"release\n")  # the middle exits: its child is reparented
    helper.stdin.flush()
    assert json.loads(helper.stdout.readline()) == {"released": True}
    assert wait_for(lambda: getattr(procs.read_proc(orphan), "ppid", None) == record["reaper"])

    assert procs.descendants(root) == []
    assert not procs.is_ancestor(root, orphan)
    assert procs.is_alive(orphan_key)
    everyone = {info.key.pid: info for info in procs.scan_all(session_id=sid)}
    assert everyone[orphan].tagged and everyone[orphan].key == orphan_key
    assert everyone[root].tagged
    assert not everyone[os.getpid()].tagged
    assert {p for p, info in everyone.items() if info.tagged} >= {root, orphan}

    # What a tracker rooted at ``root`` scans for: the orphan, with its command line; not the
    # root itself, nor what it already knows, nor anything born before the root.
    root_key = everyone[root].key
    found = procs.TagScan(sid, born_since=root_key).scan()
    assert [info.key for info in found if info.key.pid == orphan] == [orphan_key]
    assert root not in {info.key.pid for info in found}
    assert all(info.tagged and info.key.start_ticks >= root_key.start_ticks for info in found)
    assert {info.key.pid: info.cmdline for info in found}[orphan] == everyone[orphan].cmdline != ""
    assert orphan not in {
        info.key.pid for info in procs.TagScan(sid, born_since=root_key).scan(known={orphan_key})
    }
    later = ProcessKey(root, orphan_key.start_ticks + 1)  # born after the orphan
    assert procs.TagScan(sid, born_since=later).scan() == []


def test_tag_scans_read_what_is_new_in_proc_and_report_each_process_once(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [incremental tag scan]."""
    sid = uuid.uuid4().hex
    tagged_env = {**os.environ, procs.SESSION_ENV: sid}
    root = spawn([*PYTHON, "-c", WAIT_STDIN], env=tagged_env)
    root_key = procs.process_key(root.pid)
    assert root_key is not None
    scan = procs.TagScan(sid, born_since=root_key)
    stat_reads: list[int] = []
    read_stat = procs._stat

    def counted_stat(pid: int) -> Any:
        stat_reads.append(pid)
        return read_stat(pid)

    monkeypatch.setattr(procs, "_stat", counted_stat)
    assert scan.scan() == []  # the root is the only tagged process, and it is left out
    first_reads = set(stat_reads)
    assert len(first_reads) >= 5 and {root.pid, os.getpid()} <= first_reads
    # What was born since the root and found untagged is read once more, at the next scan
    # (it may have been caught before its exec); the rest is judged for good.
    read_again = {pid for pid, _ in scan._untagged}
    assert root.pid not in read_again and os.getpid() not in read_again
    stat_reads.clear()

    later = spawn([*PYTHON, "-c", WAIT_STDIN], env=tagged_env)
    found = scan.scan()
    assert [info.key.pid for info in found] == [later.pid]
    assert found[0].tagged and "python" in found[0].cmdline
    # Only what /proc did not list at the first scan was read: the new process, and what
    # else started meanwhile on this machine; of what the first scan read, only what it
    # found untagged since the root.
    assert later.pid in stat_reads and first_reads & set(stat_reads) <= read_again
    stat_reads.clear()
    assert scan.scan() == []  # judged once: not reported again, not read again
    assert later.pid not in stat_reads
    # A fresh TagScan judges everything again.
    assert [info.key.pid for info in procs.TagScan(sid, born_since=root_key).scan()] == [later.pid]


FORK_THEN_EXEC = """
import os, sys
child = os.fork()
if child == 0:
    sys.stdin.readline()
    os.execve("/bin/sleep", ["sleep", "30"], {**os.environ, "LEAKCHECK_SESSION": sys.argv[1]})
print(child, flush=True)
os.waitpid(child, 0)
"""


def test_a_process_found_untagged_before_its_exec_is_judged_again_after_it() -> None:
    """NOTE [incremental tag scan]: forked, not exec'd yet, a process shows its parent's
    environment; the tag it execs with is found by the next scan (the first scan's "no"
    stood for good, and a loaded host's run test missed a process caught inside its exec)."""
    sid = uuid.uuid4().hex
    root_key = procs.process_key(os.getpid())
    assert root_key is not None
    helper = subprocess.Popen(
        [*PYTHON, "-c", FORK_THEN_EXEC, sid], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert helper.stdin is not None and helper.stdout is not None
    child = int(helper.stdout.readline())
    try:
        scan = procs.TagScan(sid, born_since=root_key)
        assert scan.scan() == []  # its parent's environment: untagged
        helper.stdin.write(b"go\n")
        helper.stdin.flush()
        assert wait_for(lambda: exec_done(child, "sleep"))  # its new image is set up
        assert [info.key.pid for info in scan.scan()] == [child]
        assert scan.scan() == []  # found once
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)
        helper.wait()
        helper.stdin.close()
        helper.stdout.close()


def test_vanishing_processes_mid_scan_do_not_raise(spawn: Spawn) -> None:
    helper, record = start_helper(spawn, "churn")
    sleeper = record["sleeper"]
    walks = 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        below = procs.descendants(helper.pid)
        assert sleeper in pids_of(below)
        assert all(info.ppid == helper.pid for info in below)
        for info in below:
            procs.is_alive(info.key)
            procs.read_proc(info.key.pid, session_id="s")
            procs.nvidia_fd_count(info.key.pid)
            procs.tagged_session(info.key.pid)
            procs.descriptors(info.key.pid)
        procs.shm_open_by(pids_of(below))
        if walks % 10 == 0:
            assert sleeper in pids_of(procs.scan_all(session_id="s"))
        walks += 1
    assert helper.stdin is not None and helper.stdout is not None
    helper.stdin.close()
    spawned = json.loads(helper.stdout.readline())["spawned"]
    assert walks > 5
    assert spawned > 20  # processes really came and went during the walks


def test_scan_all_includes_self_and_children(spawn: Spawn) -> None:
    child = spawn(["sh", "-c", "read x"])
    everyone = {info.key.pid: info for info in procs.scan_all()}
    assert everyone[child.pid].ppid == os.getpid()
    assert everyone[child.pid].cmdline == "sh -c read x"
    assert everyone[os.getpid()].key == procs.process_key(os.getpid())
    bare = {info.key.pid: info for info in procs.scan_all(with_cmdline=False)}
    assert bare[child.pid].cmdline == ""


# --- descriptors and namespaces -----------------------------------------------------------


def test_nvidia_target_classifier() -> None:
    nvidia = ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1"]
    other = ["/dev/null", "pipe:[1234]", "socket:[5]", "/tmp/dev/nvidia0", "anon_inode:[eventfd]"]
    assert all(procs.is_nvidia_device_target(t) for t in nvidia)
    assert not any(procs.is_nvidia_device_target(t) for t in other)


def test_nvidia_fd_count_zero_for_normal_processes(spawn: Spawn) -> None:
    child = spawn(["sh", "-c", "read x"])
    assert procs.nvidia_fd_count(child.pid) == 0
    assert procs.nvidia_fd_count(os.getpid()) == 0
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) > 0  # there were fds to classify


def test_pid_namespace_nested_matches_proc_self_status() -> None:
    nspid = [
        line
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("NSpid:")
    ]
    expected = bool(nspid) and len(nspid[0].split()) > 2
    assert procs.pid_namespace_nested() is expected


def test_pid_exists_here_for_processes_not_threads() -> None:
    assert procs.pid_exists_here(os.getpid())
    assert not procs.pid_exists_here(reaped_pid())
    assert not procs.pid_exists_here(0)
    assert not procs.pid_exists_here(-1)
    tids: list[int] = []
    release = threading.Event()

    def park() -> None:
        tids.append(threading.get_native_id())
        release.wait(5)

    thread = threading.Thread(target=park)
    thread.start()
    try:
        assert wait_for(lambda: bool(tids))
        assert os.path.exists(f"/proc/{tids[0]}")  # /proc/TID exists, yet it is no process
        assert not procs.pid_exists_here(tids[0])
    finally:
        release.set()
        thread.join()


# --- /dev/shm -----------------------------------------------------------------------------


def test_shm_segments_see_a_file_until_removed(shm_file: Path) -> None:
    shm_file.write_bytes(b"\0" * 1234)
    segment = procs.shm_segments()[shm_file.name]
    st = shm_file.stat()
    expected = (1234, st.st_mtime, st.st_ino, shm_file.name, st.st_blocks * 512, st.st_uid)
    assert segment == procs.ShmSegment(*expected)
    shm_file.unlink()
    assert shm_file.name not in procs.shm_segments()


def test_shm_segments_other_directory(tmp_path: Path) -> None:
    (tmp_path / "seg").write_bytes(b"12")
    (tmp_path / "subdir").mkdir()
    assert set(procs.shm_segments(str(tmp_path))) == {"seg"}
    assert procs.shm_segments(str(tmp_path / "missing")) == {}


def test_shm_open_by_sees_open_and_mapped_files(shm_file: Path, spawn: Spawn) -> None:
    shm_file.write_bytes(b"\0" * mmap.PAGESIZE)
    other = spawn(["sh", "-c", "read x"])
    me = os.getpid()

    def mine(pid: int) -> list[str]:
        # Only this test's file: the test process may hold other segments (semaphores).
        held = procs.shm_open_by([pid, other.pid])
        assert other.pid not in held
        return [name for name in held.get(pid, []) if name.startswith(shm_file.name)]

    with open(shm_file, "r+b") as handle:
        assert mine(me) == [shm_file.name]
        mapped = mmap.mmap(handle.fileno(), mmap.PAGESIZE)
    try:
        # Descriptor closed: only the mapping holds it now.
        assert mine(me) == [shm_file.name]
        shm_file.unlink()
        assert mine(me) == [f"{shm_file.name} (deleted)"]
    finally:
        mapped.close()
    assert mine(me) == []


def test_shm_open_by_names_only_the_files_in_that_directory(tmp_path: Path) -> None:
    folder, sibling = tmp_path / "shm", tmp_path / "shmx"  # a name that starts alike
    folder.mkdir()
    sibling.mkdir()
    me = os.getpid()
    with open(folder / "a", "wb"), open(sibling / "b", "wb"), open(tmp_path / "c", "wb"):
        folder_fd = os.open(folder, os.O_RDONLY)  # the folder itself is no file in it
        try:
            for directory in (str(folder), f"{folder}/"):
                assert procs.shm_open_by([me], directory) == {me: ["a"]}
        finally:
            os.close(folder_fd)


# --- descriptor cache (NOTE [descriptor cache]) ---------------------------------------------


def cached_proc_fds() -> dict[int, str]:
    """This process's open descriptors on other processes' /proc files."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        parts = target.split("/")
        if target.startswith("/proc/") and len(parts) > 2 and parts[2].isdigit():
            found[int(name)] = target
    return found


@pytest.fixture
def fresh_cache() -> Iterator[None]:
    procs._forget_handles_after_fork()  # closes every cached descriptor
    yield
    procs._forget_handles_after_fork()


def test_cache_bounded_and_released_when_processes_go(
    spawn: Spawn, fresh_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    helper, record = start_helper(spawn, "tree", "--sleepers=3", "--subtrees=1")
    expected = tree_pids(record)
    monkeypatch.setattr(procs, "_cached_fd_limit", lambda: 4)
    for _ in range(3):
        assert set(pids_of(procs.descendants(helper.pid))) == expected
        assert 0 < len(cached_proc_fds()) <= 4
    monkeypatch.setattr(procs, "_cached_fd_limit", lambda: 64)
    assert set(pids_of(procs.descendants(helper.pid))) == expected
    held = {int(t.split("/")[2]) for t in cached_proc_fds().values()}
    assert held == expected | {helper.pid}

    assert helper.stdin is not None
    helper.stdin.close()
    helper.wait()
    for _ in range(3):  # entries unused for two walks are closed; dead ones at once
        procs.descendants(os.getpid())
    held = {int(t.split("/")[2]) for t in cached_proc_fds().values()}
    assert not held & (expected | {helper.pid})


def test_cached_stat_of_reaped_process_is_dropped(spawn: Spawn, fresh_cache: None) -> None:
    child = spawn(["sh", "-c", "read x"])
    key = procs.process_key(child.pid)
    assert key is not None and procs.is_alive(key)
    assert child.pid in procs._handles
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    assert not procs.is_alive(key)
    assert child.pid not in procs._handles
    assert not any(t.startswith(f"/proc/{child.pid}/") for t in cached_proc_fds().values())


def _report_inherited(fds: list[int], queue: Any) -> None:
    still_open = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/proc/") and not target.startswith(f"/proc/{os.getpid()}/"):
            still_open.append(fd)
    queue.put((still_open, len(procs._handles)))


def test_forked_child_closes_inherited_cache(spawn: Spawn, fresh_cache: None) -> None:
    spawn(["sh", "-c", "read x"])
    assert procs.descendants(os.getpid())
    fds = list(cached_proc_fds())
    assert fds
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()
    child = context.Process(target=_report_inherited, args=(fds, queue))
    child.start()
    try:
        still_open, handles = queue.get()
    finally:
        child.join(5)
    assert (still_open, handles) == ([], 0)
    assert child.exitcode == 0


def _child_from_new_thread(started: list[subprocess.Popen[bytes]]) -> threading.Event:
    """Start a thread that starts a child (in that thread's children file) and parks."""
    release = threading.Event()
    before = len(started)

    def run() -> None:
        started.append(subprocess.Popen([*PYTHON, "-c", WAIT_STDIN], stdin=subprocess.PIPE))
        release.wait(10)

    threading.Thread(target=run, daemon=True).start()
    assert wait_for(lambda: len(started) > before)
    return release


def test_a_child_of_a_thread_that_replaced_another_is_found_within_the_relist_bound() -> None:
    """The cached task list is reused while the thread count holds (NOTE [descriptor cache]):
    a new thread's child is found at once when the count changed, and within the relist
    bound when a thread replaced another between two walks."""
    me = os.getpid()
    started: list[subprocess.Popen[bytes]] = []
    releases: list[threading.Event] = []
    try:
        procs.descendants(me, with_cmdline=False)  # cache this process's task list
        releases.append(_child_from_new_thread(started))  # one thread more
        found = {info.key.pid for info in procs.descendants(me, with_cmdline=False)}
        assert started[0].pid in found

        # Same count: a parked thread ends, and another one starts a child.
        gone = threading.Event()

        def short_lived() -> None:
            gone.wait(10)

        spare = threading.Thread(target=short_lived, daemon=True)
        spare.start()
        procs.descendants(me, with_cmdline=False)  # cached with the spare thread
        gone.set()
        spare.join()
        releases.append(_child_from_new_thread(started))
        walks = 0
        while started[1].pid not in {
            info.key.pid for info in procs.descendants(me, with_cmdline=False)
        }:
            walks += 1
            assert walks <= procs._RELIST_EVERY, "the new thread's child was never found"
    finally:
        for release in releases:
            release.set()
        for child in started:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(10)


# --- quick walks (NOTE [quick walk]) -------------------------------------------------------


def _quick(pid: int) -> list[ProcInfo]:
    return procs.descendants(pid, with_cmdline=False, quick=True)


def test_quick_walks_find_what_full_walks_find(spawn: Spawn) -> None:
    helper, record = start_helper(spawn, *_FULL_TREE)
    full = procs.descendants(helper.pid, with_cmdline=False)
    assert set(pids_of(full)) == tree_pids(record)
    for _ in range(2 * procs._RECHECK_EVERY):  # every mix of served and re-read processes
        quick = _quick(helper.pid)
        assert {(i.key, i.ppid) for i in quick} == {(i.key, i.ppid) for i in full}


def test_quick_walks_see_new_and_reaped_children_at_once_and_zombies_within_the_bound(
    spawn: Spawn,
) -> None:
    me = os.getpid()
    _quick(me)
    child = spawn([*PYTHON, "-c", WAIT_STDIN])
    assert child.pid in pids_of(_quick(me))  # new: read in full at once
    for _ in range(procs._RECHECK_EVERY):
        _quick(me)  # known now, served from its last full read
    assert child.stdin is not None
    child.stdin.close()  # it exits; not reaped yet: a zombie, still listed under us
    assert wait_for(lambda: _state(child.pid) == b"Z")
    walks = 0
    while child.pid in pids_of(_quick(me)):
        walks += 1
        assert walks <= procs._RECHECK_EVERY, "a zombie stayed alive past the re-read bound"
    child.wait()  # reaped: no longer listed at all
    assert child.pid not in pids_of(_quick(me))


def test_quick_walks_read_other_threads_children_within_the_bound(spawn: Spawn) -> None:
    helper, record = start_helper(spawn, "tree", "--sleepers=1", "--thread-sleepers=2")
    me = os.getpid()
    main_thread_side = {helper.pid, *record["sleepers"]}
    thread_side = set(record["thread_sleepers"])
    assert main_thread_side | thread_side <= set(pids_of(procs.descendants(me)))
    seen_thread_side: set[int] = set()
    for _ in range(procs._RECHECK_EVERY):
        found = set(pids_of(_quick(me)))
        assert main_thread_side <= found  # every quick walk
        seen_thread_side |= found & thread_side
    assert seen_thread_side == thread_side  # within the re-read bound


@contextlib.contextmanager
def _a_thread_alive(spawn: Spawn | None = None) -> Iterator[int | None]:
    """A thread that lives through the block; with ``spawn``, one that started a child (its
    PID is given). The thread stays alive: an exited thread's children move to another."""
    started, release = threading.Event(), threading.Event()
    children: list[subprocess.Popen[bytes]] = []

    def run() -> None:
        if spawn is not None:
            children.append(spawn([*PYTHON, "-c", WAIT_STDIN]))
        started.set()
        release.wait(60)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        yield children[0].pid if children else None
    finally:
        release.set()
        thread.join()


def _quick_walks_until_found(root: int, child: int) -> int:
    """Quick walks of ``root`` until one lists ``child``: how many it took."""
    walks = 1
    while child not in pids_of(_quick(root)):
        walks += 1
        assert walks <= procs._RECHECK_EVERY, "a new parent thread was not read in time"
    return walks


def test_quick_walks_read_the_roots_parent_threads_and_its_other_threads_within_the_bound(
    spawn: Spawn,
) -> None:
    """A quick walk reads the root's main thread and the threads that had children at its
    last full read; a thread that starts its first child is read within the bound."""
    me = os.getpid()
    _quick(me)
    with _a_thread_alive(spawn) as child:
        assert child is not None
        _quick_walks_until_found(me, child)
        for _ in range(2 * procs._RECHECK_EVERY):
            assert child in pids_of(_quick(me))  # a parent thread now: every quick walk


def test_a_thread_that_replaced_another_at_the_same_count_is_read_at_the_roots_next_full_read(
    spawn: Spawn,
) -> None:
    """One thread ends and another starts between two walks: the thread count is the same,
    yet the root's task list is taken again, so the new thread's child is found."""
    me = os.getpid()
    with _a_thread_alive():
        procs.descendants(me, with_cmdline=False)  # the root's task list names that thread
    with _a_thread_alive(spawn) as child:
        assert child is not None
        assert child in pids_of(procs.descendants(me, with_cmdline=False))
        _quick_walks_until_found(me, child)


def test_quick_walks_past_a_tight_descriptor_budget_stay_exact_and_bounded(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    helper, record = start_helper(spawn, "tree", "--sleepers=6", "--thread-sleepers=2")
    main_thread_side = {helper.pid, *record["sleepers"]}
    thread_side = set(record["thread_sleepers"])
    procs._forget_handles_after_fork()  # start from an empty cache (closes its descriptors)
    monkeypatch.setattr(procs, "_cached_fd_limit", lambda: 6)  # fewer than two per process
    me = os.getpid()
    assert main_thread_side | thread_side <= set(pids_of(procs.descendants(me)))
    seen_thread_side: set[int] = set()
    for _ in range(2 * procs._RECHECK_EVERY):
        found = set(pids_of(_quick(me)))
        assert main_thread_side <= found
        seen_thread_side |= found & thread_side
        assert procs._cached_fd_count <= 6
    assert seen_thread_side == thread_side


_MAPS_CHILD = """
import ctypes, mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
os.unlink(sys.argv[1])
# libc's mmap, not Python's: Python's keeps a duplicate descriptor, which would name the file
# in /proc/PID/fd; here only the mapping does.
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
address = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
os.close(fd)
assert address not in (None, ctypes.c_void_p(-1).value)
# New mappings go below the old ones; alternating protections keep them apart in maps.
fillers = [mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE * (i % 2)))
           for i in range(400)]
print("ready", flush=True)
time.sleep(60)
"""


def test_a_mapping_past_the_first_page_of_maps_is_found() -> None:
    """/proc/PID/maps hands out about a page per read: a /dev/shm file mapped before many
    other mappings sits past the first page, and a reader that takes a short read for the
    end never sees it."""
    name = f"leakcheck-test-maps-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    child = subprocess.Popen(
        [sys.executable, "-c", _MAPS_CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        with open(f"/proc/{child.pid}/maps", "rb") as file:
            maps = file.read()
        assert maps.index(name.encode()) > 2 * mmap.PAGESIZE  # the case under test
        held = procs.shm_open_by([child.pid])
        assert any(name in segment for segment in held.get(child.pid, []))
        assert (
            procs._read(
                f"/proc/{child.pid}/maps", 65536, whole=True, record_bytes=procs._ANY_RECORD
            )
            == maps
        )
    finally:
        child.kill()
        child.wait()
        path.unlink(missing_ok=True)


def test_the_fork_ledger_names_forked_descendants_gone_ones_too() -> None:
    """NOTE [fork ledger]: a child forked from Python and its own forked child are named after
    both exited; a program started by exec is not; a drain empties the ledger."""
    ledger = procs.fork_ledger()
    assert procs.fork_ledger() is ledger
    ledger.drain()
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_fork_one, args=(context,))
    child.start()
    child.join()
    started = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    found = ledger.drain()
    assert child.pid in found and len(found) == 2, found  # the child and its child
    assert int(started.stdout) not in found
    assert ledger.drain() == set()


def _fork_one(context: Any) -> None:
    grandchild = context.Process(target=int)
    grandchild.start()
    grandchild.join()
