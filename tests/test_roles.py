"""Runtime helpers by command line; a direct child is a worker only when it is a known one."""

from __future__ import annotations

import sys

import pytest

from leakcheck.core.model import ProcessKey
from leakcheck.core.roles import RUNTIME_HELPERS, direct_child_role, is_runtime_helper

PY = sys.executable


@pytest.mark.parametrize(
    "cmdline",
    [
        f"{PY} -c from multiprocessing.resource_tracker import main;main(7)",
        f"{PY} -c from multiprocessing.semaphore_tracker import main;main(7)",
        f"{PY} -c from multiprocessing.forkserver import main; main(8, 9, ['__main__'], "
        "**{'sys_path': ['/x']})",
        f"{PY} -m loky.backend.popen_loky_posix --process-name LokyProcess-1 --pipe 12",
        f"{PY} -c from loky.backend.resource_tracker import main; main(5, False)",
        "/venv/lib/python3.11/site-packages/torch/bin/torch_shm_manager",
        # inductor starts its compile workers by file, not by module name
        f"{PY} /venv/lib/python3.11/site-packages/torch/_inductor/compile_worker/__main__.py "
        "--pickler=torch._inductor.compile_worker.subproc_pool.SubprocPickler --workers=4",
        f"{PY} -m torch._inductor.compile_worker --workers=4",
        # the path form alone (a command line cut before its --pickler argument)
        f"{PY} /venv/lib/python3.11/site-packages/torch/_inductor/compile_worker/__main__.py",
    ],
)
def test_runtime_helpers(cmdline: str) -> None:
    assert is_runtime_helper(cmdline)


@pytest.mark.parametrize(
    "cmdline",
    [
        "",
        "sleep 30",
        "/bin/sh -c sleep 30; :",
        f"{PY} -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, "
        "pipe_handle=7) --multiprocessing-fork",  # a spawned DataLoader worker: not a helper
        f"{PY} train.py",
        f"{PY} tests/test_torch_shm_manager.py",
        f"{PY} -m mymultiprocessing.forkserver",
        f"{PY} -m multiprocessing.forkserver_tools",
        f"{PY} -m x.multiprocessing.resource_tracker",
    ],
)
def test_not_runtime_helpers(cmdline: str) -> None:
    assert not is_runtime_helper(cmdline)


def test_the_one_list() -> None:
    assert RUNTIME_HELPERS == (
        "multiprocessing.resource_tracker",
        "multiprocessing.semaphore_tracker",
        "multiprocessing.forkserver",
        "loky.backend.resource_tracker",
        "loky.backend.popen_loky_posix",
        "torch_shm_manager",
        "torch._inductor.compile_worker",
    )


def test_a_direct_child_is_a_worker_only_when_known() -> None:
    worker, other = ProcessKey(10, 150), ProcessKey(11, 150)
    assert direct_child_role(worker, {worker}) == "worker"
    assert direct_child_role(other, {worker}) == "descendant"
    assert direct_child_role(worker) == "descendant"
    # Same PID, another start: a reused PID, not the worker.
    assert direct_child_role(ProcessKey(10, 900), {worker}) == "descendant"
