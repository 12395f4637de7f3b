"""PyTorch Lightning: ``LeakCheckCallback``, whose epochs are the Trainer's epochs.

::

    leaks = LeakCheckCallback(on_leak="warn")
    trainer = lightning.Trainer(max_epochs=10, callbacks=[leaks])
    trainer.fit(model, datamodule=data)
    print(leaks.format())  # one report per stage, each named by its loader's hook
    leaks.plot("leaks.png")  # their memory per epoch, leaks marked (matplotlib)

Each epoch end logs a few scalars through every logger of the trainer on global rank zero,
under ``leakcheck/<stage>/`` (``epoch_scalars``); without a logger nothing is built for it.
Works with ``lightning.pytorch`` or, where only that is installed, ``pytorch_lightning``;
importing ``leakcheck`` never imports either.

NOTE [lightning epochs]: each stage (``train``, ``val``: the sanity check and every
validation run, ``test``, ``predict``) has its own ``Tracker``: validation runs inside the
training epoch, so two epochs are open at once, and each tracker judges only its own loaders'
workers (NOTE [claims] in track/claims.py). Labels: ``train epoch 3``, ``val epoch 3`` (``val
epoch 3 run 2`` for a second run in one training epoch), ``val sanity check``, and ``val
epoch 0`` / ``test epoch 0`` / ``predict epoch 0`` outside ``fit``. Lightning calls
``iter()`` on a loader, starting its workers, before any callback hook of the first training
epoch and of every evaluation run. So from ``setup`` to ``teardown`` the callback wraps the
trainer's ``strategy.process_dataloader`` (called for every loader, flattened out of lists,
dicts and ``CombinedLoader``) and gives each DataLoader an instance-level ``_get_iterator``
(what ``DataLoader.__iter__`` calls exactly when it starts workers): that opens the stage's
epoch if none is open and chains ``WorkerInit`` in front of the loader's ``worker_init_fn``
for that one iterator. ``on_*_epoch_end`` closes the epoch with the batches counted and
judges it; the workers of an unfinished non-persistent iterator (``limit_train_batches``)
are shut down there, as ``watch()`` does after an early end. ``on_exception`` closes the open
epochs with ``exception`` or ``interrupt`` and warns; ``teardown`` closes the trackers,
keeps their reports and judges the whole run. The hang watch (NOTE [hang watch] in hang.py)
counts from a batch's end (or the epoch's start) to the next batch's start; a validation run
pauses the training epoch's count.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from leakcheck.adapters.watching import (
    EpochJudge,
    OnLeak,
    call_reported,
    chained_worker_init,
    check_on_epoch,
    check_on_leak,
    check_teardown,
    last_record,
)
from leakcheck.core.errors import LeakError, LeakWarning, UsageError
from leakcheck.core.model import MIB, EndReason, EpochRecord, Timeline
from leakcheck.judge.report import Report, host_totals, plot_reports, workers_peak_bytes
from leakcheck.judge.verdict import per_pid_bytes_known
from leakcheck.track.hang import watch_exits
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
_STAGE_OF = {
    "train": "train",
    "sanity_check": "val",
    "validate": "val",
    "test": "test",
    "predict": "predict",
}


def _running_stage(trainer: Any) -> str | None:
    stage = getattr(getattr(trainer, "state", None), "stage", None)
    value = getattr(stage, "value", stage)
    return _STAGE_OF.get(value) if isinstance(value, str) else None


def epoch_scalars(stage: str, timeline: Timeline, leaks_found: int | None) -> dict[str, float]:
    """The scalars logged for a stage's latest epoch, by name (``leakcheck/train/...``).

    ``workers``, ``parent_host_mib``, ``workers_host_mib``, ``parent_pinned_mib``, ``leaks``
    and, where NVML attributes GPU memory to processes, ``parent_gpu_mib`` and
    ``workers_gpu_peak_mib``. A figure that was not read is left out, never given as 0.
    """
    record = timeline.epochs[-1]
    parents = [p for p in record.processes if p.role == "parent"]
    workers = [p for p in record.processes if p.role == "worker"]
    host = host_totals(record.processes)
    bytes_: dict[str, int | None] = {
        "parent_host_mib": host.parent_bytes,
        "workers_host_mib": host.workers_bytes if host.source is not None else None,
        "parent_pinned_mib": record.pinned_reserved_bytes,
    }
    if per_pid_bytes_known(timeline):
        bytes_["parent_gpu_mib"] = sum(p.total_gpu_bytes_end for p in parents)
        bytes_["workers_gpu_peak_mib"] = workers_peak_bytes(workers)
    scalars = {name: value / MIB for name, value in bytes_.items() if value is not None}
    scalars["workers"] = float(len(workers))
    if leaks_found is not None:
        scalars["leaks"] = float(leaks_found)
    return {f"leakcheck/{stage}/{name}": value for name, value in sorted(scalars.items())}


def _fitting(trainer: Any) -> bool:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn) == "fit"


class _Stage:
    """One tracked stage: its tracker, its judge, and the open epoch's batches and iterators."""

    def __init__(self, name: str, tracker: Tracker, on_leak: OnLeak) -> None:
        self.name = name
        self.tracker = tracker
        self.mailbox_dir = tracker.start().mailbox_dir
        self.judge = EpochJudge(tracker, on_leak)
        self.open = False
        self.batches = 0
        self.runs_in_epoch: dict[int, int] = {}  # validation runs per training epoch
        # Weak: Lightning drops them to shut their workers down, and must still be able to.
        self.iterators: list[weakref.ref[Any]] = []
        self.report: Report | None = None  # kept at close

    def release_workers(self) -> None:
        """Shut down the workers of this epoch's non-persistent iterators (idempotent)."""
        for ref in self.iterators:
            # Private, but what the iterator's own __del__ calls; idempotent.
            shutdown = getattr(ref(), "_shutdown_workers", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):
                    shutdown()
        self.iterators.clear()

    def end(
        self, reason: EndReason, error: str | None, on_epoch: Callable[[EpochRecord], object] | None
    ) -> bool:
        """Close the open epoch (its workers shut down first); False when none was open."""
        if not self.open:
            return False
        self.release_workers()
        self.open = False
        batches, self.batches = self.batches, 0
        self.tracker.batch_arrived()
        self.tracker.end_epoch(reason, error, batches)
        self.judge.epoch_ended()
        if on_epoch is not None:  # leakcheck's own reads too: nothing escapes into the loop
            call_reported("on_epoch", lambda: on_epoch(last_record(self.tracker)))
        return True


class _IteratorHook:
    """A DataLoader's instance-level ``_get_iterator``: NOTE [lightning epochs]."""

    def __init__(self, callback: LeakCheckCallback, loader: Any, previous: Any) -> None:
        self.callback = callback
        self.loader = weakref.ref(loader)
        self.previous = previous  # an instance-level ``_get_iterator`` that was there before

    def __call__(self) -> Any:
        loader = self.loader()
        if loader is None:  # pragma: no cover - a live loader calls its own method
            raise RuntimeError("leakcheck: the DataLoader of this hook is gone")
        make = self.previous or type(loader)._get_iterator.__get__(loader)
        return self.callback._start_iterator(loader, make)


class LeakCheckCallback(_CallbackBase):
    """A Lightning callback that reports, per epoch of each stage, who leaked what.

    Each stage (``train``, ``val``, ``test``, ``predict``) gets its own
    :class:`~leakcheck.Tracker` (NOTE [lightning epochs]). Leaks are announced at epoch ends
    like :func:`leakcheck.watch` does, and the whole run is judged at the end of ``fit``,
    ``validate``, ``test`` or ``predict``, when the reports are kept.

    Args:
        tolerance: Growth below this per epoch is noise (``"16MiB"``, or bytes).
        warmup_epochs: Epochs the growth rule ignores (allocator warm-up).
        grace: Seconds a worker may outlive its epoch before it is a survivor.
        on_leak: ``"warn"``, ``"raise"`` (a ``LeakError`` from the hook, which
            ``trainer.fit`` raises) or ``"ignore"`` (only the reports).
        teardown: Workers release their CUDA resources before they exit.
        interval: Seconds between background samples.
        rollup_share, copy_tolerance, on_epoch, hang_after: As in :func:`leakcheck.watch`
            (``on_epoch`` gets each stage's epoch records; ``hang_after=0``: no hang watch).

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
        on_epoch: Callable[[EpochRecord], object] | None = None,
        hang_after: float | str = 120.0,
    ) -> None:
        super().__init__()
        self._on_leak = check_on_leak(on_leak)
        self._teardown = check_teardown(teardown)
        self._on_epoch = check_on_epoch(on_epoch)
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
        self._trainer: Any = None
        # (strategy, our process_dataloader, the instance attribute it replaced or None)
        self._strategy_hook: tuple[Any, Any, Any] | None = None
        self._loader_hooks: list[tuple[weakref.ref[Any], _IteratorHook]] = []
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that start ranks by spawn (``ddp_spawn``) pickle the trainer with its
        # callbacks: each rank tracks its own processes, from a fresh start.
        state = dict(self.__dict__)
        state.update(_stages={}, _trainer=None, _strategy_hook=None, _loader_hooks=[])
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._tracker_options.items())
        return (
            f"LeakCheckCallback({options}, on_leak={self._on_leak!r}, teardown={self._teardown!r})"
        )

    # --- results -----------------------------------------------------------------------

    @property
    def trackers(self) -> dict[str, Tracker]:
        """The tracker of each stage tracked so far (the latest run's), by stage name."""
        return {name: stage.tracker for name, stage in self._stages.items()}

    @property
    def reports(self) -> dict[str, Report]:
        """The report of each stage tracked so far, by stage name (see :meth:`report`)."""
        return {name: self.report(name) for name in self._stages}

    def report(self, stage: str = "train") -> Report:
        """The report of one stage: ``"train"``, ``"val"``, ``"test"`` or ``"predict"``.

        After the run, the report kept when its tracker closed; during it, a fresh one.

        Raises:
            UsageError: ``stage`` is not a stage this callback has tracked.

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
        tracked = [name for name in STAGES if name in self._stages]
        return [(f"{name}_dataloader", self.report(name)) for name in tracked]

    # --- Lightning hooks ---------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Start of ``fit``/``validate``/``test``/``predict``: adopt loaders as they come."""
        with self._lock:
            self._unhook()
            self._trainer = trainer
            strategy = trainer.strategy
            previous = vars(strategy).get("process_dataloader")
            original = strategy.process_dataloader

            def process_dataloader(dataloader: object) -> object:
                dataloader = original(dataloader)
                self._adopt(dataloader)
                return dataloader

            strategy.process_dataloader = process_dataloader
            self._strategy_hook = (strategy, process_dataloader, previous)

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
                    stage.end(reason, error, self._on_epoch)
        self._finish(may_raise=False)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open ``train epoch N`` (if its loader's workers did not open it already)."""
        self._epoch_start("train", trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Count the batch."""
        self._batch_start("train")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """The loop asks for its next batch."""
        self._batch_end("train")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the train epoch and judge it."""
        self._epoch_end("train")

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the validation run's epoch (the sanity check's included)."""
        self._pause_training(True)
        self._epoch_start("val", trainer)

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Count the batch."""
        self._batch_start("val")

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """The loop asks for its next batch."""
        self._batch_end("val")

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the validation epoch and judge it."""
        self._epoch_end("val")
        self._pause_training(False)

    def on_test_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the test epoch."""
        self._epoch_start("test", trainer)

    def on_test_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Count the batch."""
        self._batch_start("test")

    def on_test_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """The loop asks for its next batch."""
        self._batch_end("test")

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the test epoch and judge it."""
        self._epoch_end("test")

    def on_predict_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the predict epoch."""
        self._epoch_start("predict", trainer)

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Count the batch."""
        self._batch_start("predict")

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """The loop asks for its next batch."""
        self._batch_end("predict")

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the predict epoch and judge it."""
        self._epoch_end("predict")

    # --- internals ---------------------------------------------------------------------

    def _stage(self, name: str) -> _Stage:
        """The stage's live tracker, started; a new one where the last run closed it."""
        stage = self._stages.get(name)
        if stage is None or stage.tracker.closed:
            stage = _Stage(name, Tracker(**self._tracker_options), self._on_leak)
            self._stages[name] = stage
        return stage

    def _label(self, stage: _Stage, trainer: Any) -> str:
        if stage.name == "val" and getattr(trainer, "sanity_checking", False):
            return "val sanity check"
        if not _fitting(trainer):
            return f"{stage.name} epoch {len(stage.tracker.epochs())}"
        epoch = int(getattr(trainer, "current_epoch", 0))
        label = f"{stage.name} epoch {epoch}"
        if stage.name == "val":
            runs = stage.runs_in_epoch[epoch] = stage.runs_in_epoch.get(epoch, 0) + 1
            if runs > 1:
                label += f" run {runs}"
        return label

    def _open(self, name: str, trainer: Any) -> _Stage:
        """The stage, with an epoch open (opened now if none was)."""
        stage = self._stage(name)
        if not stage.open:
            stage.tracker.begin_epoch(self._label(stage, trainer))
            stage.open = True
            stage.batches = 0
        return stage

    def _epoch_start(self, name: str, trainer: Any) -> None:
        if self._trainer is None:
            return
        with self._lock:
            stage = self._open(name, trainer)
        stage.tracker.batch_wanted()
        stage.judge.judge_if_due()  # NOTE [late survivors] in watching.py

    def _batch_start(self, name: str) -> None:
        stage = self._stages.get(name)
        if stage is not None and stage.open:
            stage.tracker.batch_arrived()
            stage.batches += 1

    def _batch_end(self, name: str) -> None:
        stage = self._stages.get(name)
        if stage is not None and stage.open:
            stage.tracker.batch_wanted()  # NOTE [hang watch]: only the wait counts

    def _pause_training(self, pause: bool) -> None:
        """A validation run inside a training epoch is not the training loop's wait."""
        stage = self._stages.get("train")
        if stage is not None and stage.open:
            if pause:
                stage.tracker.batch_arrived()
            else:
                stage.tracker.batch_wanted()

    def _epoch_end(self, name: str) -> None:
        with self._lock:
            stage = self._stages.get(name)
            if stage is None or not stage.end("completed", None, self._on_epoch):
                return
        trainer = self._trainer
        loggers = list(getattr(trainer, "loggers", None) or ())
        if not getattr(trainer, "is_global_zero", True):
            loggers = []
        stage.judge.count = bool(loggers)  # the logged leak count, built only to be logged
        try:
            stage.judge.judge(may_raise=True)
        finally:
            if loggers:
                self._log_epoch(stage, loggers, int(getattr(trainer, "global_step", 0)))

    def _log_epoch(self, stage: _Stage, loggers: list[Any], step: int) -> None:
        """Log the epoch's scalars through the trainer's loggers."""

        def log() -> None:  # leakcheck's reads too: nothing escapes into the Trainer
            timeline = stage.tracker.timeline(last_epochs=1)
            if not timeline.epochs:
                return
            metrics = epoch_scalars(stage.name, timeline, stage.judge.leaks_found)
            for logger in loggers:
                call_reported(
                    f"logging to {type(logger).__name__}",
                    functools.partial(logger.log_metrics, metrics, step=step),
                )

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
            hook = _IteratorHook(self, loader, current)
            loader._get_iterator = hook
            self._loader_hooks.append((weakref.ref(loader), hook))

    def _start_iterator(self, loader: Any, make: Callable[[], Any]) -> Any:
        """Build a loader's iterator (its workers start now) inside the stage's epoch."""
        name = _running_stage(self._trainer) if self._trainer is not None else None
        if name is None:
            return make()  # iterated outside a run of this callback: not ours to track
        with self._lock:
            stage = self._open(name, self._trainer)
            persistent = bool(getattr(loader, "persistent_workers", False))
            users = loader.worker_init_fn
            installed = chained_worker_init(
                users,
                tracker=stage.tracker,
                mailbox_dir=stage.mailbox_dir,
                release=self._teardown,
                persistent=persistent,
            )
            # NOTE [teardown policy] in teardown.py: the death signal follows the thread.
            installed.death_signal = threading.current_thread() is threading.main_thread()
            loader.worker_init_fn = installed
            try:
                iterator = make()
            finally:
                if loader.worker_init_fn is installed:
                    loader.worker_init_fn = users
            watch_exits(iterator, stage.tracker.worker_stuck)  # NOTE [exit watch] in hang.py
            if not persistent:
                with contextlib.suppress(TypeError):
                    stage.iterators.append(weakref.ref(iterator))
            return iterator

    def _unhook(self) -> None:
        """Give the strategy and every adopted loader their own methods back."""
        if self._strategy_hook is not None:
            strategy, ours, previous = self._strategy_hook
            if vars(strategy).get("process_dataloader") is ours:
                if previous is None:
                    del strategy.process_dataloader
                else:
                    strategy.process_dataloader = previous
            self._strategy_hook = None
        for ref, hook in self._loader_hooks:
            loader = ref()
            if loader is None or vars(loader).get("_get_iterator") is not hook:
                continue
            if hook.previous is None:
                del loader._get_iterator
            else:
                loader._get_iterator = hook.previous
        self._loader_hooks.clear()

    def _finish(self, *, may_raise: bool) -> None:
        """Close every live tracker, keep its report, then judge the whole run of each."""
        with self._lock:
            self._unhook()
            self._trainer = None
            closing = [stage for stage in self._stages.values() if not stage.tracker.closed]
            for stage in closing:
                stage.end("closed", None, self._on_epoch)
                stage.release_workers()
                stage.tracker.close()
                stage.report = stage.tracker.report()
        raised: list[LeakError] = []
        for stage in closing:
            try:
                stage.judge.judge(may_raise=may_raise)
            except LeakError as error:
                raised.append(error)
        for extra in raised[1:]:
            warnings.warn(LeakWarning(str(extra)), stacklevel=2)
        if raised:
            raise raised[0]
