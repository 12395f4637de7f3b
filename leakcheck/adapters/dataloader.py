"""``leakcheck.watch(loader)``, and the epoch ends it shares with Lightning and ``run``.

NOTE [epoch ends]: each ``iter()`` is one epoch, opened at the first batch request and closed
however the loop ends: ``completed`` (judged at once; a ``LeakError`` surfaces from the
``for``), ``break`` (after a DataLoader's last batch, as Lightning stops: ``completed``),
``exception`` (while fetching: re-raised, and a worker a signal ended is announced at once; or
in the loop body), ``interrupt`` (Ctrl-C) or ``collected`` (by the garbage collector or at
exit). A generator is only told it was closed: an exception unwinding the loop's frame is told
from a ``break`` by that frame's traceback entry at its current instruction (a referrer of the
frame). Python 3.11 keeps the exception itself out of reach until it is caught, so it is named
(its line; a ``KeyboardInterrupt``: ``interrupt``) where it shows up later: ``with`` or
``close()`` as it passes, or the uncaught one at exit (``name_unwound``).
After an early end non-persistent workers are shut down at once (the traceback would keep them
alive as false survivors); judging waits for the next epoch or ``close()``, as raising from a
closing generator would be lost. Per batch: one generator step and one clock read (NOTE [hang
watch] in hang.py).

NOTE [judged window]: an epoch end judges only the latest ``JUDGED_EPOCHS`` closed epochs, as
recorded at their ends (judging costs time per epoch: ``benchmarks/bench_epochs.py``);
``close()`` judges the whole run with a fresh read (growth too slow for the window, too).

NOTE [late survivors]: a survivor of epoch N is judged ``grace`` seconds after N ended, so an
adapter judges again at a later epoch's start once the grace passed (``judge_if_due``), and
at close, which waits for it.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import gc
import inspect
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from types import CodeType, FrameType, TracebackType
from typing import Any, Generic, Literal, TypeVar

from leakcheck.core.errors import LeakError, LeakWarning, UsageError, one_line
from leakcheck.core.model import EndReason, EpochRecord, Finding
from leakcheck.core.units import plural
from leakcheck.judge.report import Report
from leakcheck.track.hang import watch_exits
from leakcheck.track.tracker import Tracker, end_reason_for
from leakcheck.worker.teardown import WorkerInit

__all__ = [
    "JUDGED_EPOCHS", "EpochJudge", "OnLeak", "WatchedLoader", "epoch_batches", "name_unwound",
    "watch",
]

T = TypeVar("T")
OnLeak = Literal["warn", "raise", "ignore"]
OnEpoch = Callable[[EpochRecord], object]

JUDGED_EPOCHS = 32
"""Closed epochs judged at each epoch end (NOTE [judged window])."""

# True while the cyclic garbage collector runs: a generator closed then was collected,
# not left by its loop (NOTE [epoch ends]).
_collecting = False
_NO_BATCH = object()
# The started trackers of watch()'s wrappers, by session: ``leakcheck run`` takes their reports.
_watching: weakref.WeakValueDictionary[str, Tracker] = weakref.WeakValueDictionary()


def watched_tracker(session_id: str | None) -> Tracker | None:
    """The tracker of the ``watch()`` wrapper whose workers carry ``session_id``, if any."""
    return _watching.get(session_id) if session_id else None


def _gc_phase(phase: str, info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"


def _end_reason(error: BaseException) -> tuple[EndReason, str | None]:
    if isinstance(error, GeneratorExit):
        return ("collected" if _collecting or sys.is_finalizing() else "break"), None
    return end_reason_for(error)


# Instructions that drop a reference and cannot raise: a generator they close was left. And a
# generator's ``yield``: what unwinds there was thrown in, mostly its close (its consumer left).
_LEFT = frozenset(
    dis.opmap[name]
    for name in (
        "POP_TOP", "END_FOR", "POP_ITER", "STORE_FAST", "DELETE_FAST", "RETURN_VALUE",
        "YIELD_VALUE",
    )
    if name in dis.opmap
)
_CACHE = dis.opmap.get("CACHE", -1)

# Epochs an exception ended before it could be named, by its traceback entry in the loop's frame.
_unnamed: dict[tuple[int, int, CodeType], list[tuple[weakref.ref[Tracker], int]]] = {}


def _unwinding(frame: FrameType | None) -> TracebackType | None:
    """The traceback entry of an exception unwinding ``frame`` now, if any (NOTE [epoch ends])."""
    if frame is None:
        return None
    code, at = frame.f_code.co_code, frame.f_lasti
    while at > 0 and code[at] == _CACHE:  # 3.11: past a call, its inline cache
        at -= 2
    if at < 0 or code[at] in _LEFT:
        return None  # a break, del, a new value: no scan of the heap
    entries = (r for r in gc.get_referrers(frame) if isinstance(r, TracebackType))
    return next((t for t in entries if t.tb_frame is frame and t.tb_lasti == frame.f_lasti), None)


def _note_unnamed(key: tuple[int, int, CodeType], tracker: Tracker, index: int) -> None:
    """Keep epoch ``index`` to name; its tracker's earlier one goes: the program caught it."""
    for pending in _unnamed.values():
        pending[:] = [(ref, i) for ref, i in pending if ref() not in (None, tracker)]
    for stale in [k for k, pending in _unnamed.items() if not pending]:
        del _unnamed[stale]
    _unnamed.setdefault(key, []).append((weakref.ref(tracker), index))


def name_unwound(error: BaseException | None) -> None:
    """Name ``error`` as the end of the epochs it ended unnamed (NOTE [epoch ends])."""
    entry = getattr(error, "__traceback__", None)
    while entry is not None and error is not None:
        for tracker, index in _unnamed.pop((id(entry), entry.tb_lasti, entry.tb_frame.f_code), ()):
            found = tracker()
            if found is not None:
                found.name_end(index, *end_reason_for(error))
        entry = entry.tb_next


def _gave_all(iterator: Any, count: int) -> bool:
    """Whether ``count`` is every batch of a DataLoader iterator (its ``len()``)."""
    try:
        return count > 0 and count == len(iterator)
    except Exception:  # no len(): an iterable dataset, another iterable's iterator
        return False


def check_arguments(on_leak: object, teardown: object, on_epoch: object) -> OnLeak:
    """Validate what ``watch()`` and the callback take beside the ``Tracker``'s options."""
    if not isinstance(on_leak, str) or on_leak not in ("warn", "raise", "ignore"):
        raise UsageError(f"on_leak: expected 'warn', 'raise' or 'ignore', got {on_leak!r}")
    if not isinstance(teardown, bool):
        raise UsageError(f"teardown: expected True or False, got {teardown!r}")
    if on_epoch is not None and not callable(on_epoch):
        raise UsageError(f"on_epoch: expected a callable taking an EpochRecord, got {on_epoch!r}")
    return on_leak  # type: ignore[return-value]


def start_iterator(loader: Any, tracker: Tracker, make: Callable[[], Any], *, release: bool) -> Any:
    """Make a loader's iterator (its workers start now) under the policy; watch its exits.

    NOTE [iterator policy]: an iterator reads ``worker_init_fn`` once, as it starts the
    workers, so the policy is chained in front of the user's (still run) for that moment only
    (a generator ``__iter__``: until its first batch). The workers report their identity to
    ``tracker``'s mailbox and, at exit, what they held and freed (NOTE [teardown policy] in
    teardown.py). A user's ``leakcheck.worker_init_fn(...)`` keeps its function and
    ``terminate_children``. A wrapper of a wrapper leaves the workers to the inner one's
    tracker (NOTE [claims]); not a DataLoader: lineage only.
    """
    if not isinstance(loader, WatchedLoader):
        # accelerate's prepared loader reads its DataLoader's attributes through, sets its own.
        loader = getattr(loader, "base_dataloader", loader)
    users = getattr(loader, "worker_init_fn", None)
    if not hasattr(loader, "worker_init_fn") or isinstance(loader, WatchedLoader):
        iterator = make()
    else:
        user_fn, terminate_children = users, False
        if isinstance(users, WorkerInit):
            user_fn, terminate_children = users.user_fn, users.terminate_children
        installed = WorkerInit(
            user_fn,
            terminate_children=terminate_children,
            release=release,
            persistent=bool(getattr(loader, "persistent_workers", False)),
            mailbox_dir=tracker.mailbox_dir,  # started by the caller
            session_id=tracker.session_id,
        )
        installed.death_signal = threading.current_thread() is threading.main_thread()
        loader.worker_init_fn = installed

        def restore() -> None:
            if loader.worker_init_fn is installed:
                loader.worker_init_fn = users

        try:
            iterator = make()
        except BaseException:
            restore()
            raise
        if inspect.isgenerator(iterator):  # a generator __iter__ starts them at its first next()
            iterator = _restore_after_first(iterator, restore)
        else:
            restore()
    watch_exits(iterator, tracker.worker_stuck)  # NOTE [exit watch] in hang.py
    return iterator


def _restore_after_first(batches: Iterator[Any], restore: Callable[[], None]) -> Iterator[Any]:
    try:
        first = next(batches, _NO_BATCH)
    finally:
        restore()
    if first is not _NO_BATCH:
        yield first
        yield from batches


def shutdown_workers(iterator: object) -> None:
    """Stop a DataLoader iterator's workers now (what its own ``__del__`` calls; idempotent)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        with contextlib.suppress(Exception):
            shutdown()


def call_reported(what: str, call: Callable[[], object]) -> None:
    """Run a user's callable (or a logger): what it raises is one ``RuntimeWarning``, no more."""
    try:
        call()
    except Exception as error:
        warnings.warn(
            f"leakcheck: {what} raised {one_line(error)}; the loop goes on",
            RuntimeWarning,
            stacklevel=2,
        )


def _note_deaths(tracker: Tracker, iterator: object) -> bool:
    """Tell ``tracker`` which workers of a failed epoch a signal killed (True: some).

    Reading ``exitcode`` reaps a worker, as the iterator's shutdown would a moment later.
    """
    died = False
    with contextlib.suppress(Exception):  # torch's private attribute: what it is not says nothing
        for worker in list(getattr(iterator, "_workers", None) or ()):
            code, pid = getattr(worker, "exitcode", None), getattr(worker, "pid", None)
            if isinstance(code, int) and code < 0 and isinstance(pid, int):
                tracker.note_exit(pid, code)
                died = True
    return died


def _finding_id(finding: Finding) -> tuple[object, ...]:
    # Without the epoch: a process that grows every epoch is announced once. By identity
    # (NOTE [process identity] in procs.py).
    return (finding.rule, finding.pid, finding.start_ticks, finding.device_index)


class EpochJudge:
    """Ends a tracker's epochs and announces each leak they show once: warn, raise or nothing.

    ``count``: judge with ``on_leak="ignore"`` too, to count them in ``leaks_found`` (None
    before the first judgement).
    """

    def __init__(self, tracker: Tracker, on_leak: OnLeak, on_epoch: OnEpoch | None) -> None:
        self.tracker = tracker
        self.on_leak = on_leak
        self.on_epoch = on_epoch
        self.count = False
        self.leaks_found: int | None = None
        self._announced: set[tuple[object, ...]] = set()
        self._unjudged_end: float | None = None  # the last epoch end not judged for survivors

    def end_epoch(
        self, reason: EndReason, error: str | None, batches: int, index: int | None = None
    ) -> None:
        """End the tracker's epoch (``index``: only that one), and hand it to ``on_epoch``."""
        self.tracker.batch_arrived()
        if not self.tracker.end_epoch(reason, error, batches, index=index):
            return
        self._unjudged_end = time.monotonic()
        on_epoch, tracker = self.on_epoch, self.tracker
        if on_epoch is not None:

            def hand_over() -> None:  # leakcheck's own reads too: nothing escapes into the loop
                tracker.finish_reads()
                (record,) = tracker.timeline(last_epochs=1).epochs
                on_epoch(record)

            call_reported("on_epoch", hand_over)

    def _due(self) -> bool:
        return self._unjudged_end is not None and (
            self.tracker.closed
            or time.monotonic() - self._unjudged_end >= self.tracker.config.grace_s
        )

    def judge_if_due(self, *, stacklevel: int = 1) -> None:
        """At an epoch's start: judge what the grace now lets be judged (NOTE [late survivors])."""
        if self._due():
            self.tracker.sample()
            self.judge(may_raise=True, stacklevel=stacklevel + 1)

    def judge(self, *, may_raise: bool, stacklevel: int = 1) -> None:
        """Announce leaks not announced before (NOTE [judged window]).

        ``may_raise`` False warns instead (an exception on its way out must not be replaced).
        """
        if self._due():
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
        where = f" after {report.epochs[-1].label}" if report.epochs else ""
        lines = report.finding_lines(new, indent="  ")  # as the report says them, grouped
        message = "\n".join([f"leakcheck: {plural(len(new), 'leak')}{where}:", *lines])
        if self.on_leak == "raise" and may_raise:
            raise LeakError(message, report)
        warnings.warn(LeakWarning(message), stacklevel=stacklevel + 1)


def epoch_batches(
    loader: Any,
    make: Callable[[], Iterator[T]],
    judge: EpochJudge,
    *,
    release: bool,
    opened: Callable[[], object] | None = None,
    completed: Callable[[int, int], object] | None = None,
) -> Generator[T, None, None]:
    """One epoch of ``loader``: ``make()``'s batches (NOTE [epoch ends]).

    ``opened()`` runs at the first batch request, ``completed(index, batches)`` after an
    exhausted loop. ``watch()`` and ``leakcheck run`` (NOTE [run instrumentation]) iterate it.
    """
    if opened is not None:
        opened()
    if _gc_phase not in gc.callbacks:
        gc.callbacks.append(_gc_phase)
    tracker = judge.tracker
    index = tracker.begin_epoch()
    batches: Any = None
    count = 0
    ended: tuple[EndReason, str | None] = ("completed", None)
    died = False
    try:
        batches = start_iterator(loader, tracker, make, release=release)
        tracker.batch_wanted()  # the hang watch counts only the loop's waits (NOTE [hang watch])
        for batch in batches:
            count += 1
            tracker.batch_arrived()
            yield batch
            tracker.batch_wanted()
    except BaseException as error:
        tracker.batch_arrived()
        ended = _end_reason(error)
        if ended[0] == "break" and _gave_all(batches, count):
            ended = ("completed", None)  # the loop stopped at the last batch (Lightning does)
        elif ended[0] == "break" and (unwound := _unwinding(sys._getframe().f_back)):
            ended = ("exception", None)  # named later (name_unwound)
            key = (id(unwound), unwound.tb_lasti, unwound.tb_frame.f_code)
            _note_unnamed(key, tracker, index)
            del unwound  # it holds the loop's frame
        # A Ctrl-C reaches the workers too (SIGINT): not a death to report.
        if not isinstance(error, (KeyboardInterrupt, GeneratorExit)):
            died = _note_deaths(tracker, batches)
        if not getattr(loader, "persistent_workers", False):
            shutdown_workers(batches)
        raise
    finally:
        batches = None
        # Only this epoch: a kept iterator (a peek at the first batch) dropped later must not
        # end the epoch open then.
        judge.end_epoch(*ended, count, index)
        if died:  # said now, beside the DataLoader's own error, which goes on its way
            judge.judge(may_raise=False, stacklevel=2)
    if completed is not None:
        completed(index, count)


def _collected(tracker: Tracker) -> None:
    """The wrapper was collected without ``close()``: stop its tracker."""
    name_unwound(getattr(sys, "last_value", None))  # at exit: the program's uncaught error
    tracker.end_epoch("collected")
    tracker.close()


class WatchedLoader(Generic[T]):
    """An iterable that behaves like the wrapped loader; each ``iter()`` is one epoch.

    Build it with :func:`watch`; ``len()`` and every attribute of the loader behave as on it.
    """

    def __init__(
        self,
        loader: Iterable[T],
        *,
        tracker: Tracker,
        on_leak: OnLeak,
        teardown: bool,
        on_epoch: OnEpoch | None = None,
    ) -> None:
        self._loader = loader
        self._tracker = tracker
        self._judge = EpochJudge(tracker, check_arguments(on_leak, teardown, on_epoch), on_epoch)
        self._teardown = teardown
        self._closed = self._dropped = self._batches_seen = False
        self._finalizer = weakref.finalize(self, _collected, tracker)

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Names the wrapper lacks; before __init__ ran (copy, pickle) it would recurse.
        if name.startswith("__") or "_loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __repr__(self) -> str:
        return f"leakcheck.watch({self._loader!r})"

    def __iter__(self) -> Iterator[T]:
        if self._tracker.closed and not self._closed:
            return iter(self._loader)  # `leakcheck run` closed it at exit: the program goes on
        return epoch_batches(
            self._loader,
            functools.partial(iter, self._loader),
            self._judge,
            release=self._teardown,
            opened=self._opened,
            completed=self._completed,
        )

    @property
    def tracker(self) -> Tracker:
        """The :class:`~leakcheck.track.tracker.Tracker` behind the wrapper."""
        return self._tracker

    @property
    def loader(self) -> Iterable[T]:
        """The wrapped loader."""
        return self._loader

    def report(self) -> Report:
        """Judge what was observed so far (before ``close()``, with a fresh read)."""
        return self._tracker.report()

    def close(self) -> None:
        """Close the open epoch, wait out the grace, and judge the whole run. Idempotent.

        Raises:
            LeakError: ``on_leak="raise"`` and a leak not raised before was found.

        """
        self._close(may_raise=True)

    def drop_loader(self) -> None:
        """Let go of the loader, so that its persistent workers stop while tracked.

        Call it before ``close()`` and ``gc.collect()`` (``leakcheck sweep``).
        """
        self._tracker.finish_reads()
        self._loader = ()  # an empty stand-in: the wrapper keeps nothing alive
        self._dropped = True

    def __enter__(self) -> WatchedLoader[T]:
        self._start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # With an exception on its way out, a leak is warned about instead of replacing it.
        self._close(may_raise=exc is None, error=exc)

    def _close(self, *, may_raise: bool, error: BaseException | None = None) -> None:
        name_unwound(error or sys.exc_info()[1])  # in a finally, the error on its way out
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            self._tracker.close()
            self._judge.judge(may_raise=may_raise, stacklevel=3)

    def _start(self) -> None:
        if self._closed:
            raise UsageError("this watched loader is closed; wrap the loader again")
        _watching[self._tracker.start().session_id] = self._tracker

    def _opened(self) -> None:
        if self._dropped:
            raise UsageError("this watched loader let go of its loader; wrap the loader again")
        self._start()
        self._judge.judge_if_due(stacklevel=3)

    def _completed(self, index: int, count: int) -> None:
        if count == 0 and self._batches_seen:
            warnings.warn(
                f"leakcheck: epoch {index} of the watched loader yielded no "
                "batches, where earlier epochs did: the wrapped iterable is exhausted (a "
                "generator or iterator can be iterated once); wrap a loader that can be "
                "iterated again, such as a DataLoader",
                UserWarning,
                stacklevel=3,
            )
        self._batches_seen = self._batches_seen or count > 0
        self._judge.judge(may_raise=True, stacklevel=3)


def watch(
    loader: Iterable[T],
    *,
    tolerance: str | int = "16MiB",
    warmup_epochs: int = 1,
    grace: float | str = 2.0,
    on_leak: OnLeak = "warn",
    teardown: bool = True,
    interval: float | str = 0.05,
    rollup_share: float | None = None,
    copy_tolerance: str | int = "64MiB",
    on_epoch: OnEpoch | None = None,
    hang_after: float | str = 120.0,
) -> WatchedLoader[T]:
    """Wrap a DataLoader so that each epoch reports which process held how much GPU memory.

    ::

        loader = leakcheck.watch(DataLoader(ds, num_workers=8, persistent_workers=True))
        for epoch in range(10):
            for batch in loader:
                train_step(batch)
        loader.close()  # waits out the grace period, warns about the last epoch
        print(loader.report().format())

    Worker identities come from a chained ``worker_init_fn`` (yours still runs), which also
    installs the teardown policy (NOTE [iterator policy]). NOTE [epoch ends].

    Args:
        loader: A ``torch.utils.data.DataLoader`` (any start method, persistent workers or
            not); any other iterable is tracked by epochs and process lineage only.
        tolerance: Growth below this per epoch is noise (``"16MiB"``, or bytes).
        warmup_epochs: Epochs the growth rule ignores (allocator warm-up).
        grace: Seconds a worker may outlive its epoch before it is a survivor.
        on_leak: ``"warn"`` (a ``LeakWarning``), ``"raise"`` (a ``LeakError`` after the
            epoch) or ``"ignore"`` (only the report).
        teardown: Workers release their CUDA resources before they exit.
        interval: Seconds between background samples.
        rollup_share: Share of the time USS reads (copy-on-read) may take; 1.0: every end.
        copy_tolerance: What each forked worker may copy of the parent's memory.
        on_epoch: Called with each ``EpochRecord`` as it ends; what it raises is warned about.
        hang_after: Seconds an epoch may wait for a batch before the stacks of the loop and
            its workers are written (NOTE [hang watch] in hang.py); 0: no hang watch.

    Returns:
        A :class:`WatchedLoader`; also a context manager that calls ``close()``.

    Raises:
        UsageError: A bad argument; the message names it and what was expected.

    """
    check_arguments(on_leak, teardown, on_epoch)
    if not isinstance(loader, Iterable):
        raise UsageError(f"loader: expected an iterable such as a DataLoader, got {loader!r}")
    tracker = Tracker(
        interval=interval,
        rollup_share=rollup_share,
        tolerance=tolerance,
        warmup_epochs=warmup_epochs,
        grace=grace,
        persistent_workers=bool(getattr(loader, "persistent_workers", False)),
        copy_tolerance=copy_tolerance,
        hang_after=hang_after,
    )
    return WatchedLoader(
        loader, tracker=tracker, on_leak=on_leak, teardown=teardown, on_epoch=on_epoch
    )
