"""What ``watch()`` and the Lightning callback share: arguments, the policy, epoch ends.

NOTE [judged window]: judging costs time in proportion to the epochs judged, and an adapter
judges at every epoch end, so that judgement looks at the latest ``JUDGED_EPOCHS`` closed
epochs only, as recorded at their ends (``benchmarks/bench_epochs.py`` measures both);
``close()`` judges the whole run with a fresh read. What only a longer view shows (growth
too slow to exceed the tolerance within the window) is announced at close.

NOTE [late survivors]: a survivor of epoch N can only be judged ``grace`` seconds after N
ended, so an adapter judges again at a later epoch's start once the grace has passed
(``EpochJudge.judge_if_due``, on a walk taken then), and at close, which waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

from leakcheck.core.errors import LeakError, LeakWarning, UsageError
from leakcheck.core.model import EndReason, EpochRecord, Finding
from leakcheck.track.tracker import Tracker
from leakcheck.worker.teardown import WorkerInit

__all__ = [
    "JUDGED_EPOCHS",
    "ON_LEAK",
    "EpochJudge",
    "OnLeak",
    "call_reported",
    "check_arguments",
    "install_policy",
    "note_deaths",
    "shutdown_workers",
]

OnLeak = Literal["warn", "raise", "ignore"]
ON_LEAK: tuple[OnLeak, ...] = ("warn", "raise", "ignore")

JUDGED_EPOCHS = 32
"""Closed epochs judged at each epoch end (NOTE [judged window])."""


def check_arguments(on_leak: object, teardown: object, on_epoch: object) -> OnLeak:
    """Validate what ``watch()`` and the callback take beside the ``Tracker``'s options.

    Raises:
        UsageError: A bad value; the message names the argument and the value.

    """
    choice = next((c for c in ON_LEAK if isinstance(on_leak, str) and on_leak == c), None)
    if choice is None:
        raise UsageError(f"on_leak: expected 'warn', 'raise' or 'ignore', got {on_leak!r}")
    if not isinstance(teardown, bool):
        raise UsageError(f"teardown: expected True or False, got {teardown!r}")
    if on_epoch is not None and not callable(on_epoch):
        raise UsageError(f"on_epoch: expected a callable taking an EpochRecord, got {on_epoch!r}")
    return choice


def install_policy(loader: Any, tracker: Tracker, *, release: bool) -> WorkerInit:
    """Chain the policy in front of ``loader.worker_init_fn`` (which still runs); returns it.

    Workers report their exact identity to ``tracker``'s mailbox and, at exit, what they
    held and freed (NOTE [teardown policy] in teardown.py, whose death signal follows the
    thread that starts them). Where the user installed the policy already
    (``leakcheck.worker_init_fn(...)``), their own function and ``terminate_children`` stay.
    """
    current = loader.worker_init_fn
    user_fn, terminate_children = current, False
    if isinstance(current, WorkerInit):
        user_fn, terminate_children = current.user_fn, current.terminate_children
    installed = WorkerInit(
        user_fn,
        terminate_children=terminate_children,
        release=release,
        persistent=bool(getattr(loader, "persistent_workers", False)),
        mailbox_dir=tracker.start().mailbox_dir,
        session_id=tracker.session_id,
    )
    installed.death_signal = threading.current_thread() is threading.main_thread()
    loader.worker_init_fn = installed
    return installed


def shutdown_workers(iterator: object) -> None:
    """Stop a DataLoader iterator's workers now (what its own ``__del__`` calls; idempotent)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        with contextlib.suppress(Exception):
            shutdown()


def call_reported(what: str, call: Callable[[], object], *, stacklevel: int = 1) -> None:
    """Run a user's callable (or a logger): what it raises is one ``RuntimeWarning``, no more."""
    try:
        call()
    except Exception as error:
        warnings.warn(
            f"leakcheck: {what} raised {type(error).__name__}: {error}; the loop goes on",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def _finding_id(finding: Finding) -> tuple[object, ...]:
    # Without the epoch: a process that grows every epoch is announced once. By identity
    # (NOTE [process identity] in procs.py).
    return (finding.rule, finding.pid, finding.start_ticks, finding.device_index)


def note_deaths(tracker: Tracker, iterator: object) -> bool:
    """Tell ``tracker`` which workers of a failed epoch's iterator a signal killed (True: some).

    Reading ``exitcode`` reaps a worker, as the iterator's shutdown would a moment later.
    """
    died = False
    try:
        for worker in list(getattr(iterator, "_workers", None) or ()):
            code, pid = getattr(worker, "exitcode", None), getattr(worker, "pid", None)
            if isinstance(code, int) and code < 0 and isinstance(pid, int):
                tracker.note_exit(pid, code)
                died = True
    except Exception:  # a private attribute of torch's: what it is not, says nothing
        return died
    return died


class EpochJudge:
    """Ends a tracker's epochs and announces each leak they show once: warn, raise or nothing.

    Args:
        on_leak: ``warn`` (``LeakWarning``), ``raise`` (``LeakError``) or ``ignore``.
        on_epoch: Called with each epoch's record as it ends (before it is judged).

    Attributes:
        count: Judge with ``on_leak="ignore"`` too, only to count the leaks.
        leaks_found: Leaks the latest judgement found (what a dashboard logs); None before.

    """

    def __init__(
        self,
        tracker: Tracker,
        on_leak: OnLeak,
        on_epoch: Callable[[EpochRecord], object] | None = None,
    ) -> None:
        self.tracker = tracker
        self.on_leak = on_leak
        self.on_epoch = on_epoch
        self.count = False
        self.leaks_found: int | None = None
        self._announced: set[tuple[object, ...]] = set()
        self._unjudged_end: float | None = None  # the last epoch end not judged for survivors

    def end_epoch(
        self, reason: EndReason, error: str | None, batches: int, index: int | None = None
    ) -> bool:
        """End the tracker's epoch (``index``: only that one); False where none was open."""
        self.tracker.batch_arrived()
        if not self.tracker.end_epoch(reason, error, batches, index=index):
            return False
        self._unjudged_end = time.monotonic()
        on_epoch, tracker = self.on_epoch, self.tracker
        if on_epoch is not None:

            def hand_over() -> None:  # leakcheck's own reads too: nothing escapes into the loop
                tracker.finish_reads()
                (record,) = tracker.timeline(last_epochs=1).epochs
                on_epoch(record)

            call_reported("on_epoch", hand_over)
        return True

    def due(self) -> bool:
        """An epoch's survivors were not judged yet, and now they can be (NOTE [late survivors])."""
        return self._unjudged_end is not None and (
            self.tracker.closed
            or time.monotonic() - self._unjudged_end >= self.tracker.config.grace_s
        )

    def judge_if_due(self, *, stacklevel: int = 1) -> None:
        """At an epoch's start: judge what the grace now lets be judged (NOTE [late survivors])."""
        if self.due():
            self.tracker.sample()
            self.judge(may_raise=True, stacklevel=stacklevel + 1)

    def judge(self, *, may_raise: bool, stacklevel: int = 1) -> None:
        """Announce leaks not announced before: warn, raise or nothing (``on_leak``).

        NOTE [judged window]. ``may_raise`` False warns instead of raising (an exception is
        on its way out already, and a leak must not replace it); ``stacklevel`` 1 points the
        warning at the caller's line.
        """
        if self.due():
            self._unjudged_end = None
        if self.on_leak == "ignore" and not self.count:
            return
        # A warning gives the figures the final report will (NOTE [host pacing]).
        self.tracker.finish_reads()
        window = None if self.tracker.closed else JUDGED_EPOCHS
        report = self.tracker.report(last_epochs=window, fresh=False)
        new = [f for f in report.leaks if _finding_id(f) not in self._announced]
        self._announced.update(_finding_id(f) for f in new)
        self.leaks_found = len(report.leaks)
        if not new or self.on_leak == "ignore":
            return
        epochs = report.epochs
        where = f" after {epochs[-1].label}" if epochs else ""
        message = f"leakcheck: {len(new)} leak(s){where}: " + "; ".join(f.message for f in new)
        if self.on_leak == "raise" and may_raise:
            raise LeakError(message, report)
        warnings.warn(LeakWarning(message), stacklevel=stacklevel + 1)
