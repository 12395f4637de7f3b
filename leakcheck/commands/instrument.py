"""The in-program half of ``leakcheck run``: each DataLoader iteration is an epoch of its loader.

NOTE [run instrumentation]: the startup shim (``leakcheck/commands/_shim/sitecustomize.py``, NOTE
[run shim]) patches ``DataLoader.__iter__`` in every Python process of the run once the
program imports torch's dataloader module; the first iteration imports this module, and
from then on:

* a loader is known by where the program made it (recorded by the patched ``__init__``):
  labelled by the user's own line, with the library that made the loader for it
  (``train.py:42``, ``hf_train.py:48 via transformers Trainer``; a path relative to the
  working directory where inside it, else its folder and name); each creation site gets
  one ``Tracker`` of its own, started at its first iteration, so a train and a validation
  loader are judged apart (NOTE [claims] in track/claims.py). A loader made again at the
  same site once the previous one is gone (one new loader per epoch) continues that site's
  tracker; two loaders of one label alive together (a helper function that makes both) get
  one tracker each, the second labelled ``file:line #2``;
* a process that is a rank of a distributed job records its rank (NOTE [process rank]);
* each iteration is wrapped by a new ``WatchedLoader`` over the shared tracker (never
  closed by the wrapper), iterating through DataLoader's original ``__iter__``: epochs
  begin and end exactly as under ``watch()`` (NOTE [epoch ends] in dataloader.py), worker
  identities come from the chained ``worker_init_fn``, the teardown policy runs when the
  run asked for it, and no leak is warned about or raised: the report comes at exit. The
  wrapper lives as long as the epoch's iterator, so nothing keeps a loader alive;
* a loader the program already wraps with ``leakcheck.watch()`` is left to that wrapper;
* at the process's exit (``atexit``: a normal end, ``sys.exit``, an unhandled exception or
  ``KeyboardInterrupt``; in a multiprocessing child also its exit finalizers, which run
  before the ``os._exit`` that ends a forked one; not a bare ``os._exit`` nor a fatal
  signal) an epoch still open is ended
  with how the program ended, its iterator is closed (which stops non-persistent workers),
  every tracker is closed (each waits at most ``grace`` for the processes of its last epoch)
  and its report is written, with the loader's label, the process and what tracking cost,
  as ``loader-<pid>-<n>.json`` into the run folder. A ``.started`` file, written when a
  site's tracker starts, lets the launcher name a loader whose report never came.

A forked child starts afresh (``os.register_at_fork``): its parent's trackers, their
threads and their reports are the parent's; the child's loaders, its parent's included,
get trackers of its own at their first iteration in it. The reset only drops references,
so a DataLoader's forked worker, which runs it too, pays next to nothing.

NOTE [process rank]: a process's rank is ``RANK`` (torchrun, ``accelerate launch``), else
its own process group's rank (``torch.distributed``, initialised by the time it iterates a
loader in a DDP job), else its index among the processes ``torch.multiprocessing.spawn`` or
``start_processes`` started (torch runs each one's function through its ``_wrap(fn, i,
...)``, the ``target`` of its ``multiprocessing`` process), else the rank a process above
it exported (NOTE [exported rank] in ranks.py). A rank found here is exported in turn. The
spawn index is the local rank.

Nothing here raises into the program: a failure of leakcheck's own turns tracking off for
the rest of the process (one line on standard error) and the loaders work as without it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from leakcheck.adapters.dataloader import WatchedLoader
from leakcheck.core import ranks
from leakcheck.core.errors import UsageError
from leakcheck.core.model import MIB, EndReason, RankInfo, TrackerCost
from leakcheck.core.options import parse_share_option
from leakcheck.observe import procs
from leakcheck.track.tracker import Tracker, end_reason_for, own_rank_device
from leakcheck.worker.teardown import WorkerInit

__all__ = [
    "OPTIONS_FILE",
    "RECORD_SCHEMA",
    "RUN_ENV",
    "LoaderRecords",
    "ShimOptions",
    "configure",
    "epoch_iterator",
    "process_rank",
    "read_records",
    "shown_path",
    "write_options",
]

RUN_ENV = "LEAKCHECK_RUN"
"""Names the run folder in the program's environment (NOTE [run tag] in launcher.py)."""

OPTIONS_FILE = "options.json"
RECORD_SCHEMA = "leakcheck.run.loader"
RECORD_SCHEMA_VERSION = 3
"""2 added ``rank``: the process's ``RankInfo`` in a torchrun job (None otherwise); 3 names
the process by ``start_ticks`` where ``create_time`` was (NOTE [process identity] in
procs.py), and added ``via`` (the library that made the loader) and ranks of spawned
processes (NOTE [process rank])."""


@dataclass(frozen=True)
class ShimOptions:
    """What the launcher tells the program's trackers (``options.json`` in the run folder).

    Attributes:
        tolerance_bytes: Growth or residual below this is noise.
        grace_s: How long a process born in an epoch may outlive it.
        interval_s: Sampling interval.
        teardown: Install the teardown policy in the workers (``--teardown``).
        devices: Device indices to watch (None: all).
        rollup_share: Share of time the trackers' USS reads may take (None: the default).
        copy_tolerance_bytes: What each forked worker may copy of its parent's memory
            (the copy-on-read rule).

    """

    tolerance_bytes: int = 16 * MIB
    grace_s: float = 2.0
    interval_s: float = 0.05
    teardown: bool = False
    devices: tuple[int, ...] | None = None
    rollup_share: float | None = None
    copy_tolerance_bytes: int = 64 * MIB

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        data = dataclasses.asdict(self)
        data["devices"] = None if self.devices is None else list(self.devices)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShimOptions:
        """Read ``to_dict``'s form back; a missing or bad field keeps its default."""
        defaults = cls()
        devices = data.get("devices")
        return cls(
            tolerance_bytes=_typed(data, "tolerance_bytes", int, defaults.tolerance_bytes),
            grace_s=float(_typed(data, "grace_s", (int, float), defaults.grace_s)),
            interval_s=float(_typed(data, "interval_s", (int, float), defaults.interval_s)),
            teardown=_typed(data, "teardown", bool, defaults.teardown),
            devices=tuple(int(d) for d in devices) if isinstance(devices, list) else None,
            rollup_share=_share(data.get("rollup_share")),
            copy_tolerance_bytes=_typed(
                data, "copy_tolerance_bytes", int, defaults.copy_tolerance_bytes
            ),
        )


def _share(value: object) -> float | None:
    try:
        return None if value is None else parse_share_option(value, "rollup_share")
    except UsageError:
        return None  # the default, as for every other bad field


def _typed(data: dict[str, Any], name: str, kind: Any, default: Any) -> Any:
    value = data.get(name)
    return (
        value
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        else (default)
    )


def write_options(folder: str, options: ShimOptions) -> None:
    """Write the options the program's trackers will use (the launcher, before the start)."""
    _write_json(os.path.join(folder, OPTIONS_FILE), options.to_dict())


@dataclass(frozen=True)
class LoaderRecords:
    """What the processes of a run left in its folder.

    Attributes:
        started: One record per loader tracker that started (label, pid, mailbox...).
        reports: One record per loader whose report was written at its process's exit.
        failures: Lines of processes whose tracking failed.

    """

    started: tuple[dict[str, Any], ...]
    reports: tuple[dict[str, Any], ...]
    failures: tuple[str, ...]


def read_records(folder: str) -> LoaderRecords:
    """Read the run folder (the launcher, after the program ended)."""
    started: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(folder, name)
        if name.startswith("failure-") and name.endswith(".txt"):
            try:
                with open(path, encoding="utf-8") as handle:
                    failures.append(handle.read().strip())
            except OSError:
                continue
            continue
        kind = "started" if name.endswith(".started") else "report"
        if not name.startswith("loader-") or not name.endswith((".started", ".json")):
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("schema") == RECORD_SCHEMA:
            (started if kind == "started" else reports).append(data)
    order = _record_order
    return LoaderRecords(
        started=tuple(sorted(started, key=order)),
        reports=tuple(sorted(reports, key=order)),
        failures=tuple(failures),
    )


def _record_order(record: dict[str, Any]) -> tuple[float, int]:
    started = record.get("started_unix_s")
    index = record.get("index")
    return (
        float(started) if isinstance(started, (int, float)) else 0.0,
        index if isinstance(index, int) else 0,
    )


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file)."""
    temp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temp, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    os.replace(temp, path)


# --------------------------------------------------------------------------- in the program


_EPOCH_ITERATOR_OWN = frozenset(("_batches", "_inner", "_loader"))


class _EpochIterator:
    """What the patched ``DataLoader.__iter__`` returns: one epoch's batches, and ``len()``.

    Other attributes are the DataLoader iterator's own (``_num_yielded``,
    ``_shutdown_workers()``: programs and libraries read them) once the epoch has begun,
    that is from the first batch on: the wrapped iterator is made then.
    """

    __slots__ = ("__dict__", "__weakref__", "_batches", "_inner", "_loader")

    def __init__(self, batches: Iterator[Any], loader: Any) -> None:
        self._batches = batches
        self._loader = loader
        self._inner: Iterator[Any] | None = None

    def _inner_or_none(self) -> Iterator[Any] | None:
        # Read without __getattr__: copy and pickle make the object before any slot is set.
        try:
            inner: Iterator[Any] | None = object.__getattribute__(self, "_inner")
        except AttributeError:
            return None
        return inner

    def __setattr__(self, name: str, value: Any) -> None:
        # Writes go where reads come from: the DataLoader iterator once there is one, this
        # object before (a program may tag its iterator).
        inner = None if name in _EPOCH_ITERATOR_OWN else self._inner_or_none()
        if inner is not None:
            setattr(inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # copy and pickle ask before any slot is set
        inner = self._inner_or_none()
        if inner is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} before its first "
                "batch (leakcheck run makes the loader's iterator then)"
            )
        return getattr(inner, name)

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def __len__(self) -> int:
        return len(self._loader)

    def close(self) -> None:
        """End the epoch now, as leaving the loop would."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


Where = tuple[Any, ...]
"""A creation site as the shim records it: ``(file, line, via, origin file, origin line)``."""


@dataclass
class _Site:
    """One creation site's tracker, and the loader instance it follows now."""

    label: str
    base: str
    """The label without its ``#2``."""
    where: Where
    pid: int
    """The process whose tracker it is (a forked child's loaders carry its parent's)."""
    index: int
    tracker: Tracker
    instance: weakref.ref[Any]
    started_unix_s: float
    live: weakref.WeakSet[_EpochIterator] = dataclasses.field(default_factory=weakref.WeakSet)

    def __reduce__(self) -> tuple[Any, ...]:
        # A loader the program pickles (the arguments of a spawned process) or deep-copies
        # carries None instead: the copy is another loader, and a tracker does not pickle.
        return (_no_site, ())


def _no_site() -> None:
    return None


class _Run:
    """The loaders of one process of the run (NOTE [run instrumentation])."""

    def __init__(self, folder: str, options: ShimOptions) -> None:
        self.folder = folder
        self.options = options
        self.pid = os.getpid()
        self.cwd = os.getcwd()
        self.sites: list[_Site] = []
        self.rank = process_rank()
        if self.rank is not None and ranks.rank_from_environ(os.environ) != self.rank:
            os.environ[ranks.EXPORTED_RANK_ENV] = ranks.exported_rank(self.rank)
        self.lock = threading.RLock()
        self.ended = False
        atexit.register(self.at_exit)
        _at_child_exit(self.at_exit)

    def session_ids(self) -> set[str]:
        """The sessions of this run's trackers (their hooks are on the loaders they track)."""
        with self.lock:
            return {site.tracker.session_id for site in self.sites}

    def label(self, where: Where) -> str:
        """``file:line``, with ``via LIBRARY`` where a library made the loader."""
        path, line = where[0], where[1]
        via = where[2] if len(where) > 2 and where[2] else ""
        return f"{shown_path(str(path), self.cwd)}:{line}" + (f" via {via}" if via else "")

    def site_for(self, loader: Any) -> _Site:
        site = loader.__dict__.get("_leakcheck_run_site")
        if isinstance(site, _Site) and site.pid == self.pid and not site.tracker.closed:
            return site
        where = loader.__dict__.get("_leakcheck_site")
        if not (isinstance(where, tuple) and len(where) >= 2):
            where = ("<unknown>", 0)
        with self.lock:
            same = [site for site in self.sites if site.where == where]
            site = next((s for s in same if s.instance() is None and not s.tracker.closed), None)
            if site is None:
                site = self._new_site(loader, where)
            site.instance = weakref.ref(loader)
        loader.__dict__["_leakcheck_run_site"] = site
        return site

    def _new_site(self, loader: Any, where: Where) -> _Site:
        options = self.options
        tracker = Tracker(
            interval=options.interval_s,
            tolerance=options.tolerance_bytes,
            grace=options.grace_s,
            devices=list(options.devices) if options.devices is not None else None,
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            rollup_share=options.rollup_share,
            copy_tolerance=options.copy_tolerance_bytes,
        )
        tracker.start()
        base = self.label(where)
        same = sum(1 for site in self.sites if site.base == base)
        site = _Site(
            label=base + (f" #{same + 1}" if same else ""),
            base=base,
            where=where,
            pid=self.pid,
            index=len(self.sites),
            tracker=tracker,
            instance=weakref.ref(loader),
            started_unix_s=time.time(),
        )
        self.sites.append(site)
        key = procs.process_key(self.pid)
        _write_json(
            self._path(site, ".started"),
            {
                **self._identity(site),
                # Its identity, checked by the launcher (NOTE [process identity] in procs.py).
                "start_ticks": key.start_ticks if key is not None else None,
                "mailbox": tracker.mailbox_dir,
            },
        )
        return site

    def _identity(self, site: _Site) -> dict[str, Any]:
        return {
            "schema": RECORD_SCHEMA,
            "schema_version": RECORD_SCHEMA_VERSION,
            "label": site.label,
            "file": site.where[0],
            "line": site.where[1],
            "via": site.where[2] if len(site.where) > 2 else "",
            "index": site.index,
            "pid": self.pid,
            "argv": list(sys.argv),
            # The program's torch (it made a DataLoader): the launcher never imports it.
            "torch": getattr(sys.modules.get("torch"), "__version__", None),
            "started_unix_s": site.started_unix_s,
            "rank": self._rank_record(),
        }

    def _rank_record(self) -> dict[str, Any] | None:
        """The rank of this process, with the device it chose (``set_device``) once known."""
        if self.rank is None:
            return None
        chosen = _quiet_value(own_rank_device)
        info = self.rank
        if chosen is not None and chosen[0] == info.rank:
            info = dataclasses.replace(info, device=chosen[1])
        return dataclasses.asdict(info)

    def _path(self, site: _Site, suffix: str) -> str:
        return os.path.join(self.folder, f"loader-{self.pid}-{site.index}{suffix}")

    def epoch_iterator(self, loader: Any, iterate: Callable[[Any], Iterator[Any]]) -> Any:
        site = self.site_for(loader)
        # A weak reference: the epoch holds its generator, which holds this function through
        # the wrapper; a strong one would make a cycle, and a loop left by `break` would end
        # its epoch only when the garbage collector ran ("collected", not "break").
        holder: list[weakref.ref[_EpochIterator]] = []

        def iterate_and_keep(target: Any) -> Iterator[Any]:
            inner = iterate(target)
            epoch_now = holder[0]() if holder else None
            if epoch_now is not None:
                epoch_now._inner = inner  # what the program may ask of its iterator
            return inner

        watched = WatchedLoader(
            loader,
            tracker=site.tracker,
            on_leak="ignore",
            teardown=self.options.teardown,
            iterate=iterate_and_keep,
            owns_tracker=False,
        )
        epoch = _EpochIterator(iter(watched), loader)
        holder.append(weakref.ref(epoch))
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
        with self.lock:
            sites = list(self.sites)
        costs: dict[int, TrackerCost] = {}
        for site in sites:
            costs[site.index] = site.tracker.cost()
            _quietly(functools.partial(site.tracker.end_epoch, reason, line))
            for epoch in list(site.live):
                _quietly(epoch.close)
        for site in sites:
            started = time.perf_counter()
            _quietly(site.tracker.close)
            _quietly(functools.partial(self._write_report, site, costs, started))

    def _write_report(self, site: _Site, costs: dict[int, TrackerCost], started: float) -> None:
        report = site.tracker.report()
        _write_json(
            self._path(site, ".json"),
            {
                **self._identity(site),
                "report": report.to_dict(),
                "cost": dataclasses.asdict(costs[site.index]),
                "cost_with_exit": dataclasses.asdict(site.tracker.cost()),
                "exit_s": time.perf_counter() - started,
            },
        )


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
    launched = ranks.rank_from_environ(
        {k: v for k, v in os.environ.items() if k != ranks.EXPORTED_RANK_ENV}
    )
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
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return None
    current = process.current_process()
    target = getattr(current, "_target", None)
    if getattr(target, "__module__", None) != "torch.multiprocessing.spawn":
        return None
    if getattr(target, "__name__", None) != "_wrap":
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


def _at_child_exit(action: Callable[[], None]) -> None:
    """Run ``action`` at a multiprocessing child's exit too.

    A forked child ends with ``os._exit`` once its exit finalizers ran, so ``atexit`` never
    runs there; a finalizer registered now (the child cleared its parent's at its start)
    runs before its daemonic children (a DataLoader's workers) are terminated.
    """
    process = sys.modules.get("multiprocessing.process")
    if process is None or process.parent_process() is None:
        return  # not a multiprocessing child: atexit runs
    import multiprocessing.util

    multiprocessing.util.Finalize(None, action, exitpriority=0)


def _quietly(action: Callable[[], object]) -> None:
    """Run ``action`` at exit: leakcheck's own failure is one line, never a traceback."""
    try:
        action()
    except BaseException as error:  # a second Ctrl-C too: the other loaders still report
        sys.stderr.write(f"leakcheck run: at exit: {type(error).__name__}: {error}\n")


def _quiet_value(read: Callable[[], Any]) -> Any:
    """``read()``, or None where it failed (a record is written anyway)."""
    try:
        return read()
    except Exception:
        return None


_state_lock = threading.Lock()
_folder: str | None = None
_run: _Run | None = None
_disabled = False
_inherited_sessions: set[str] = set()
"""A forked child's ancestors' trackers: their hooks on its loaders are the run's, not the
user's ``watch()``."""


def _after_fork_in_child() -> None:
    # Only references change (DataLoader's forked workers run this too), and no lock of the
    # parent's is taken: another thread may have held it at the fork.
    global _state_lock, _run
    _state_lock = threading.Lock()
    if _run is not None:
        _inherited_sessions.update(site.tracker.session_id for site in list(_run.sites))
        _run = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def configure(folder: str) -> None:
    """Name the run folder (the shim, before the first iteration)."""
    global _folder
    _folder = folder


def _current_run() -> _Run | None:
    global _run
    with _state_lock:
        if _run is None and _folder is not None and os.path.isdir(_folder):
            options = ShimOptions()
            try:
                with open(os.path.join(_folder, OPTIONS_FILE), encoding="utf-8") as handle:
                    data = json.load(handle)
                if isinstance(data, dict):
                    options = ShimOptions.from_dict(data)
            except (OSError, ValueError):
                pass
            _run = _Run(_folder, options)
        return _run


def _watched_by_user(loader: Any, run: _Run) -> bool:
    """The program wraps this loader with ``leakcheck.watch()`` already.

    The run's own hook does not count: an iterator the program keeps (a first batch peeked
    before the loop) leaves it on the loader while the next epochs start.
    """
    init = getattr(loader, "worker_init_fn", None)
    if not (isinstance(init, WorkerInit) and init.session_id):
        return False
    return init.session_id not in run.session_ids() | _inherited_sessions


def epoch_iterator(loader: Any, iterate: Callable[[Any], Iterator[Any]]) -> Any:
    """The patched ``DataLoader.__iter__``: one epoch of ``loader``'s tracker.

    Args:
        loader: The DataLoader being iterated.
        iterate: DataLoader's original ``__iter__``.

    Returns:
        An iterator over the epoch's batches; ``iterate(loader)`` itself when tracking is
        off (disabled after a failure, no run folder, or the loader is watched already).

    """
    global _disabled
    if _disabled:
        return iterate(loader)
    try:
        run = _current_run()
        if run is None or os.getpid() != run.pid or _watched_by_user(loader, run):
            return iterate(loader)
        return run.epoch_iterator(loader, iterate)
    except Exception as error:
        _disabled = True
        text = f"leakcheck run: DataLoaders of PID {os.getpid()} are no longer tracked: "
        text += f"{type(error).__name__}: {error}"
        sys.stderr.write(text + "\n")
        if _folder is not None:
            try:
                with open(
                    os.path.join(_folder, f"failure-{os.getpid()}.txt"), "w", encoding="utf-8"
                ) as handle:
                    handle.write(text + "\n")
            except OSError:
                pass
        return iterate(loader)
