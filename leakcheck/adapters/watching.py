"""What ``watch()`` and the Lightning callback share: options, the chained policy, judging.

NOTE [judged window]: judging costs time in proportion to the epochs judged, and an adapter
judges at every epoch end, so the epoch-end judgement looks at the latest ``JUDGED_EPOCHS``
closed epochs only, as recorded at their ends (``benchmarks/bench_epochs.py`` measures
both); ``close()`` judges the whole run with a fresh read. Every rule still works on the
window; what only a longer view shows (growth too slow to exceed the tolerance within it)
is announced at close.

NOTE [late survivors]: a survivor of epoch N can only be judged ``grace`` seconds after N
ended, so an adapter judges again at the start of a later epoch once the grace has passed
(``EpochJudge.judge_if_due``), on a walk taken then (a process must be seen alive after the
grace), and at close, the only place that waits for it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Literal

from leakcheck.core.errors import LeakError, LeakWarning, UsageError
from leakcheck.core.model import EpochRecord, Finding
from leakcheck.track.tracker import Tracker
from leakcheck.worker.teardown import WorkerInit

__all__ = [
    "JUDGED_EPOCHS",
    "ON_LEAK",
    "EpochJudge",
    "OnLeak",
    "call_reported",
    "chained_worker_init",
    "check_on_epoch",
    "check_on_leak",
    "check_teardown",
    "last_record",
    "note_deaths",
]

OnLeak = Literal["warn", "raise", "ignore"]
ON_LEAK: tuple[OnLeak, ...] = ("warn", "raise", "ignore")

JUDGED_EPOCHS = 32
"""Closed epochs judged at each epoch end (NOTE [judged window])."""


def check_on_leak(value: object) -> OnLeak:
    """Validate ``on_leak``.

    Raises:
        UsageError: Not one of ``warn``, ``raise``, ``ignore``; the message names the value.

    """
    for choice in ON_LEAK:
        if value == choice and isinstance(value, str):
            return choice
    raise UsageError(f"on_leak: expected 'warn', 'raise' or 'ignore', got {value!r}")


def check_teardown(value: object) -> bool:
    """Validate ``teardown`` (a bool, nothing that merely reads as one).

    Raises:
        UsageError: Not True or False; the message names the value.

    """
    if not isinstance(value, bool):
        raise UsageError(f"teardown: expected True or False, got {value!r}")
    return value


def check_on_epoch(
    value: Callable[[EpochRecord], object] | None,
) -> Callable[[EpochRecord], object] | None:
    """Validate ``on_epoch``: None or a callable.

    Raises:
        UsageError: Neither; the message names the value.

    """
    if value is not None and not callable(value):
        raise UsageError(f"on_epoch: expected a callable taking an EpochRecord, got {value!r}")
    return value


def last_record(tracker: Tracker) -> EpochRecord:
    """The tracker's latest closed epoch, as the report will show it."""
    tracker.finish_reads()
    (record,) = tracker.timeline(last_epochs=1).epochs
    return record


def chained_worker_init(
    current: Callable[[int], object] | None,
    *,
    tracker: Tracker,
    mailbox_dir: str | None,
    release: bool,
    persistent: bool,
) -> WorkerInit:
    """The policy chained in front of a loader's ``worker_init_fn`` (which still runs).

    Workers report their exact identity to ``tracker``'s mailbox and, at exit, what they
    held and freed (NOTE [teardown policy] in teardown.py). Where the user installed the
    policy already (``leakcheck.worker_init_fn(...)``), their own function and their
    ``terminate_children`` are kept.
    """
    user_fn = current
    terminate_children = False
    if isinstance(current, WorkerInit):
        terminate_children = current.terminate_children
        user_fn = current.user_fn
    return WorkerInit(
        user_fn,
        terminate_children=terminate_children,
        release=release,
        persistent=persistent,
        mailbox_dir=mailbox_dir,
        session_id=tracker.session_id,
    )


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

    Reading a worker's ``exitcode`` reaps it, as the iterator's shutdown would a moment later.
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
    """Announces each leak a tracker's epochs show once: a warning, an error, or nothing.

    Args:
        tracker: The tracker whose epochs are judged.
        on_leak: ``warn`` (``LeakWarning``), ``raise`` (``LeakError``) or ``ignore``.
        count: Judge with ``on_leak="ignore"`` too, only to count the leaks
            (``leaks_found``: what a dashboard logs).

    """

    def __init__(self, tracker: Tracker, on_leak: OnLeak, *, count: bool = False) -> None:
        self.tracker = tracker
        self.on_leak = on_leak
        self.count = count
        self.leaks_found: int | None = None
        """Leaks the latest judgement found (NOTE [judged window]); None until judged."""
        self._announced: set[tuple[object, ...]] = set()
        self._unjudged_end: float | None = None
        """Monotonic time of the last epoch end whose survivors were not judged yet."""

    def epoch_ended(self) -> None:
        """Record an epoch end: its survivors can be judged once the grace has passed."""
        self._unjudged_end = time.monotonic()

    def due(self) -> bool:
        """An epoch's survivors were not judged yet, and now they can be (NOTE [late survivors])."""
        return self._unjudged_end is not None and (
            self.tracker.closed
            or time.monotonic() - self._unjudged_end >= self.tracker.config.grace_s
        )

    def judge_if_due(self, *, stacklevel: int = 1) -> None:
        """At an epoch's start: judge what the grace now lets be judged (NOTE [late survivors]).

        Raises:
            LeakError: ``on_leak="raise"`` and a new leak was found.

        """
        if self.due():
            self.tracker.sample()
            self.judge(may_raise=True, stacklevel=stacklevel + 1)

    def judge(self, *, may_raise: bool, stacklevel: int = 1) -> None:
        """Announce leaks not announced before: warn, raise or nothing (``on_leak``).

        NOTE [judged window]: the latest epochs while the tracker is open, the whole run after.

        Args:
            may_raise: Raise with ``on_leak="raise"``; False warns instead (an exception is
                on its way out already, and a leak must not replace it).
            stacklevel: Where the warning points, from the caller (1: the caller's line).

        Raises:
            LeakError: ``on_leak="raise"``, ``may_raise``, and a new leak was found.

        """
        if self.due():
            self._unjudged_end = None
        if self.on_leak == "ignore" and not self.count:
            return
        # The USS reads the last epoch end planned are made first, so that a warning gives
        # the figures the final report will (NOTE [host pacing]); none planned, none made.
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
