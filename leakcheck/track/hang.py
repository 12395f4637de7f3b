"""The hang watch: when no batch comes for ``hang_after`` seconds, the stacks of the job.

NOTE [hang watch]: a loop stuck in its DataLoader (a worker blocked in ``__getitem__``, a
deadlock after fork, a full queue) shows nothing. The adapter tells the tracker when the loop
asks for a batch (``Tracker.batch_wanted``) and when it got one (``batch_arrived``): one clock
read each; only the wait in between counts. Each tick checks whether an open epoch's loop has
waited ``hang_after_s``; once per stall, the Python stacks of the loop's process (where the
tracker runs) and of each worker that registered the stack signal (NOTE [worker mailbox]: sent
``mailbox.STACK_SIGNAL`` once its identity is checked, its faulthandler writes them to its
file) go to stderr and the report (``Stall``). The loop goes on; a batch ends the stall.

NOTE [exit watch]: a DataLoader iterator's shutdown joins each worker for torch's
``MP_STATUS_CHECK_INTERVAL`` (5 s), then terminates those still alive without a word.
``watch_exits`` gives each worker an instance-level ``terminate`` that first has the tracker
gather that worker's stacks as above (a ``Stall`` with its ``pid``), where a ``join`` with a
timeout (also wrapped) ran its course before: a shutdown cut short before its joins (Ctrl-C
as workers start) terminates them at once, no hang. A worker keeps its stack signal through
every exit step (its finalizers, its queues' flushes, its children's joins) and ignores it
after the last: one that ignores it, or is gone, has only to end, slow on a loaded machine,
not stuck: no stall. Nor one a Ctrl-C reached (its teardown record says so): it left its loop
with batches queued to a parent that no longer reads them, and its exit waits to send them;
nor where a ``KeyboardInterrupt`` is being handled (the join may have been cut short). The
``shutdown-hang`` rule also leaves out the epochs a Ctrl-C ended (NOTE [epoch ends] in
adapters/dataloader.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from leakcheck.core.model import ProcessKey, Stall
from leakcheck.observe import mailbox, procs

__all__ = ["HangWatch", "gather_stall", "own_stacks", "watch_exits"]

# How long the workers' faulthandlers may take to write: as soon as they run, which on a
# loaded machine can be seconds after the signal; only a worker that cannot run waits it out.
_DUMP_WAIT_S = 10.0


def own_stacks() -> str:
    """Every thread of this process but the calling one (leakcheck's), the main one first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me, main = threading.get_ident(), threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    return "\n\n".join(
        f"Thread {names.get(ident, '?')!r} (most recent call last):\n"
        + "".join(traceback.format_stack(frame)).rstrip()
        for ident, frame in frames
        if ident != me
    )


_STILL_S = 0.25  # how long a worker's stack file stays the same size before it is read


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


class HangWatch:
    """Notices a stalled epoch, once per stall (NOTE [hang watch]); ``hang_after_s`` 0: never."""

    def __init__(self, hang_after_s: float) -> None:
        self.hang_after_s = hang_after_s
        # Monotonic time the loop asked for the batch it waits for; None: not waiting.
        self.waiting_since_s: float | None = None
        self._reported: float | None = None

    def due(self) -> float | None:
        """Seconds the loop has waited for its batch, where that is a new stall."""
        since = self.waiting_since_s
        if not self.hang_after_s or since is None:
            return None
        waited = time.monotonic() - since
        if waited < self.hang_after_s or self._reported == since:
            return None
        self._reported = since
        return waited


def gather_stall(
    workers: list[ProcessKey],
    folder: str | None,
    *,
    epoch: int | None,
    waited_s: float,
    at_s: float,
    pid: int | None = None,
    loop: bool = False,
) -> Stall | None:
    """The stacks, written to stderr too (no lock held), as a stall to keep (None: none).

    ``pid``: the worker a shutdown is about to terminate (NOTE [exit watch]); else the loop
    waited (NOTE [hang watch]), in this process where ``loop``.
    """
    parts = worker_stacks(workers, folder)
    if pid is not None:
        if workers and not parts:
            return None  # past its last exit step (NOTE [exit watch])
        what = f"DataLoader worker PID {pid} did not exit within {waited_s:.0f} s"
        parts = parts or [f"--- worker PID {pid} ---\n(no stack signal)"]
    else:
        where = f" in epoch {epoch}" if epoch is not None else ""
        what = f"no batch for {waited_s:.0f} s{where}; the stacks of the job"
        if loop:  # after the workers': a report shows the first rows only
            parts.append(f"--- the loop's process (PID {os.getpid()}) ---\n{own_stacks()}")
    stall = Stall(epoch=epoch, waited_s=waited_s, at_s=at_s, stacks="\n\n".join(parts), pid=pid)
    with contextlib.suppress(OSError, ValueError):  # a closed stderr stops nothing
        sys.stderr.write(f"leakcheck: {what}:\n{stall.stacks}\n")
        sys.stderr.flush()
    return stall


def worker_stacks(workers: list[ProcessKey], folder: str | None) -> list[str]:
    """Each worker's stacks, ``--- worker PID n ---`` first, sent the stack signal.

    A worker that ignores the signal or ends meanwhile is left out (NOTE [exit watch]).
    """
    pending: list[ProcessKey] = []
    for key in workers if folder else []:
        if _takes_stack_signal(key):
            with contextlib.suppress(OSError):
                os.kill(key.pid, mailbox.STACK_SIGNAL)
                pending.append(key)
    parts: list[str] = []
    deadline = time.monotonic() + _DUMP_WAIT_S
    grown: dict[ProcessKey, tuple[int, float]] = {}  # size, and since when
    while pending and folder:
        for key in list(pending):
            # Read once written and still for _STILL_S: faulthandler writes a frame at a
            # time, and a read in between would keep part of a dump.
            size, now = _size(mailbox.stack_path(folder, key)), time.monotonic()
            if grown.get(key, (-1, 0.0))[0] != size:
                grown[key] = (size, now)
            elif size and now - grown[key][1] >= _STILL_S:
                text = mailbox.read_stack(folder, key)
                if text is not None:
                    parts.append(f"--- worker PID {key.pid} ---\n{text}")
                    pending.remove(key)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    pending = [key for key in pending if _takes_stack_signal(key)]
    return parts + [f"--- worker PID {key.pid} ---\n(no stack written)" for key in pending]


def _takes_stack_signal(key: ProcessKey) -> bool:
    """Whether ``key`` is still that worker (not a reused PID) and not past its last exit step."""
    return procs.process_key(key.pid) == key and not procs.ignores_signal(
        key.pid, mailbox.STACK_SIGNAL
    )


def watch_exits(iterator: object, on_stuck: Callable[[int, float], object]) -> None:
    """``on_stuck(pid, joined_s)`` before a shutdown ends a joined worker (NOTE [exit watch])."""
    with contextlib.suppress(Exception):  # an odd iterator is left alone, never raised into
        for worker in list(getattr(iterator, "_workers", None) or ()):
            if "terminate" not in vars(worker):
                ref = weakref.ref(worker)
                worker.join = functools.partial(_join, ref)
                worker.terminate = functools.partial(_terminate, ref, on_stuck)


def _join(ref: weakref.ref[Any], timeout: float | None = None) -> None:
    worker = ref()
    if worker is not None:
        type(worker).join(worker, timeout)
        if timeout is not None:  # waited it out, unless the worker ended: not cut short
            vars(worker)["leakcheck_joined_s"] = timeout


def _interrupted(error: BaseException | None) -> bool:
    """A Ctrl-C on its way out: the workers took it too, and its join may not have waited."""
    while error is not None and not isinstance(error, KeyboardInterrupt):
        error = error.__context__
    return error is not None


def _terminate(ref: weakref.ref[Any], on_stuck: Callable[[int, float], object]) -> None:
    worker = ref()
    if worker is None:
        return
    with contextlib.suppress(Exception):  # leakcheck's own failure never stops a shutdown
        joined_s = vars(worker).get("leakcheck_joined_s")
        if joined_s is not None and worker.is_alive() and not _interrupted(sys.exc_info()[1]):
            on_stuck(worker.pid, joined_s)
    type(worker).terminate(worker)
