"""leakcheck.observe.hostmem against real processes: USS/PSS/RSS, copy-on-read, /dev/shm files."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from leakcheck.core.model import ProcessKey
from leakcheck.observe import hostmem, procs
from leakcheck.observe.hostmem import HostMemory
from leakcheck.observe.procs import ShmSegment
from tests.polling import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

MIB = 2**20
PYTHON = [sys.executable, "-I", "-S"]

# A process that builds some data, forks a child sharing it, and has the child act on it on
# command. stdin lines: "a" (the child allocates and touches ARG MiB of its own), "r" (it
# reads the data without writing to it), "w" (it walks the data as Python objects, so every
# object's reference count is written). Each command is answered by one line "done". At
# stdin EOF the parent closes the command pipe: the child exits, and the parent reaps it.
FORKER = textwrap.dedent(
    """
    import json, os, sys
    mode, arg = sys.argv[1], int(sys.argv[2])
    if mode == "bytes":
        data = b"\\x01" * (arg << 20)
    elif mode == "floats":
        data = [float(i) for i in range(arg)]
    else:
        data = None
    cmd_r, cmd_w = os.pipe()
    ack_r, ack_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(cmd_w)
        os.close(ack_r)
        own = []
        while True:
            cmd = os.read(cmd_r, 1)
            if not cmd:
                os._exit(0)
            if cmd == b"a":
                own.append(b"\\x02" * (arg << 20))
            elif cmd == b"r":
                if mode == "bytes":
                    data.count(b"\\x02")
                else:
                    len(data)
            elif cmd == b"w":
                for item in data:
                    pass
            os.write(ack_w, b"k")
    os.close(cmd_r)
    os.close(ack_w)
    print(json.dumps({"child": pid}), flush=True)
    for line in sys.stdin:
        os.write(cmd_w, line[:1].encode())
        os.read(ack_r, 1)
        print("done", flush=True)
    os.close(cmd_w)
    os.waitpid(pid, 0)
    """
)

# Holds a file open (mode "fd") or only mapped, its descriptor closed (mode "map"), until
# stdin reaches EOF.
HOLDER = textwrap.dedent(
    """
    import mmap, sys
    mode, path = sys.argv[1], sys.argv[2]
    handle = open(path, "r+b")
    if mode == "map":
        mapped = mmap.mmap(handle.fileno(), 0)
        handle.close()
    print("ready", flush=True)
    sys.stdin.read()
    """
)

Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start Python helpers with piped stdin/stdout; close, wait for and reap them at the end
    (killing only a helper this test started, by its own handle, if it does not exit)."""
    started: list[subprocess.Popen[str]] = []

    def start(code: str, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*PYTHON, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        assert proc.stdin is not None and proc.stdout is not None
        if not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


class Forker:
    """A FORKER helper: its child's PID, and commands to the child."""

    def __init__(self, spawn: Spawn, mode: str, arg: int) -> None:
        self.proc = spawn(FORKER, mode, str(arg))
        assert self.proc.stdout is not None
        self.child: int = json.loads(self.proc.stdout.readline())["child"]

    def command(self, cmd: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def memory(self) -> HostMemory:
        memory = hostmem.read_host_memory(self.child)
        assert memory is not None and memory.source == "smaps_rollup"
        assert memory.uss_bytes is not None and memory.rss_bytes is not None
        return memory


def uss(memory: HostMemory) -> int:
    assert memory.uss_bytes is not None
    return memory.uss_bytes


def rss(memory: HostMemory) -> int:
    assert memory.rss_bytes is not None
    return memory.rss_bytes


def reaped_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- memory of real processes ----------------------------------------------------------------


def test_own_process_figures_are_consistent() -> None:
    memory = hostmem.read_host_memory(os.getpid())
    assert memory is not None and memory.source == "smaps_rollup"
    assert 0 < uss(memory) <= rss(memory)
    assert memory.pss_bytes is not None and uss(memory) <= memory.pss_bytes <= rss(memory)
    assert memory.swap_bytes is not None and memory.anon_bytes is not None
    # status's peak comes with it, never below the end.
    assert memory.rss_peak_bytes is not None and memory.rss_peak_bytes >= rss(memory)


def test_private_allocation_grows_uss_by_its_size(spawn: Spawn) -> None:
    size_mib = 64
    forker = Forker(spawn, "none", size_mib)
    before = forker.memory()
    forker.command("a")  # the child allocates and fills 64 MiB of its own
    after = forker.memory()
    grown = uss(after) - uss(before)
    # Deterministic: the bytes are the child's alone whatever the machine's load; the slack
    # is the interpreter's own small allocations around it.
    assert size_mib * MIB * 0.95 <= grown <= (size_mib + 8) * MIB
    assert rss(after) - rss(before) >= size_mib * MIB * 0.95


def test_forked_reader_shares_pages_and_rss_counts_them(spawn: Spawn) -> None:
    size_mib = 64
    forker = Forker(spawn, "bytes", size_mib)
    forker.command("r")  # the child reads every byte of the parent's data, writes none
    memory = forker.memory()
    assert rss(memory) >= size_mib * MIB  # RSS counts the shared pages ...
    assert uss(memory) < size_mib * MIB / 4  # ... USS does not: they are not its own
    assert memory.pss_bytes is not None and memory.pss_bytes < rss(memory)


def test_walking_python_objects_copies_them_into_the_worker(spawn: Spawn) -> None:
    count = 1_500_000  # floats of 24 bytes: about 34 MiB of objects, + 11 MiB of list
    objects_bytes = count * 24
    forker = Forker(spawn, "floats", count)
    forker.command("r")  # len(): touches the list object only
    read_only = forker.memory()
    assert uss(read_only) < objects_bytes / 4
    forker.command("w")  # iterating writes every float's reference count: copy-on-read
    walked = forker.memory()
    assert uss(walked) - uss(read_only) >= objects_bytes * 0.75
    # The pages moved from shared to private: RSS barely changed.
    assert abs(rss(walked) - rss(read_only)) < objects_bytes / 4


def test_copied_bytes_counts_pages_moved_from_shared_to_private(spawn: Spawn) -> None:
    count = 1_500_000  # floats of 24 bytes: about 34 MiB of objects
    objects_bytes = count * 24
    forker = Forker(spawn, "floats", count)
    birth = forker.memory()
    assert birth.shared_dirty_bytes is not None and birth.shared_dirty_bytes >= objects_bytes
    forker.command("r")
    assert (hostmem.copied_bytes(birth, forker.memory()) or 0) < objects_bytes / 8
    forker.command("w")  # copy-on-read of every float
    copied = hostmem.copied_bytes(birth, forker.memory())
    assert copied is not None and copied >= objects_bytes * 0.75


def test_new_memory_and_shared_reads_are_not_copies(spawn: Spawn) -> None:
    size_mib = 64
    forker = Forker(spawn, "bytes", size_mib)
    birth = forker.memory()
    forker.command("r")  # reads the parent's bytes: they stay shared
    forker.command("a")  # 64 MiB of its own: private, but no shared page was lost
    now = forker.memory()
    assert uss(now) - uss(birth) >= size_mib * MIB * 0.95
    copied = hostmem.copied_bytes(birth, now)
    assert copied is not None and copied < 4 * MIB
    # Without the dirty figures (a status read) nothing can be said.
    assert hostmem.copied_bytes(birth, HostMemory(None, None, rss(now), None, "status")) is None


def test_copied_bytes_is_bounded_by_the_private_gain() -> None:
    def reading(shared: int, private: int) -> HostMemory:
        return HostMemory(
            private, None, shared + private, None, "smaps_rollup",
            shared_dirty_bytes=shared, private_dirty_bytes=private,
        )  # fmt: skip

    birth = reading(200 * MIB, 10 * MIB)
    assert hostmem.copied_bytes(birth, reading(160 * MIB, 50 * MIB)) == 40 * MIB
    # Shared pages lost without a private gain (swapped out, their sharers gone): no copy.
    assert hostmem.copied_bytes(birth, reading(100 * MIB, 10 * MIB)) == 0
    # New private memory, nothing shared lost: no copy either.
    assert hostmem.copied_bytes(birth, reading(210 * MIB, 90 * MIB)) == 0


def test_gone_pid_zombie_and_reused_pid(spawn: Spawn) -> None:
    assert hostmem.read_host_memory(reaped_pid()) is None
    assert hostmem.read_host_memory(reaped_pid(), rollup=False) is None

    proc = spawn("import sys; sys.stdin.read()")
    key = procs.process_key(proc.pid)
    assert key is not None
    memory = hostmem.read_host_memory(key)
    assert memory is not None and memory.source == "smaps_rollup"
    # The same PID with another start time: what a reused PID looks like.
    assert hostmem.read_host_memory(ProcessKey(key.pid, key.start_ticks + 1)) is None

    assert proc.stdin is not None
    proc.stdin.close()  # it exits; not reaped yet: a zombie has no memory to read
    assert wait_for(lambda: not procs.is_alive(key), timeout_s=10.0)  # not reaped: a zombie
    zombie = hostmem.read_host_memory(proc.pid)
    assert zombie == HostMemory(None, None, None, None, "unknown")
    proc.wait()
    assert hostmem.read_host_memory(proc.pid) is None
    assert hostmem.read_host_memory(key) is None


def test_read_host_memories_skips_gone_and_keys_as_given() -> None:
    gone = reaped_pid()
    by_pid = hostmem.read_host_memories([os.getpid(), gone])
    assert set(by_pid) == {os.getpid()}
    key = procs.process_key(os.getpid())
    assert key is not None
    by_key = hostmem.read_host_memories([key, ProcessKey(gone, 100)], rollup=False)
    assert set(by_key) == {key}
    assert by_key[key].source == "status"


def test_status_only_read() -> None:
    memory = hostmem.read_host_memory(os.getpid(), rollup=False)
    assert memory is not None and memory.source == "status"
    assert memory.uss_bytes is None and memory.pss_bytes is None
    assert memory.rss_bytes is not None and memory.rss_peak_bytes is not None
    assert memory.rss_peak_bytes >= memory.rss_bytes
    assert memory.anon_bytes is not None


def test_status_fallback_when_smaps_rollup_is_denied(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    size_mib = 32
    forker = Forker(spawn, "bytes", size_mib)
    rollup = forker.memory()
    # Another user's process: smaps needs ptrace access, status does not.
    real_open = os.open

    def denied(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "smaps_rollup":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    memory = hostmem.read_host_memory(forker.child)
    assert memory is not None and memory.source == "status"
    assert memory.uss_bytes is None and memory.pss_bytes is None
    # RSS from status: the shared pages included, as in smaps_rollup's Rss.
    assert rss(memory) >= size_mib * MIB
    assert abs(rss(memory) - rss(rollup)) < 4 * MIB
    key = procs.process_key(forker.child)
    assert key is not None
    by_key = hostmem.read_host_memory(key)
    assert by_key is not None and by_key.source == "status"
    assert hostmem.read_host_memory(reaped_pid()) is None  # gone is still gone


def test_parsers_on_fixed_text() -> None:
    rollup = (
        b"00400000-7ffd0000 ---p 00000000 00:00 0        [rollup]\n"
        b"Rss:                1000 kB\nPss:                 600 kB\n"
        b"Pss_Anon:            100 kB\nShared_Clean:        500 kB\n"
        b"Shared_Dirty:        250 kB\n"
        b"Private_Clean:        50 kB\nPrivate_Dirty:       150 kB\n"
        b"Anonymous:           170 kB\nPrivate_Hugetlb:     2048 kB\n"
        b"Swap:                 30 kB\nSwapPss:               7 kB\n"
    )
    assert hostmem._parse_rollup(rollup) == HostMemory(
        uss_bytes=(50 + 150 + 2048) * 1024,
        pss_bytes=600 * 1024,
        rss_bytes=1000 * 1024,
        swap_bytes=30 * 1024,
        source="smaps_rollup",
        anon_bytes=170 * 1024,
        shared_dirty_bytes=250 * 1024,
        private_dirty_bytes=150 * 1024,
    )
    assert hostmem._parse_rollup(b"") is None
    status = (
        b"Name:\tpython\nState:\tS (sleeping)\nVmPeak:\t  9000 kB\nVmHWM:\t  5000 kB\n"
        b"VmRSS:\t  4000 kB\nRssAnon:\t  1000 kB\nRssFile:\t  2500 kB\nRssShmem:\t  500 kB\n"
        b"VmSwap:\t     0 kB\nCpus_allowed:\tff\n"
    )
    assert hostmem._parse_status(status) == HostMemory(
        uss_bytes=None,
        pss_bytes=None,
        rss_bytes=4000 * 1024,
        swap_bytes=0,
        source="status",
        anon_bytes=1000 * 1024,
        rss_peak_bytes=5000 * 1024,
    )
    assert hostmem._parse_status(b"Name:\tkthreadd\nState:\tS (sleeping)\n").source == "unknown"


# --- /dev/shm -----------------------------------------------------------------------------------


def test_job_shm_files_new_and_recreated() -> None:
    before = {
        "old": ShmSegment(10, 1.0, 100),
        "again": ShmSegment(20, 1.0, 101),
        "gone": ShmSegment(30, 1.0, 102),
    }
    now = {
        "old": ShmSegment(11, 2.0, 100, "old"),  # same file, grown: not the job's
        "again": ShmSegment(20, 2.0, 201, "again"),  # removed and created again: new
        "torch_1": ShmSegment(4096, 2.0, 202, "torch_1"),
    }
    assert hostmem.job_shm_files(before, now) == [
        ShmSegment(20, 2.0, 201, "again"),
        ShmSegment(4096, 2.0, 202, "torch_1"),
    ]
    assert hostmem.job_shm_files(now, now) == []


def start_holder(spawn: Spawn, mode: str, path: Path) -> int:
    proc = spawn(HOLDER, mode, str(path))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc.pid


def test_new_files_and_their_holders_in_a_stand_in_directory(spawn: Spawn, tmp_path: Path) -> None:
    directory = Path(os.path.realpath(tmp_path))  # /proc shows resolved paths
    (directory / "before").write_bytes(b"x" * 100)
    (directory / "replaced").write_bytes(b"x" * 200)
    before = procs.shm_segments(str(directory))

    (directory / "by_fd").write_bytes(b"\0" * mmap.PAGESIZE)
    (directory / "by_map").write_bytes(b"\0" * 2 * mmap.PAGESIZE)
    (directory / "left").write_bytes(b"\0" * 3)
    # Replaced: a new file under the old name (made before the old one is gone, so the
    # inode cannot be reused).
    (directory / "replaced.new").write_bytes(b"y" * 300)
    os.replace(directory / "replaced.new", directory / "replaced")
    by_fd = start_holder(spawn, "fd", directory / "by_fd")
    by_map = start_holder(spawn, "map", directory / "by_map")

    files = {
        item.name: item
        for item in hostmem.job_shm_files(before, procs.shm_segments(str(directory)))
    }
    assert set(files) == {"by_fd", "by_map", "left", "replaced"}
    assert files["by_map"].size_bytes == 2 * mmap.PAGESIZE
    assert files["replaced"].size_bytes == 300
    assert files["replaced"].inode == (directory / "replaced").stat().st_ino
    held = procs.shm_open_by([by_fd, by_map, reaped_pid()], str(directory))
    assert held == {by_fd: ["by_fd"], by_map: ["by_map"]}

    (directory / "by_map").unlink()  # still mapped: its memory is held, not visible
    assert "by_map" not in {
        item.name for item in hostmem.job_shm_files(before, procs.shm_segments(str(directory)))
    }
    assert procs.shm_open_by([by_map], str(directory)) == {by_map: ["by_map (deleted)"]}


def test_the_files_this_process_makes_are_noted_and_only_those(tmp_path: Path) -> None:
    """NOTE [made here]: a file this process creates (open, os.open, a sized descriptor) is
    noted; one another process made, then opened here, is not; a removed one is forgotten."""
    folder = tmp_path / "shm"
    folder.mkdir()
    hostmem.note_shm_made(str(folder))
    (folder / "by_open").write_bytes(b"x")
    os.close(os.open(folder / "by_os_open", os.O_CREAT | os.O_WRONLY))
    code = "import sys; open(sys.argv[1], 'wb').close(); open(sys.argv[2], 'wb').close()"
    others, sized = folder / "others", folder / "sized"
    subprocess.run([sys.executable, "-c", code, others, sized], check=True)
    (others).write_bytes(b"mine now?")  # opened to write, not made: still the other's
    with open(sized, "r+b") as handle:
        os.ftruncate(handle.fileno(), 4096)  # as SharedMemory sizes what shm_open made
    (folder / "gone").write_bytes(b"x")
    (folder / "gone").unlink()
    (tmp_path / "elsewhere").write_bytes(b"x")  # not in a watched folder
    assert hostmem.shm_made_here(str(folder)) == {"by_open", "by_os_open", "sized"}
    assert hostmem.shm_made_here(str(tmp_path)) == set()
    # The job's on this evidence alone: nobody holds them, no name carries a PID.
    names = ["by_open", "others", "sized"]
    assert hostmem.job_shm(names, [os.getpid()], {os.getpid()}, str(folder)) == {
        "by_open": None,
        "sized": None,
    }


def test_shm_capacity_from_statvfs(tmp_path: Path) -> None:
    capacity = hostmem.shm_capacity(str(tmp_path))
    st = os.statvfs(tmp_path)
    assert capacity is not None
    assert capacity.total_bytes == st.f_blocks * st.f_frsize
    assert capacity.free_bytes == st.f_bavail * st.f_frsize
    assert capacity.used_bytes == (st.f_blocks - st.f_bfree) * st.f_frsize
    assert capacity.total_bytes is not None and capacity.used_bytes <= capacity.total_bytes
    assert hostmem.shm_capacity(str(tmp_path / "missing")) is None
    if Path("/dev/shm").is_dir():
        dev_shm = hostmem.shm_capacity()
        assert dev_shm is not None and dev_shm.directory == "/dev/shm"
        assert dev_shm.total_bytes is not None and dev_shm.total_bytes > 0


def test_shm_capacity_without_a_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = os.statvfs(tmp_path)
    # A tmpfs mounted with size=0 reports no blocks at all.
    fake = os.statvfs_result((4096, 4096, 0, 0, 0, *real[5:]))
    monkeypatch.setattr(os, "statvfs", lambda path: fake)
    capacity = hostmem.shm_capacity(str(tmp_path))
    assert capacity == hostmem.ShmCapacity(str(tmp_path), None, 0, 0)
