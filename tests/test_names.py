"""A process named by what it runs (NOTE [process names]), never by its interpreter's path."""

from __future__ import annotations

from typing import Any

import pytest

from leakcheck.core.names import culprit, culprits, process_name, signal_name

PY = "/home/someone/projects/a-checkout/.venv/bin/python3.11"


@pytest.mark.parametrize(
    ("cmdline", "name"),
    [
        (f"{PY} train.py --lr 0.1", "train.py --lr 0.1"),
        (f"{PY} /srv/jobs/exp-7/train.py --lr 0.1", "train.py --lr 0.1"),
        (f"{PY} -u -W ignore -X dev train.py", "train.py"),
        (f"{PY} -m torch.distributed.run -v", "python -m torch.distributed.run -v"),
        (
            f"{PY} -m torch.distributed.run --standalone",
            "python -m torch.distributed.run --stand\u2026",
        ),
        (f"{PY} -mpytest -p no:cacheprovider", "python -m pytest -p no:cacheprovider"),
        (f"{PY} -c import time; time.sleep(60)", 'python -c "import time; time.sleep(60)"'),
        (f"{PY} -Bc import time; time.sleep(60)", 'python -c "import time; time.sleep(60)"'),
        ("sleep 60", "sleep 60"),
        ("/usr/bin/bash -c sleep 60 & wait", "bash -c sleep 60 & wait"),
        (f"{PY}", "python"),
        ("", "?"),
        (
            f"{PY} -B -c from multiprocessing.resource_tracker import main;main(7)",
            "resource tracker",
        ),
        (f"{PY} -c from multiprocessing.forkserver import main; main(8, 9)", "forkserver"),
        (
            f"{PY} -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, "
            "pipe_handle=7) --multiprocessing-fork",
            "spawn worker",
        ),
        ("/venv/lib/python3.11/site-packages/torch/bin/torch_shm_manager", "torch_shm_manager"),
        (
            f"{PY} /venv/lib/python3.11/site-packages/torch/_inductor/compile_worker/__main__.py",
            "inductor compile worker",
        ),
        (f"{PY} /srv/pkg/__main__.py --x", "pkg --x"),
    ],
)
def test_a_process_is_named_by_what_it_runs(cmdline: str, name: str) -> None:
    assert process_name(cmdline) == name


def test_a_name_is_cut_to_its_width_and_code_keeps_its_quote() -> None:
    code = f"{PY} -c " + "import os; " * 20
    assert process_name(code, width=30) == 'python -c "import os; import\u2026"'
    assert process_name(f"{PY} train.py " + "--flag " * 40, width=20) == "train.py --flag --f\u2026"
    # The lines of a `python -c` script are one line, as Python would read them.
    assert process_name(f"{PY} -c import os\n\nimport sys\n") == 'python -c "import os; import sys"'
    assert process_name("sleep\n60") == "sleep 60"


def test_workers_are_named_by_their_loader_where_known() -> None:
    fork = f"{PY} train.py --lr 0.1"
    spawn = f"{PY} -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"

    def worker(cmdline: str, **where: Any) -> str:
        return culprit("worker", 5, cmdline, **where)

    assert worker(fork, worker_id=3, loader="train.py:42") == "worker 3 of train.py:42 (PID 5)"
    assert worker(spawn, worker_id=3, loader="train.py:42") == "worker 3 of train.py:42 (PID 5)"
    assert worker(spawn, worker_id=3) == "spawn worker 3 (PID 5)"
    assert worker(spawn) == "spawn worker (PID 5)"
    assert worker(fork) == "worker of train.py (PID 5)"
    forkserver = f"{PY} -c from multiprocessing.forkserver import main; main(8, 9)"
    assert worker(forkserver, worker_id=0) == "forkserver worker 0 (PID 5)"


def test_a_culprit_is_its_rank_role_name_and_pid() -> None:
    assert culprit("orphan", 11, "sleep 60", rule="orphan") == "sleep 60 (PID 11)"
    assert culprit("orphan", 11, "sleep 60", rank=1) == "rank 1 orphan sleep 60 (PID 11)"
    assert (
        culprit("descendant", 5, f"{PY} -c import x") == 'descendant python -c "import x" (PID 5)'
    )
    assert culprit("worker", 7, f"{PY} train.py", worker_id=2, loader="train.py:9") == (
        "worker 2 of train.py:9 (PID 7)"
    )
    assert culprits("orphan", [11, 12, 13, 14], "sleep 60", rule="orphan") == (
        "4 \u00d7 sleep 60 (PIDs 11, 12, 13, \u2026)"
    )
    assert (
        culprits("orphan", [11, 12], "sleep 60", rule="orphan") == "2 \u00d7 sleep 60 (PIDs 11, 12)"
    )


def test_a_signal_is_named_by_python_or_by_its_number() -> None:
    assert signal_name(9) == "SIGKILL"
    assert signal_name(40) == "signal 40"  # a real-time signal between SIGRTMIN and SIGRTMAX
