"""Teardown policy on CPU: real DataLoader workers, real subprocesses (NOTE [teardown policy])."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import multiprocessing
import multiprocessing.queues
import os
import pickle
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from torch.utils.data import DataLoader, Dataset

from leakcheck.core.errors import UsageError
from leakcheck.observe import mailbox, procs
from leakcheck.worker import teardown
from tests.pyrun import run_python

ROOT = Path(__file__).resolve().parents[1]
PR_GET_PDEATHSIG = 2


class PidDataset(Dataset[int]):
    """Each item is the PID of the process that produced it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return os.getpid()


class GrandchildDataset(Dataset[int]):
    """Each worker starts one long sleeper (a grandchild of the test) and returns its PID."""

    def __init__(self) -> None:
        self.started: dict[int, int] = {}

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        me = os.getpid()
        if me not in self.started:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            self.started[me] = child.pid
        return self.started[me]


def write_marker(folder: str, worker_id: int) -> None:
    """A user worker_init_fn whose side effect the parent can see."""
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(-1)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    Path(folder, f"worker-{worker_id}-{os.getpid()}").write_text(str(value.value))


@pytest.fixture
def box(monkeypatch: pytest.MonkeyPatch) -> Any:
    folder = mailbox.create()
    monkeypatch.setenv(mailbox.MAILBOX_ENV, folder)
    yield folder
    mailbox.remove(folder)


def records(folder: str, kind: str) -> list[dict[str, Any]]:
    """The records of one kind in a mailbox, left there (the tracker's reads delete them)."""
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json") and not name.startswith("."):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                found.append(json.load(handle))
    return [r for r in found if r["kind"] == kind]


def run_loader(init: teardown.WorkerInit, *, workers: int, context: str = "fork") -> list[int]:
    loader = DataLoader(
        PidDataset(),
        batch_size=2,
        num_workers=workers,
        worker_init_fn=init,
        multiprocessing_context=context,
    )
    return [int(pid) for batch in loader for pid in batch]


def test_worker_init_fn_pickles_with_its_user_fn(tmp_path: Path) -> None:
    init = teardown.worker_init_fn(
        functools.partial(write_marker, str(tmp_path)), terminate_children=True
    )
    clone = pickle.loads(pickle.dumps(init))
    assert isinstance(clone, teardown.WorkerInit)
    assert clone.terminate_children is True and clone.release is True
    assert isinstance(clone.user_fn, functools.partial)
    assert clone.user_fn.args == (str(tmp_path),)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_every_worker_posts_identity_and_teardown(box: str, tmp_path: Path, context: str) -> None:
    init = teardown.worker_init_fn(functools.partial(write_marker, str(tmp_path)))
    pids = set(run_loader(init, workers=2, context=context))
    workers = records(box, "worker")
    assert {r["pid"] for r in workers} == pids
    assert sorted(r["worker_id"] for r in workers) == [0, 1]
    parent = procs.process_key(os.getpid())
    assert parent is not None
    for r in workers:
        # Identities by start ticks (NOTE [process identity]): born after this process.
        now_ticks = procs.since_boot_s() * procs.clock_ticks()
        assert parent.start_ticks <= r["start_ticks"] <= now_ticks
        assert r["ppid"] == os.getpid()
    downs = records(box, "teardown")
    assert {r["pid"] for r in downs} == pids
    assert all(r["cuda_initialized"] is False and r["error"] is None for r in downs)
    # The user's worker_init_fn ran in every worker, after PR_SET_PDEATHSIG was set.
    markers = sorted(p.name.split("-")[1] for p in tmp_path.iterdir())
    assert markers == ["0", "1"]
    assert {int(p.read_text()) for p in tmp_path.iterdir()} == {int(signal.SIGTERM)}


def test_release_off_reports_what_it_held_and_releases_nothing(box: str, tmp_path: Path) -> None:
    init = teardown.worker_init_fn(functools.partial(write_marker, str(tmp_path)), release=False)
    pids = set(run_loader(init, workers=2))
    assert {r["pid"] for r in records(box, "worker")} == pids
    reports = records(box, "teardown")
    assert {r["pid"] for r in reports} == pids
    for report in reports:  # CPU workers: no CUDA, nothing held, nothing released
        assert report["released"] is False and report["context_released"] is False
        assert report["cuda_initialized"] is False and report["gpu_bytes_by_device"] == {}
        assert isinstance(report["monotonic_s"], float)
    assert {int(p.read_text()) for p in tmp_path.iterdir()} == {0}  # no death signal


def test_death_signal_off_keeps_the_rest_of_the_policy(box: str, tmp_path: Path) -> None:
    init = teardown.worker_init_fn(functools.partial(write_marker, str(tmp_path)))
    init.death_signal = False  # what watch() does for workers started off the main thread
    pids = set(run_loader(init, workers=2))
    assert {r["pid"] for r in records(box, "teardown")} == pids
    assert {int(p.read_text()) for p in tmp_path.iterdir()} == {0}


def test_without_mailbox_workers_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mailbox.MAILBOX_ENV, raising=False)
    pids = run_loader(teardown.worker_init_fn(), workers=2)
    assert len(pids) == 8 and os.getpid() not in pids


def grandchildren(*, terminate: bool) -> list[psutil.Process]:
    loader = DataLoader(
        GrandchildDataset(),
        batch_size=2,
        num_workers=2,
        worker_init_fn=teardown.worker_init_fn(terminate_children=terminate),
        multiprocessing_context="fork",
    )
    found = []
    for pid in {int(pid) for batch in loader for pid in batch}:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(psutil.Process(pid))
    return found


def test_terminate_children_ends_the_workers_descendants(box: str) -> None:
    left = grandchildren(terminate=True)
    alive = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:  # the test's own processes: never leave them behind
        proc.kill()
    assert alive == []


def test_without_terminate_children_the_grandchild_outlives_its_worker(box: str) -> None:
    left = grandchildren(terminate=False)
    try:
        assert len(left) == 2
        assert all(p.is_running() and p.ppid() != os.getpid() for p in left)
    finally:
        for proc in left:
            proc.kill()


def test_register_resource_rejects_other_things() -> None:
    with pytest.raises(UsageError) as caught:
        teardown.register_resource(42)
    assert "\n" not in str(caught.value)
    assert "stream" in str(caught.value) and "int" in str(caught.value)


def test_unregister_resource() -> None:
    def release() -> None:
        pass

    teardown.register_resource(release)
    assert teardown.unregister_resource(release) is True
    assert teardown.unregister_resource(release) is False


EXIT_SCRIPT = """
import os, sys
from torch.utils.data import DataLoader
from leakcheck.worker import teardown
class Loud:
    # Destroyed or called during shutdown: says so on stderr.
    def __call__(self):
        sys.stderr.write("released at exit\\n")
    def __del__(self):
        sys.stderr.write("destroyed at exit\\n")

teardown.register_resource(Loud())
teardown.register_resource(Loud())
loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                    worker_init_fn=teardown.worker_init_fn(), multiprocessing_context="fork")
assert sum(len(b) for b in loader) == 8
iterator = iter(loader)  # workers alive at exit, as in a crashed script
print("ok")
"""


def test_parent_exit_with_registered_resources_is_clean_over_20_runs() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = list(pool.map(lambda _: run_python(EXIT_SCRIPT), range(20)))
    assert [r.returncode for r in runs] == [0] * 20
    assert [r.stderr for r in runs] == [""] * 20
    assert all(r.stdout == "ok\n" for r in runs)


def test_release_device_never_imports_torch() -> None:
    done = run_python(
        """
        import sys
        from leakcheck import release_device
        result = release_device()
        assert "torch" not in sys.modules, "release_device imported torch"
        print(result.context_released, result.freed_cache_bytes, result.note)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False 0 nothing to free")


def test_release_device_without_cuda_does_not_initialise_it() -> None:
    done = run_python(
        """
        import torch
        from leakcheck import release_device
        result = release_device(force=True)
        print(torch.cuda.is_initialized(), result.device_index, result.context_released)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "False"]


def test_release_device_is_a_no_op_at_interpreter_exit() -> None:
    done = run_python(
        """
        import atexit
        from leakcheck.worker import teardown
        atexit.register(lambda: print(teardown.release_device().note))
        teardown.register_resource(print)  # moves leakcheck's exit hook ahead of the one above
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "interpreter is exiting: left to the runtime"


def _pin_memory_loop(stop: threading.Event) -> None:
    """Named as torch's pin-memory thread target: the thread's name carries it."""
    stop.wait(10)


def test_release_device_ignores_threads_that_cannot_touch_the_device() -> None:
    """A finished pin-memory loader's thread and multiprocessing's queue feeder do not block
    a release; any other thread does, by name."""
    stop = threading.Event()
    queue: multiprocessing.queues.Queue[int] = multiprocessing.get_context("fork").Queue()
    queue.put(1)  # starts the queue's feeder thread
    pin = threading.Thread(target=_pin_memory_loop, args=(stop,), daemon=True)
    other = threading.Thread(target=stop.wait, args=(10,), name="user-thread")
    pin.start()
    other.start()
    try:
        names = teardown._other_threads()
    finally:
        stop.set()
        pin.join()
        other.join()
        queue.get()
        queue.close()
        queue.join_thread()
    assert "user-thread" in names
    assert not any("QueueFeederThread" in n or "_pin_memory_loop" in n for n in names), names
