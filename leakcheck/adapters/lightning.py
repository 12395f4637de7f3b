"""PyTorch Lightning: ``LeakCheckCallback``, whose epochs are the Trainer's epochs.

::

    from leakcheck.adapters.lightning import LeakCheckCallback

    leaks = LeakCheckCallback(on_leak="warn")
    trainer = lightning.Trainer(max_epochs=10, callbacks=[leaks])
    trainer.fit(model, datamodule=data)
    print(leaks.format())  # one report per stage, each named by its loader's hook
    leaks.plot("leaks.png")  # their memory per epoch, leaks marked (matplotlib)

Each epoch end also logs a few scalars through every logger of the trainer (TensorBoard,
CSV, W&B alike) on global rank zero, under ``leakcheck/<stage>/``: ``workers``,
``parent_host_mib``, ``workers_host_mib``, ``leaks`` (found in the judged epochs) and,
where NVML attributes GPU memory to processes, ``parent_gpu_mib`` and
``workers_gpu_peak_mib``; a figure not read is left out, never logged as 0.

Works with ``lightning.pytorch`` (the ``lightning`` package) and, where only that is
installed, ``pytorch_lightning``; importing ``leakcheck`` never imports either.

NOTE [lightning epochs]: each stage is tracked apart, by its own ``Tracker``: ``train``,
``val`` (the sanity check and every validation run, during ``fit`` or ``validate``),
``test`` and ``predict``. Validation runs inside the training epoch, so two epochs are open
at once; each tracker judges only its own loaders' workers and what they start (NOTE
[claims] in track/claims.py), and the worker identities are exact because each worker
posts itself to the mailbox of its own stage's tracker. Labels: ``train epoch 3``,
``val epoch 3`` (a second validation run in the same training epoch: ``val epoch 3 run
2``), ``val sanity check`` (the sanity check's workers are real workers, judged like any
other), and ``val epoch 0`` / ``test epoch 0`` / ``predict epoch 0`` outside ``fit``.

When workers start, and why no callback hook alone is early enough: Lightning starts a
loader's workers when it calls ``iter()`` on it, and that comes *before* every callback
hook of the epoch for the first training epoch (``FitLoop.setup_data``, before
``on_train_start``), for every validation run (``EvaluationLoop.reset``, before
``on_validation_start``), and for test and predict runs; the train loaders do not even
exist before that, for any hook to chain a ``worker_init_fn`` into. So the callback
adopts the loaders when Lightning prepares them: from ``setup`` to ``teardown`` it wraps
the trainer's ``strategy.process_dataloader`` (Lightning's own hook for wrapping a loader,
called for every train, val, test and predict loader, flattened out of lists, dicts and
``CombinedLoader``), and gives each DataLoader it sees an instance-level ``_get_iterator``
(the one method ``DataLoader.__iter__`` calls exactly when it starts new workers). That
opens the stage's epoch if none is open, then chains ``leakcheck.worker.teardown.WorkerInit`` in
front of the loader's ``worker_init_fn`` *for that one iterator* (the iterator keeps the
function it was built with; the loader gets its own back at once, Lightning's seeding
function included, which Lightning adds after ``process_dataloader``). ``teardown`` (or
``on_exception``) removes both. An epoch opened there is the one the epoch-start hook
would have opened; later epochs of ``train`` open at ``on_train_epoch_start``, which does
come before their workers start. A loader whose class overrides ``__iter__`` without
``_get_iterator`` is still tracked by epochs and lineage, without exact identities.

Epoch ends: ``on_*_epoch_end`` closes the epoch with the batches counted by the
``on_*_batch_start`` hooks, then judges (a ``LeakError`` raised there, with
``on_leak="raise"``, propagates out of ``trainer.fit``). With ``limit_train_batches``
below the loader's length, Lightning leaves the training iterator unfinished and its
workers alive until the next epoch's ``iter()``, or ``teardown``: seconds later when
checkpoints are saved in between. Those workers are done with their epoch, so the
callback shuts them down at the epoch end, as ``watch()`` does after an early end
(persistent workers are left alone); they would otherwise read as survivors.
``on_exception`` (an exception in a step, a worker, a hook; ``KeyboardInterrupt``, after
which Lightning exits with ``SystemExit``) closes the open epochs with ``exception`` or
``interrupt``, shuts down their workers, closes the trackers and warns (never raises over
the exception on its way out). ``teardown`` at the end of ``fit``, ``validate``, ``test``
or ``predict`` closes the trackers (waiting out the grace period for survivors), keeps
their reports, and judges the whole run.
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
    check_on_leak,
    check_teardown,
    started_mailbox,
)
from leakcheck.core.errors import LeakError, LeakWarning, UsageError
from leakcheck.core.model import MIB, EndReason, Timeline
from leakcheck.judge.report import Report, host_totals, plot_reports, workers_peak_bytes
from leakcheck.judge.verdict import per_pid_bytes_known
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
    """The tracked stage the trainer is running now (None: none of them)."""
    stage = getattr(getattr(trainer, "state", None), "stage", None)
    value = getattr(stage, "value", stage)
    return _STAGE_OF.get(value) if isinstance(value, str) else None


def epoch_scalars(stage: str, timeline: Timeline, leaks_found: int | None) -> dict[str, float]:
    """The scalars logged for a stage's latest epoch, by name (``leakcheck/train/...``).

    A figure that was not read (GPU memory without NVML's per-process attribution, a
    worker's host memory unknown) is left out, never given as 0.
    """
    record = timeline.epochs[-1]
    parents = [p for p in record.processes if p.role == "parent"]
    workers = [p for p in record.processes if p.role == "worker"]
    host = host_totals(record.processes)
    bytes_: dict[str, int | None] = {
        "parent_host_mib": host.parent_bytes,
        "workers_host_mib": host.workers_bytes if host.source is not None else None,
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

    def __init__(self, name: str, tracker: Tracker, mailbox_dir: str | None, on_leak: OnLeak):
        self.name = name
        self.tracker = tracker
        self.mailbox_dir = mailbox_dir
        self.judge = EpochJudge(tracker, on_leak, count=True)  # the logged leak count
        self.open = False
        self.batches = 0
        self.runs_in_epoch: dict[int, int] = {}
        """Validation runs per training epoch, for labels (fit only)."""
        self.iterators: list[weakref.ref[Any]] = []
        """Non-persistent loader iterators started in the open epoch (weak: Lightning drops
        them to shut their workers down, and must still be able to)."""
        self.report: Report | None = None
        """The report kept at close."""

    def release_workers(self) -> None:
        """Shut down the workers of this epoch's non-persistent iterators (idempotent)."""
        for ref in self.iterators:
            iterator = ref()
            # Private, but what the iterator's own __del__ calls; idempotent.
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):
                    shutdown()
        self.iterators.clear()

    def end(self, reason: EndReason, error: str | None) -> bool:
        """Close the open epoch (its workers shut down first); False when none was open."""
        if not self.open:
            return False
        self.release_workers()
        self.open = False
        batches, self.batches = self.batches, 0
        self.tracker.end_epoch(reason, error, batches)
        self.judge.epoch_ended()
        return True


class _IteratorHook:
    """A DataLoader's instance-level ``_get_iterator``: NOTE [lightning epochs]."""

    def __init__(self, callback: LeakCheckCallback, loader: Any, previous: Any) -> None:
        self.callback = callback
        self.loader = weakref.ref(loader)
        self.previous = previous
        """An instance-level ``_get_iterator`` that was there before, if any."""

    def __call__(self) -> Any:
        loader = self.loader()
        if loader is None:  # pragma: no cover - a live loader calls its own method
            raise RuntimeError("leakcheck: the DataLoader of this hook is gone")
        if self.previous is not None:
            make: Callable[[], Any] = self.previous
        else:
            make = type(loader)._get_iterator.__get__(loader)
        return self.callback._start_iterator(loader, make)


class LeakCheckCallback(_CallbackBase):
    """A Lightning callback that reports, per train and validation epoch, who leaked what.

    Each stage (``train``, ``val``, ``test``, ``predict``) gets its own
    :class:`~leakcheck.Tracker`; an epoch is one of Lightning's epochs of that stage (NOTE
    [lightning epochs] says when each opens and closes). Workers report their exact identity
    and, at exit, what the teardown policy freed, through a ``worker_init_fn`` chained in
    front of the loader's own (which still runs). Leaks are announced at epoch ends like
    :func:`leakcheck.watch` does, and the whole run is judged at the end of ``fit``,
    ``validate``, ``test`` or ``predict``, when the reports are kept.

    Args:
        tolerance: Growth below this per epoch is noise (``"16MiB"``, or bytes).
        warmup_epochs: Epochs the growth rule ignores (allocator warm-up).
        grace: Seconds a worker may outlive its epoch before it is a survivor.
        on_leak: ``"warn"`` (a ``LeakWarning`` naming the culprits), ``"raise"`` (a
            ``LeakError`` from the hook, which ``trainer.fit`` raises) or ``"ignore"``
            (only the reports).
        teardown: Workers release their CUDA resources before they exit.
        interval: Seconds between background samples.
        rollup_share: Share of the time the USS reads of the parent and persistent workers
            may take (``watch()``'s).
        copy_tolerance: What each forked worker may copy of the parent's memory before the
            copy-on-read rule calls it a leak (``watch()``'s).

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
    ) -> None:
        super().__init__()
        self._on_leak = check_on_leak(on_leak)
        self._teardown = check_teardown(teardown)
        self._tracker_options: dict[str, Any] = {
            "tolerance": tolerance,
            "warmup_epochs": warmup_epochs,
            "grace": grace,
            "interval": interval,
            "rollup_share": rollup_share,
            "copy_tolerance": copy_tolerance,
        }
        Tracker(**self._tracker_options)  # validates the rest, as watch() does; starts nothing
        self._stages: dict[str, _Stage] = {}
        self._trainer: Any = None
        self._strategy_hook: tuple[Any, Any, Any] | None = None
        """(strategy, our process_dataloader, the instance attribute it replaced or None)."""
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

        After ``fit`` (``validate``, ...) ended, the report kept when its tracker closed;
        during the run, a fresh one (who is alive now, with the closed epochs). A later run
        of the same stage replaces it.

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
        if found.report is not None:
            return found.report
        return found.tracker.report()

    def format(self, *, verbose: bool = False) -> str:
        """Every tracked stage's report (``Report.format``), each named by its loader's hook.

        ``train_dataloader: leakcheck: no leaks in 3 epochs (...)``, then ``val_dataloader:
        ...``: which verdict is whose, train first (``STAGES``' order).
        """
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
        """Each tracked stage's report, named by its loader's hook, train first."""
        tracked = [name for name in STAGES if name in self._stages]
        return [(f"{name}_dataloader", self.report(name)) for name in tracked]

    # --- Lightning hooks: the run ------------------------------------------------------

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
        """End of the run: close the trackers, keep the reports, judge the whole run.

        Raises:
            LeakError: ``on_leak="raise"`` and a leak not raised before was found.

        """
        self._finish(may_raise=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The run is failing: close open epochs with how it ended, then the trackers."""
        if not self._trainer_running():
            return
        reason, error = end_reason_for(exception)
        with self._lock:
            for stage in self._stages.values():
                if not stage.tracker.closed:
                    stage.end(reason, error)
        self._finish(may_raise=False)

    # --- Lightning hooks: epochs -------------------------------------------------------

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open ``train epoch N`` (if its loader's workers did not open it already)."""
        self._epoch_start("train", trainer)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch."""
        self._count("train")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the train epoch and judge it."""
        self._epoch_end("train")

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the validation run's epoch (the sanity check's included)."""
        self._epoch_start("val", trainer)

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch."""
        self._count("val")

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the validation epoch and judge it."""
        self._epoch_end("val")

    def on_test_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the test epoch."""
        self._epoch_start("test", trainer)

    def on_test_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch."""
        self._count("test")

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the test epoch and judge it."""
        self._epoch_end("test")

    def on_predict_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the predict epoch."""
        self._epoch_start("predict", trainer)

    def on_predict_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch."""
        self._count("predict")

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the predict epoch and judge it."""
        self._epoch_end("predict")

    # --- internals ---------------------------------------------------------------------

    def _trainer_running(self) -> bool:
        return self._trainer is not None

    def _stage(self, name: str) -> _Stage:
        """The stage's live tracker, started; a new one where the last run closed it."""
        stage = self._stages.get(name)
        if stage is None or stage.tracker.closed:
            tracker = Tracker(**self._tracker_options)
            stage = _Stage(name, tracker, started_mailbox(tracker), self._on_leak)
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
        if not self._trainer_running():
            return
        with self._lock:
            stage = self._open(name, trainer)
        stage.judge.judge_if_due()  # NOTE [late survivors] in watching.py

    def _epoch_end(self, name: str) -> None:
        with self._lock:
            stage = self._stages.get(name)
            if stage is None or not stage.end("completed", None):
                return
        try:
            stage.judge.judge(may_raise=True)
        finally:
            self._log_epoch(stage)

    def _log_epoch(self, stage: _Stage) -> None:
        """Log the epoch's scalars through the trainer's loggers, on global rank zero only."""
        trainer = self._trainer
        loggers = list(getattr(trainer, "loggers", None) or ())
        if not loggers or not getattr(trainer, "is_global_zero", True):
            return
        step = int(getattr(trainer, "global_step", 0))

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

    def _count(self, name: str) -> None:
        stage = self._stages.get(name)
        if stage is not None and stage.open:
            stage.batches += 1

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
        name = _running_stage(self._trainer) if self._trainer_running() else None
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
            # The kernel sends PR_SET_PDEATHSIG when the thread that started a worker exits
            # (NOTE [teardown policy] in teardown.py).
            installed.death_signal = threading.current_thread() is threading.main_thread()
            loader.worker_init_fn = installed
            try:
                iterator = make()
            finally:
                if loader.worker_init_fn is installed:
                    loader.worker_init_fn = users
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
                stage.end("closed", None)
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
