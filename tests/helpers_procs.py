"""Helper processes for tests/test_procs.py: real process trees that clean up after themselves.

Run as a script (stdlib only, so ``python -I -S`` starts fast)::

    python helpers_procs.py tree [--sleepers N] [--thread-sleepers N] [--subtrees N]
                                 [--subtree-sleepers N]
    python helpers_procs.py reaper      # subreaper -> root -> middle -> orphan
    python helpers_procs.py churn       # short-lived children, continuously

Each mode prints one JSON line describing its processes, then serves until its stdin
reaches EOF (the test closes it), then terminates and *reaps* every process it started, so
no test leaves a zombie behind. SIGTERM does the same.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.abspath(__file__)
PYTHON = [sys.executable, "-I", "-S"]
SLEEP = ["sleep", "60"]
PR_SET_CHILD_SUBREAPER = 36


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _wait_stdin_eof() -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdin.buffer.read()


def _wait_exec(pid: int, argv0: bytes, timeout_s: float = 30.0) -> None:
    """Wait until /proc shows the new program's command line (exec is complete)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if handle.read().split(b"\0")[0] == argv0:
                    return
        except OSError:
            return
        time.sleep(0.001)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait()


def tree(args: argparse.Namespace) -> None:
    """Sleepers from the main thread, sleepers from a live non-main thread, subtrees."""
    sleepers: list[subprocess.Popen[bytes]] = []
    thread_sleepers: list[subprocess.Popen[bytes]] = []
    subtrees: list[subprocess.Popen[bytes]] = []
    started = threading.Event()
    release = threading.Event()
    thread_ids: list[int] = []

    def spawn_from_thread() -> None:
        # The thread must stay alive: children of an exited thread move to another thread.
        thread_ids.append(threading.get_native_id())
        for _ in range(args.thread_sleepers):
            thread_sleepers.append(subprocess.Popen(SLEEP))
        started.set()
        release.wait()

    thread = threading.Thread(target=spawn_from_thread, daemon=True)
    try:
        for _ in range(args.sleepers):
            sleepers.append(subprocess.Popen(SLEEP))
        thread.start()
        started.wait()
        records = []
        for _ in range(args.subtrees):
            sub = subprocess.Popen(
                [*PYTHON, HERE, "tree", "--sleepers", str(args.subtree_sleepers)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            subtrees.append(sub)
            assert sub.stdout is not None
            records.append(json.loads(sub.stdout.readline()))
        for proc in sleepers + thread_sleepers:
            _wait_exec(proc.pid, SLEEP[0].encode())
        _emit(
            {
                "pid": os.getpid(),
                "sleepers": [p.pid for p in sleepers],
                "thread_sleepers": [p.pid for p in thread_sleepers],
                "thread_id": thread_ids[0],
                "subtrees": records,
            }
        )
        _wait_stdin_eof()
    finally:
        for sub in subtrees:
            assert sub.stdin is not None
            sub.stdin.close()
        _stop(sleepers + thread_sleepers)
        for sub in subtrees:
            sub.wait()
        release.set()


def orphan_root(args: argparse.Namespace) -> None:
    """Root -> middle (sh) -> orphan (sleep); on "release" the middle exits."""
    middle = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; read x"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert middle.stdout is not None and middle.stdin is not None
        orphan = int(middle.stdout.readline())
        _wait_exec(orphan, b"sleep")  # `$!` is known before the child's exec completes
        _emit({"pid": os.getpid(), "middle": middle.pid, "orphan": orphan})
        for line in sys.stdin:
            if line.strip() == "release":
                middle.stdin.close()
                middle.wait()
                _emit({"released": True})
    finally:
        if middle.stdin is not None and not middle.stdin.closed:
            middle.stdin.close()
        middle.wait()


def reaper(args: argparse.Namespace) -> None:
    """A subreaper above a root whose grandchild gets orphaned; it reaps the orphan."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    root = subprocess.Popen(
        [*PYTHON, HERE, "orphan-root"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    orphan = None
    try:
        assert root.stdout is not None and root.stdin is not None
        record = json.loads(root.stdout.readline())
        orphan = record["orphan"]
        _emit(
            {
                "reaper": os.getpid(),
                "root": record["pid"],
                "middle": record["middle"],
                "orphan": orphan,
            }
        )
        for line in sys.stdin:  # forward commands to the root, answers back
            root.stdin.write(line.encode())
            root.stdin.flush()
            _emit(json.loads(root.stdout.readline()))
    finally:
        if root.stdin is not None:
            root.stdin.close()
        root.wait()
        if orphan is not None:
            # The orphan is our child once the middle exited; before that, the middle
            # (which exits when the root closes its stdin) was its parent.
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGTERM)
        while True:  # reap the orphan and anything else that was reparented to us
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break


def churn(args: argparse.Namespace) -> None:
    """One long sleeper plus a stream of short-lived children (some briefly zombies)."""
    sleeper = subprocess.Popen(SLEEP)
    stop = threading.Event()
    spawned = 0

    def watch_stdin() -> None:
        _wait_stdin_eof()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    in_flight: list[subprocess.Popen[bytes]] = []
    try:
        _emit({"pid": os.getpid(), "sleeper": sleeper.pid})
        while not stop.is_set():
            in_flight.append(subprocess.Popen(["true"]))
            spawned += 1
            if len(in_flight) > 8:
                in_flight.pop(0).wait()
            time.sleep(0.001)
    finally:
        for proc in in_flight:
            proc.wait()
        _stop([sleeper])
        _emit({"spawned": spawned})


def main() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    tree_parser = sub.add_parser("tree")
    tree_parser.add_argument("--sleepers", type=int, default=0)
    tree_parser.add_argument("--thread-sleepers", type=int, default=0)
    tree_parser.add_argument("--subtrees", type=int, default=0)
    tree_parser.add_argument("--subtree-sleepers", type=int, default=0)
    sub.add_parser("orphan-root")
    sub.add_parser("reaper")
    sub.add_parser("churn")
    args = parser.parse_args()
    {"tree": tree, "orphan-root": orphan_root, "reaper": reaper, "churn": churn}[args.mode](args)


if __name__ == "__main__":
    main()
