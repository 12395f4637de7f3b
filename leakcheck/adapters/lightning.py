"""PyTorch Lightning: ``LeakCheckCallback``, whose epochs are the Trainer's epochs.

::

    leaks = LeakCheckCallback(on_leak="warn")
    trainer = lightning.Trainer(max_epochs=10, callbacks=[leaks])
    trainer.fit(model, datamodule=data)
    print(leaks.format())  # one report per stage, each named by its loader's hook
    leaks.plot("leaks.png")  # their memory per epoch, leaks marked (matplotlib)

Each epoch end logs ``epoch_scalars`` through the trainer's loggers on global rank zero. Works
with ``lightning.pytorch`` or ``pytorch_lightning``; importing ``leakcheck`` imports neither.

NOTE [lightning epochs]: each stage (``train``; ``val``: the sanity check and every validation
run; ``test``; ``predict``) has its own ``Tracker``, judging only its own loaders' workers
(NOTE [claims] in track/claims.py): validation runs inside the training epoch. Labels: ``train
epoch 3``, ``val epoch 3`` (``val epoch 3 run 2``: a second run in one training epoch), ``val
sanity check``, ``test epoch 0`` & co. outside ``fit``. Lightning starts a loader's workers
before any hook of the epoch, so from ``setup`` to ``teardown`` the callback wraps
``strategy.process_dataloader`` (called for every loader) and gives each DataLoader its own
``_get_iterator`` (called exactly when workers start), which opens the stage's epoch if none
is open and makes the iterator (NOTE [iterator policy] in dataloader.py). An epoch's end
shuts down an unfinished non-persistent iterator's workers (``limit_train_batches``), closes
the epoch and judges it; ``on_exception`` closes the open epochs (``exception`` or
``interrupt``); ``teardown`` closes the trackers, keeps their reports and judges the whole
run. A validation run pauses the training epoch's hang watch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any

from leakcheck.adapters.dataloader import (
    EpochJudge,
    OnEpoch,
    OnLeak,
    call_reported,
    check_arguments,
    shutdown_workers,
    start_iterator,
)
from leakcheck.core import ranks
from leakcheck.core.errors import LeakError, UsageError
from leakcheck.core.model import MIB, EndReason, RankInfo, Timeline
from leakcheck.judge.plot import plot_reports
from leakcheck.judge.report import Report, epoch_row
from leakcheck.track.tracker import Tracker, end_reason_for

if TYPE_CHECKING:
    from lightning.pytorch import Callback as _CallbackBase
else:
    try:
        from lightning.pytorch import Callback as _CallbackBase
    except ImportError:  # the older package name
        try:
            from pytorch_lightning import Callback as _CallbackBase
        except ImportError as error:
            raise ImportError(
                "leakcheck.adapters.lightning needs PyTorch Lightning: "
                'pip install "dataloader-leakcheck[lightning]" (or lightning / pytorch_lightning)'
            ) from error

__all__ = ["STAGES", "LeakCheckCallback", "epoch_scalars"]

STAGES = ("train", "val", "test", "predict")
"""The stages the callback tracks, each with its own tracker and report."""

# Lightning's RunningStage values -> the stage whose tracker owns the loaders iterated then.
_STAGE_OF = {"train": "train", "sanity_check": "val", "validate": "val"}
_STAGE_OF.update(test="test", predict="predict")


def _state(trainer: Any, field: str) -> str:
    """``trainer.state.stage`` or ``.fn`` as a string (``"None"`` where there is none)."""
    value = getattr(getattr(trainer, "state", None), field, None)
    return str(getattr(value, "value", value))


def epoch_scalars(stage: str, timeline: Timeline, leaks_found: int | None) -> dict[str, float]:
    """The scalars logged for a stage's latest epoch, by name (``leakcheck/train/...``).

    ``workers``, ``parent_host_mib``, ``workers_host_mib``, ``parent_pinned_mib``, ``leaks``
    and, where NVML attributes GPU memory, ``parent_gpu_mib`` and ``workers_gpu_peak_mib``.
    A figure not read is left out, never given as 0.
    """
    record = timeline.epochs[-1]
    row = epoch_row(record, timeline)
    bytes_: dict[str, int | None] = {
        "parent_host_mib": row.parent_host_bytes,
        "workers_host_mib": row.workers_host_bytes if row.host_source is not None else None,
        "parent_pinned_mib": record.pinned_reserved_bytes,
        "parent_gpu_mib": row.parent_gpu_bytes,  # None where NVML did not attribute it
        "workers_gpu_peak_mib": row.workers_gpu_bytes_peak,
    }
    scalars = {name: value / MIB for name, value in bytes_.items() if value is not None}
    scalars["workers"] = float(row.worker_count)
    if leaks_found is not None:
        scalars["leaks"] = float(leaks_found)
    return {f"leakcheck/{stage}/{name}": value for name, value in sorted(scalars.items())}


class _Stage(EpochJudge):
    """One tracked stage: its tracker's epoch ends, and the open epoch's batches and iterators."""

    def __init__(self, name: str, tracker: Tracker, callback: LeakCheckCallback) -> None:
        super().__init__(tracker.start(), callback._on_leak, callback._on_epoch)
        # The callback's: a process every stage judges (the parent) is announced once.
        self._announced = callback._announced
        self.name = name
        self.open = False
        self.batches = 0
        self.runs_in_epoch: dict[int, int] = {}  # validation runs per training epoch
        # Weak: Lightning drops them to shut their workers down, and must still be able to.
        self.iterators: list[weakref.ref[Any]] = []
        self.report: Report | None = None  # kept at close

    def begin(self, trainer: Any) -> None:
        """Open an epoch, labelled after the trainer's state, if none is open."""
        if self.open:
            return
        if self.name == "val" and getattr(trainer, "sanity_checking", False):
            label = "val sanity check"
        elif _state(trainer, "fn") != "fit":
            label = f"{self.name} epoch {len(self.tracker.epochs())}"
        else:
            epoch = int(getattr(trainer, "current_epoch", 0))
            label = f"{self.name} epoch {epoch}"
            if self.name == "val":
                runs = self.runs_in_epoch[epoch] = self.runs_in_epoch.get(epoch, 0) + 1
                label += f" run {runs}" if runs > 1 else ""
        self.tracker.begin_epoch(label)
        self.open, self.batches = True, 0

    def end(self, reason: EndReason, error: str | None = None) -> bool:
        """Close the open epoch, its non-persistent workers shut down first; False: none open."""
        if not self.open:
            return False
        for ref in self.iterators:
            shutdown_workers(ref())
        self.iterators.clear()
        self.open = False
        self.end_epoch(reason, error, self.batches)
        return True


class _IteratorHook:
    """A DataLoader's own ``_get_iterator``: its iterator is made in the stage's epoch."""

    def __init__(self, callback: LeakCheckCallback, loader: Any, previous: Any) -> None:
        self.callback = callback
        self.loader = weakref.ref(loader)
        self.previous = previous  # an instance-level ``_get_iterator`` that was there before

    def __call__(self) -> Any:
        loader: Any = self.loader()  # alive: it calls its own method
        make = self.previous or type(loader)._get_iterator.__get__(loader)
        trainer = self.callback._trainer
        name = _STAGE_OF.get(_state(trainer, "stage"))
        if name is None:
            return make()  # iterated outside a run of the callback: not ours to track
        with self.callback._lock:
            stage = self.callback._open(name, trainer)
            iterator = start_iterator(loader, stage.tracker, make, release=self.callback._teardown)
            if not getattr(loader, "persistent_workers", False):
                with contextlib.suppress(TypeError):
                    stage.iterators.append(weakref.ref(iterator))
            return iterator


class LeakCheckCallback(_CallbackBase):
    """A Lightning callback that reports, per epoch of each stage, who leaked what.

    Each stage gets its own :class:`~leakcheck.Tracker` (NOTE [lightning epochs]). Leaks are
    announced at epoch ends as :func:`leakcheck.watch` does; the whole run is judged, and the
    reports kept, at the end of ``fit``, ``validate``, ``test`` or ``predict``.

    Args:
        on_leak: ``"warn"``, ``"raise"`` (a ``LeakError`` from the hook, which
            ``trainer.fit`` raises) or ``"ignore"`` (only the reports).
        tolerance, warmup_epochs, grace, teardown, interval, rollup_share, copy_tolerance,
            on_epoch, hang_after: As in :func:`leakcheck.watch` (``on_epoch`` gets each
            stage's epoch records).

    Raises:
        UsageError: A bad argument; the message names it and what was expected.

    """

    def __init__(
        self,
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
    ) -> None:
        super().__init__()
        self._on_leak = check_arguments(on_leak, teardown, on_epoch)
        self._teardown = teardown
        self._on_epoch = on_epoch
        self._tracker_options: dict[str, Any] = {
            "tolerance": tolerance,
            "warmup_epochs": warmup_epochs,
            "grace": grace,
            "interval": interval,
            "rollup_share": rollup_share,
            "copy_tolerance": copy_tolerance,
            "hang_after": hang_after,
        }
        Tracker(**self._tracker_options)  # validates the rest, as watch() does; starts nothing
        self._stages: dict[str, _Stage] = {}
        self._announced: set[tuple[object, ...]] = set()  # the leaks said, over all stages
        self._trainer: Any = None
        self._lock = threading.RLock()  # a loader may be iterated on another thread than hooks
        # (object, attribute, ours, the instance attribute ours replaced or None): _unhook
        self._patches: list[tuple[weakref.ref[Any], str, object, object]] = []

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that start ranks by spawn (``ddp_spawn``) pickle the trainer with its
        # callbacks: each rank tracks its own processes, from a fresh start.
        state = dict(self.__dict__)
        del state["_lock"]
        state.update(_stages={}, _announced=set(), _trainer=None, _patches=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.RLock())

    def __repr__(self) -> str:
        options = {**self._tracker_options, "on_leak": self._on_leak, "teardown": self._teardown}
        return f"LeakCheckCallback({', '.join(f'{k}={v!r}' for k, v in options.items())})"

    # --- results -----------------------------------------------------------------------

    @property
    def trackers(self) -> dict[str, Tracker]:
        """The tracker of each stage tracked so far (the latest run's), by stage name."""
        return {name: stage.tracker for name, stage in self._stages.items()}

    @property
    def reports(self) -> dict[str, Report]:
        """The report of each stage tracked so far, by stage name, train first (:meth:`report`)."""
        return {name: self.report(name) for name in STAGES if name in self._stages}

    def report(self, stage: str = "train") -> Report:
        """The report of one stage (kept at its tracker's close; before that, a fresh one).

        Raises:
            UsageError: ``stage`` was not tracked.

        """
        found = self._stages.get(stage) if isinstance(stage, str) else None
        if found is None:
            tracked = ", ".join(self._stages) or "none yet"
            raise UsageError(
                f"stage: expected one of {', '.join(STAGES)} that was tracked "
                f"(tracked: {tracked}), got {stage!r}"
            )
        return found.report or found.tracker.report()

    def format(self, *, verbose: bool = False) -> str:
        """Every tracked stage's report, each named by its loader's hook, train first."""
        return "\n".join(
            f"{name}: {report.format(verbose=verbose)}" for name, report in self._named_reports()
        )

    def plot(self, path: str) -> str:
        """Draw every tracked stage's report side by side as a PNG; returns ``path``.

        Raises:
            UsageError: matplotlib is not installed.

        """
        return plot_reports(self._named_reports(), path)

    def _named_reports(self) -> list[tuple[str, Report]]:
        return [(f"{name}_dataloader", report) for name, report in self.reports.items()]

    # --- Lightning hooks ---------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Start of ``fit``/``validate``/``test``/``predict``: adopt loaders as they come."""
        if trainer.world_size > 1:
            # NOTE [exported rank] in ranks.py: a ddp_spawn rank; what its workers start says it.
            ranks.export_rank(RankInfo(trainer.global_rank, trainer.local_rank, trainer.world_size))
        with self._lock:
            self._unhook()
            self._trainer = trainer
            strategy = trainer.strategy
            original = strategy.process_dataloader

            def process_dataloader(dataloader: object) -> object:
                dataloader = original(dataloader)
                self._adopt(dataloader)
                return dataloader

            previous = vars(strategy).get("process_dataloader")
            self._patch(strategy, "process_dataloader", process_dataloader, previous)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """End of the run: close the trackers, keep the reports, judge the whole run."""
        self._finish(may_raise=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The run is failing: close open epochs with how it ended, then the trackers."""
        if self._trainer is None:
            return
        reason, error = end_reason_for(exception)
        with self._lock:
            for stage in self._stages.values():
                if not stage.tracker.closed:
                    stage.end(reason, error)
        self._finish(may_raise=False)

    # --- internals (the per-stage hooks, made below the class, call these) ------------

    def _open(self, name: str, trainer: Any) -> _Stage:
        """The stage, with an epoch open; a new tracker where the last run closed the old one."""
        stage = self._stages.get(name)
        if stage is None or stage.tracker.closed:
            stage = self._stages[name] = _Stage(name, Tracker(**self._tracker_options), self)
        stage.begin(trainer)
        return stage

    def _batch(self, name: str, *, wanted: bool, count: int = 0) -> None:
        """The loop waits for a batch (``wanted``) or stops waiting (NOTE [hang watch])."""
        stage = self._stages.get(name)
        if stage is None or not stage.open:
            return
        if wanted:
            stage.tracker.batch_wanted()
        else:
            stage.tracker.batch_arrived()
            stage.batches += count

    def _epoch_end(self, name: str) -> None:
        with self._lock:
            stage = self._stages.get(name)
            if stage is None or not stage.end("completed"):
                return
        trainer = self._trainer
        loggers = list(getattr(trainer, "loggers", None) or ())
        loggers = loggers if getattr(trainer, "is_global_zero", True) else []
        stage.count = bool(loggers)  # the logged leak count, built only to be logged

        def log() -> None:
            step = int(getattr(trainer, "global_step", 0))
            timeline = stage.tracker.timeline(last_epochs=1)
            if timeline.epochs:
                metrics = epoch_scalars(stage.name, timeline, stage.leaks_found)
                for logger in loggers:
                    log_one = functools.partial(logger.log_metrics, metrics, step=step)
                    call_reported(f"logging to {type(logger).__name__}", log_one)

        try:
            stage.judge(may_raise=True)
        finally:
            if loggers:  # leakcheck's reads too: nothing escapes into the Trainer
                call_reported("logging leakcheck's scalars", log)

    def _adopt(self, loader: object) -> None:
        """Give a DataLoader the hook that runs before its workers start (idempotent)."""
        if not (hasattr(loader, "_get_iterator") and hasattr(loader, "worker_init_fn")):
            return  # not a DataLoader: its epochs are still tracked, by lineage
        with self._lock:
            current = vars(loader).get("_get_iterator")
            if isinstance(current, _IteratorHook):
                if current.callback is self:
                    return
                current = None  # another callback's leftover: go around it
            self._patch(loader, "_get_iterator", _IteratorHook(self, loader, current), current)

    def _patch(self, target: Any, name: str, ours: object, previous: object) -> None:
        setattr(target, name, ours)
        self._patches.append((weakref.ref(target), name, ours, previous))

    def _unhook(self) -> None:
        """Give the strategy and every adopted loader their own methods back."""
        for ref, name, ours, previous in self._patches:
            target = ref()
            if target is None or vars(target).get(name) is not ours:
                continue  # gone, or patched again by someone else since
            if previous is None:
                delattr(target, name)
            else:
                setattr(target, name, previous)
        self._patches.clear()

    def _finish(self, *, may_raise: bool) -> None:
        """Close every live tracker, keep its report, then judge the whole run of each."""
        with self._lock:
            self._unhook()
            self._trainer = None
            closing = [stage for stage in self._stages.values() if not stage.tracker.closed]
            for stage in closing:
                stage.end("closed")
                stage.tracker.close()
                stage.report = stage.tracker.report()
        raised: LeakError | None = None
        for stage in closing:  # the first leak raises, the next ones warn
            try:
                stage.judge(may_raise=may_raise and raised is None, stacklevel=2)
            except LeakError as error:
                raised = error
        if raised is not None:
            raise raised


def _add_stage_hooks(loop: str, name: str) -> None:
    """Add Lightning's four hooks of one stage's loop (``on_<loop>_epoch_start`` & co.)."""
    paused = "train" if name == "val" else None  # a validation run pauses training's wait

    def epoch_start(self: LeakCheckCallback, trainer: Any, pl_module: Any) -> None:
        if paused:
            self._batch(paused, wanted=False)
        if self._trainer is None:
            return
        with self._lock:
            stage = self._open(name, trainer)
        stage.tracker.batch_wanted()
        stage.judge_if_due()  # NOTE [late survivors] in dataloader.py

    def batch_start(self: LeakCheckCallback, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._batch(name, wanted=False, count=1)

    def batch_end(self: LeakCheckCallback, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._batch(name, wanted=True)

    def epoch_end(self: LeakCheckCallback, trainer: Any, pl_module: Any) -> None:
        self._epoch_end(name)
        if paused:
            self._batch(paused, wanted=True)

    hooks = {"epoch_start": epoch_start, "batch_start": batch_start}
    hooks.update(batch_end=batch_end, epoch_end=epoch_end)
    for event, hook in hooks.items():
        hook.__name__ = f"on_{loop}_{event}"
        hook.__qualname__ = f"LeakCheckCallback.{hook.__name__}"
        setattr(LeakCheckCallback, hook.__name__, hook)


for _loop, _name in zip(("train", "validation", "test", "predict"), STAGES, strict=True):
    _add_stage_hooks(_loop, _name)
