"""The in-program half of ``leakcheck run``: each DataLoader iteration is an epoch of its loader.

NOTE [run instrumentation]: the shim (NOTE [run shim]) patches ``DataLoader.__iter__`` in
every Python process of the run; the first iteration imports this module. Each creation site
(``train.py:42``, ``hf_train.py:48 via transformers Trainer``) gets one ``Tracker``, so train
and validation loaders are judged apart; a loader made again where the previous one is gone
continues it, a second one alive at once is ``#2``. Each iteration is an epoch of it
(``epoch_batches``) through DataLoader's original ``__iter__``; a loader the program
``watch()``es, or its ``LeakCheckCallback`` adopted, is left to it: their reports are the
run's (``train.py:42 via watch()``, ``train_dataloader via LeakCheckCallback``), kept where
closed or collected before exit. The site's ``LoaderResult``
(``loader-<pid>-<n>.json`` in the run folder) is written when its tracker starts and with its
report at the process's exit (``atexit`` or a multiprocessing child's finalizers; not
``os._exit`` nor a fatal signal). A forked child starts afresh. Nothing here raises into the
program: a failure of its own turns tracking off for the process (one line on stderr,
``failure-<pid>.txt``).

NOTE [process rank]: ``RANK`` (torchrun, ``accelerate launch``), else the default process
group's rank, else the index ``torch.multiprocessing.spawn`` gave it, else the rank a process
above it exported (NOTE [exported rank] in ranks.py). A rank found here is exported.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from leakcheck.adapters.dataloader import (
    EpochJudge,
    epoch_batches,
    name_unwound,
    watched_tracker,
)
from leakcheck.core import ranks
from leakcheck.core.errors import LeakCheckError
from leakcheck.core.files import write_json
from leakcheck.core.model import MIB, EndReason, RankInfo
from leakcheck.core.records import record_from_dict, to_jsonable
from leakcheck.judge.report import Report, report_from_dict
from leakcheck.observe import procs
from leakcheck.track.tracker import Tracker, end_reason_for, own_rank_device
from leakcheck.worker.teardown import WorkerInit

RUN_ENV = "LEAKCHECK_RUN"
"""Names the run folder in the program's environment (NOTE [run tag] in launcher.py)."""
OPTIONS_FILE = "options.json"
"""The ``RunOptions`` the launcher wrote for the program's trackers, in the run folder."""


@dataclass(frozen=True)
class RunOptions:
    """How ``leakcheck run`` tracks the program, inside and out (``watch()``'s options)."""

    tolerance_bytes: int = 16 * MIB
    grace_s: float = 2.0
    interval_s: float = 0.05
    teardown: bool = False
    device_index: int | None = None
    rollup_share: float | None = None
    copy_tolerance_bytes: int = 64 * MIB
    hang_after_s: float = 120.0
    cwd: str = dataclasses.field(default_factory=os.getcwd)  # the launcher's: labels' base

    def tracker_options(self) -> dict[str, Any]:
        """What every ``Tracker`` of the run, inside or out, takes of these options."""
        return {
            "interval": self.interval_s,
            "tolerance": self.tolerance_bytes,
            "grace": self.grace_s,
            "devices": None if self.device_index is None else [self.device_index],
            "copy_tolerance": self.copy_tolerance_bytes,
        }


NO_EXIT = "its process ended without exit handlers (os._exit, exec, a signal) or outlived the run"


@dataclass(frozen=True)
class LoaderResult:
    """One loader of the run (``file:line via LIBRARY #2``): its report, else why ``missing``.

    Its process writes it (NOTE [run instrumentation]); ``leakcheck run`` shows it.
    """

    label: str
    pid: int
    argv: tuple[str, ...] = ()
    report: Report | None = None
    cost: Mapping[str, Any] | None = None
    exit_s: float | None = None
    missing: str | None = NO_EXIT
    rank: RankInfo | None = None
    index: int = 0
    started_unix_s: float = 0.0
    start_ticks: int | None = None  # NOTE [process identity] in procs.py
    mailbox: str | None = None
    torch: str | None = None  # the program's torch: the launcher never imports it

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        report = self.report.to_dict() if self.report is not None else None
        return {**to_jsonable(replace(self, report=None)), "report": report}


def read_loader(path: str) -> LoaderResult | None:
    """The loader record at ``path``; None where it cannot be read at all."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        loader: LoaderResult = record_from_dict(LoaderResult, {**data, "report": None})
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if data.get("report") is None:
        return loader
    try:
        return replace(loader, report=report_from_dict(data["report"]))
    except (LeakCheckError, KeyError, TypeError, ValueError) as error:
        return replace(loader, missing=f"its report cannot be read: {error}")


class _EpochIterator:
    """One epoch's batches and ``len()``; else the DataLoader iterator's (from its first batch)."""

    __slots__ = ("__dict__", "__weakref__", "_batches", "_loader", "_made")
    _OWN = frozenset(__slots__)

    def __init__(
        self, loader: Any, made: list[Iterator[Any]], batches: Generator[Any, None, Any]
    ) -> None:
        self._loader = loader
        self._made = made  # the DataLoader iterator, once made
        self._batches = batches

    def __setattr__(self, name: str, value: Any) -> None:
        # Writes go where reads come from: the DataLoader iterator once there is one.
        made = () if name in self._OWN else getattr(self, "_made", ())
        if made:
            setattr(made[0], name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._OWN:
            raise AttributeError(name)  # copy and pickle ask before any slot is set
        made = getattr(self, "_made", ())
        if not made:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} before its first "
                "batch (leakcheck run makes the loader's iterator then)"
            )
        return getattr(made[0], name)

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def __len__(self) -> int:
        return len(self._loader)

    def close(self) -> None:
        """End the epoch now, as leaving the loop would."""
        self._batches.close()


@dataclass
class _Site:
    """One creation site's tracker and record, and the loader instance it follows now."""

    record: LoaderResult  # its pid: a forked child's loaders carry its parent's site
    base: str  # the label without its " #2"
    where: Any  # the shim's creation site: (file, line, via, origin file, line)
    tracker: Tracker
    instance: weakref.ref[Any]
    live: weakref.WeakSet[_EpochIterator] = dataclasses.field(default_factory=weakref.WeakSet)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(None), ())  # a pickled or copied loader (spawn's arguments) is another


class _Run:
    """The loaders of one process of the run (NOTE [run instrumentation])."""

    def __init__(self, folder: str, options: RunOptions) -> None:
        self.folder = folder
        self.options = options
        self.pid = os.getpid()
        self.cwd = options.cwd  # not the program's now: it may have changed directory
        self.sites: list[_Site] = []
        self.left: list[tuple[Any, LoaderResult]] = []  # callbacks, watch()'s trackers; records
        self.indices = itertools.count()  # of the records, for their file names
        self.incarnation = time.time_ns()  # an exec keeps the PID: its records are others
        self.rank = process_rank()
        if self.rank is not None:
            ranks.export_rank(self.rank)
        self.lock = threading.RLock()
        self.ended = False
        atexit.register(self.at_exit)
        process = sys.modules.get("multiprocessing.process")
        if process is not None and process.parent_process() is not None:
            # A forked child ends with os._exit after its finalizers: atexit never runs.
            import multiprocessing.util

            multiprocessing.util.Finalize(None, self.at_exit, exitpriority=0)

    def site_for(self, loader: Any) -> _Site:
        site = loader.__dict__.get("_leakcheck_run_site")
        if isinstance(site, _Site) and site.record.pid == self.pid and not site.tracker.closed:
            return site
        where = loader.__dict__.get("_leakcheck_site")  # its label checks it
        with self.lock:
            free = (s for s in self.sites if s.where == where and s.instance() is None)
            site = next((s for s in free if not s.tracker.closed), None)
            site = site or self._new_site(loader, where)
            site.instance = weakref.ref(loader)
        loader.__dict__["_leakcheck_run_site"] = site
        return site

    def _new_site(self, loader: Any, where: Any) -> _Site:
        tracker = Tracker(
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            rollup_share=self.options.rollup_share,
            hang_after=self.options.hang_after_s,
            **self.options.tracker_options(),
        )
        _run_sessions.add(tracker.start().session_id)
        base = self.base_label(where)
        same = sum(1 for site in self.sites if site.base == base)
        label = base + (f" #{same + 1}" if same else "")
        record = self._record(label, mailbox=tracker.mailbox_dir)
        site = _Site(record, base, where, tracker, weakref.ref(loader))
        self.sites.append(site)
        self._write(record)
        return site

    def base_label(self, where: Any) -> str:
        """``train.py:42``, ``hf_train.py:48 via transformers Trainer``: where it was made."""
        if not (isinstance(where, tuple) and len(where) >= 2):
            where = ("<unknown>", 0)
        via = where[2] if len(where) > 2 and where[2] else ""
        return f"{shown_path(str(where[0]), self.cwd)}:{where[1]}" + (f" via {via}" if via else "")

    def _record(self, label: str, **fields: Any) -> LoaderResult:
        key = procs.process_key(self.pid)  # checked by the launcher: NOTE [process identity]
        return LoaderResult(
            label=label,
            pid=self.pid,
            argv=tuple(sys.argv),
            index=next(self.indices),
            started_unix_s=time.time(),
            start_ticks=key.start_ticks if key is not None else None,
            torch=getattr(sys.modules.get("torch"), "__version__", None),
            **fields,
        )

    def leave_to(self, owner: Any, label: str) -> None:
        """A ``LeakCheckCallback`` or ``watch()``'s tracker has a loader: its reports at exit."""
        with self.lock:
            if any(known is owner for known, _ in self.left):
                return
            same = sum(1 for _, known in self.left if known.label.partition(" #")[0] == label)
            record = self._record(label + (f" #{same + 1}" if same else ""))
            self.left.append((owner, record))
        self._write(record)  # a record without report, until exit

    def _write(self, record: LoaderResult, **final: Any) -> None:
        """Write a loader's record; at exit with its report."""
        rank = self.rank
        if rank is not None:  # with the device it chose (set_device), once known
            chosen = _quiet_value(own_rank_device)
            if chosen is not None and chosen[0] == rank.rank:
                rank = replace(rank, device=chosen[1])
        record = replace(record, rank=rank, **final)
        name = f"loader-{self.pid}-{self.incarnation}-{record.index}.json"
        write_json(os.path.join(self.folder, name), record.to_dict())

    def epoch_iterator(self, loader: Any, iterate: Callable[[Any], Iterator[Any]]) -> Any:
        site = self.site_for(loader)
        made: list[Iterator[Any]] = []  # not the epoch: a cycle would end a `break` "collected"

        def make() -> Iterator[Any]:
            made.append(iterate(loader))  # what the program may ask of its iterator
            return made[-1]

        judge = EpochJudge(site.tracker, "ignore", None)
        batches = epoch_batches(loader, make, judge, release=self.options.teardown)
        epoch = _EpochIterator(loader, made, batches)
        site.live.add(epoch)
        return epoch

    def at_exit(self) -> None:
        """Close every tracker and write its report (NOTE [run instrumentation]). Once."""
        if os.getpid() != self.pid or self.ended:
            return  # a forked child that exits through atexit; or ran already
        self.ended = True
        error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        reason: EndReason = "closed"
        line: str | None = None
        if isinstance(error, BaseException):
            reason, line = end_reason_for(error)
            name_unwound(error)  # the epoch it ended in the loop body (NOTE [epoch ends])
        with self.lock:
            sites, left = list(self.sites), list(self.left)
        for owner, record in left:  # closed or collected before: its reports are kept
            if isinstance(owner, Tracker):
                _quietly(owner.end_epoch, reason, line)
                _quietly(owner.close)
                _quietly(self._write_report, record, owner)
            else:
                _quietly(self._write_reports_of, owner, record)
        costs = [to_jsonable(site.tracker.cost()) for site in sites]
        for site in sites:
            _quietly(site.tracker.end_epoch, reason, line)
            for epoch in list(site.live):
                _quietly(epoch.close)
        for site, cost in zip(sites, costs, strict=True):
            started = time.perf_counter()
            _quietly(site.tracker.close)
            _quietly(self._write_report, site.record, site.tracker, started, cost)

    def _write_report(
        self, record: LoaderResult, tracker: Tracker, started: float | None = None, cost: Any = None
    ) -> None:
        """Write ``tracker``'s report in ``record``'s file (``started``: when its close began)."""
        report = tracker.report()
        exit_s = None if started is None else time.perf_counter() - started
        self._write(record, report=report, cost=cost, exit_s=exit_s, missing=None)

    def _write_reports_of(self, callback: Any, record: LoaderResult) -> None:
        """Each stage's report, the first in ``record``'s file (NOTE [run instrumentation])."""
        reports = callback.reports
        if not reports:
            self._write(record, missing="it tracked no epoch")
        for n, (name, report) in enumerate(reports.items()):
            label = f"{name}_dataloader via {record.label}"
            index = record.index if n == 0 else next(self.indices)
            self._write(record, label=label, index=index, report=report, missing=None)


def shown_path(path: str, cwd: str) -> str:
    """``path`` relative to ``cwd`` where inside it, else its folder and name."""
    if not os.path.isabs(path):
        return path
    relative = os.path.relpath(path, cwd)
    if relative != os.pardir and not relative.startswith(os.pardir + os.sep):
        return relative
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def process_rank() -> RankInfo | None:
    """The rank of the calling process in a distributed job (NOTE [process rank]), or None."""
    environ = {k: v for k, v in os.environ.items() if k != ranks.EXPORTED_RANK_ENV}
    launched = ranks.rank_from_environ(environ)
    if launched is not None:
        return launched
    index = _quiet_value(_spawn_index)
    group = _quiet_value(_group_rank)
    if group is None and index is None:
        return ranks.rank_from_environ(os.environ)  # exported by a process above it
    rank, world_size = group if group is not None else (index, None)
    return RankInfo(
        rank=rank,
        local_rank=index,
        world_size=world_size,
        device=None if index is None else ranks.physical_device(index, os.environ),
    )


def _spawn_index() -> int | None:
    """The index ``torch.multiprocessing`` gave this process, where it started it."""
    current = sys.modules["multiprocessing.process"].current_process()
    target = getattr(current, "_target", None)
    name = (getattr(target, "__module__", None), getattr(target, "__name__", None))
    if name != ("torch.multiprocessing.spawn", "_wrap"):
        return None
    args = getattr(current, "_args", ())
    index = args[1] if isinstance(args, tuple) and len(args) > 1 else None
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _group_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` of this process's default process group, once initialised."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _quietly(action: Callable[..., object], *args: Any) -> None:
    """Run ``action(*args)`` at exit: leakcheck's own failure is one line, never a traceback."""
    try:
        action(*args)
    except BaseException as error:  # a second Ctrl-C too: the other loaders still report
        sys.stderr.write(f"leakcheck run: at exit: {type(error).__name__}: {error}\n")


def _quiet_value(read: Callable[[], Any]) -> Any:
    """``read()``, or None where it failed (the record is written anyway)."""
    try:
        return read()
    except Exception:
        return None


_state_lock = threading.Lock()
_folder: str | None = None
_run: _Run | None = None
_disabled = False
_run_sessions: set[str] = set()
"""The run's trackers here and in the ancestors a fork copied: their hooks are not the user's."""


def _after_fork_in_child() -> None:
    # Only references change, and no lock of the parent's is taken (held at the fork?).
    global _state_lock, _run
    _state_lock = threading.Lock()
    _run = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def configure(folder: str) -> None:
    """Name the run folder (the shim, before the first iteration)."""
    global _folder
    _folder = folder


def _current_run() -> _Run | None:
    global _run
    with _state_lock:
        if _run is None and _folder is not None and os.path.isdir(_folder):
            options = RunOptions()  # a run folder the launcher did not make: the defaults
            path = os.path.join(_folder, OPTIONS_FILE)
            with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as handle:
                options = record_from_dict(RunOptions, json.load(handle))
            _run = _Run(_folder, options)
        return _run


def _watched_by_user(loader: Any) -> bool:
    """The program ``watch()``es it, or a ``LeakCheckCallback`` (its stage claims the workers).

    The run's own hooks do not count.
    """
    hook = getattr(loader, "__dict__", {}).get("_get_iterator")
    if type(hook).__module__.startswith("leakcheck."):  # by name: importing it imports Lightning
        return True
    init = getattr(loader, "worker_init_fn", None)
    if not isinstance(init, WorkerInit):
        return False
    return bool(init.session_id) and init.session_id not in _run_sessions


def epoch_iterator(loader: Any, iterate: Callable[[Any], Iterator[Any]]) -> Any:
    """The patched ``DataLoader.__iter__`` (``iterate``: the original): an epoch of its site.

    Where tracking is off (after a failure, no run folder, a loader the program watches):
    ``iterate(loader)``.
    """
    global _disabled
    if _disabled:
        return iterate(loader)
    try:
        run = _current_run()
        if run is None or os.getpid() != run.pid or run.ended:  # after its report: untracked
            return iterate(loader)
        if _watched_by_user(loader):
            callback = getattr(loader.__dict__.get("_get_iterator"), "callback", None)
            init = getattr(loader, "worker_init_fn", None)
            tracker = watched_tracker(getattr(init, "session_id", None))
            if callback is not None:
                run.leave_to(callback, type(callback).__name__)
            elif tracker is not None:
                where = loader.__dict__.get("_leakcheck_site")
                run.leave_to(tracker, f"{run.base_label(where)} via watch()")
            return iterate(loader)
        return run.epoch_iterator(loader, iterate)
    except Exception as error:
        _disabled = True
        text = f"leakcheck run: DataLoaders of PID {os.getpid()} are no longer tracked: "
        text += f"{type(error).__name__}: {error}\n"
        sys.stderr.write(text)
        if _folder is not None:
            path = os.path.join(_folder, f"failure-{os.getpid()}.txt")
            with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        return iterate(loader)
