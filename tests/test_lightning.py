"""LeakCheckCallback on CPU: a real Lightning Trainer, a tiny model, real workers.

NOTE [lightning epochs] in leakcheck/adapters/lightning.py says what is asserted here:
train and validation epochs tracked apart, exact worker identities from the first epoch on,
epoch ends however the run ends.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from leakcheck.core.errors import GPULeakError, GPULeakWarning, UsageError
from leakcheck.core.model import EpochRecord
from leakcheck.judge.report import Report
from leakcheck.track.tracker import Tracker
from leakcheck.worker.teardown import WorkerInit
from tests.polling import wait_for
from tests.pyrun import run_python
from tests.test_dataloader import BAD_OPTIONS

pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install -e '.[dev]'")

import lightning.pytorch as pl

from leakcheck.adapters.lightning import LeakCheckCallback

EPOCHS = 3
TRAIN_BATCHES = 4  # below the loader's 16: Lightning leaves the iterator unfinished
VAL_BATCHES = 2


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Random (x, y) pairs; each item also carries the PID of the process that made it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        x, y = torch.randn(4, generator=generator), torch.randn(1, generator=generator)
        return x, y, torch.tensor(self.pid())

    def pid(self) -> int:
        return os.getpid()


class StartsGrandchild(Pairs):
    """Each worker starts one sleeper that outlives it; items carry the sleeper's PID."""

    def __init__(self) -> None:
        self.sleepers: dict[int, int] = {}

    def pid(self) -> int:
        me = os.getpid()
        if me not in self.sleepers:
            code = "import time; time.sleep(60)  # leakcheck-test-grandchild"
            self.sleepers[me] = subprocess.Popen([sys.executable, "-c", code]).pid
        return self.sleepers[me]


class DictRows(Pairs):
    """Rows as Python dicts built in the parent: item ``i`` reads its sixteenth of them."""

    def __init__(self) -> None:
        self.rows = [{"id": i, "weight": float(i)} for i in range(200_000)]

    def pid(self) -> int:
        return os.getpid()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step = len(self.rows) // 16
        chunk = self.rows[(index % 16) * step : (index % 16 + 1) * step]
        total = sum(row["weight"] for row in chunk)  # each read writes a reference count
        x, y, pid = super().__getitem__(index)
        return x + total * 0.0, y, pid


class Fails(Exception):
    pass


class Tiny(pl.LightningModule):
    """A linear layer on random data; remembers the PIDs its batches carry."""

    def __init__(
        self,
        train: Any = None,
        val: Any = None,
        *,
        persistent: bool = False,
        fail_in: str | None = None,
        fail_with: type[BaseException] = Fails,
        worker_init_fn: Any = None,
    ) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.train_set = train if train is not None else Pairs()
        self.val_set = val if val is not None else Pairs()
        self.persistent = persistent
        self.fail_in = fail_in
        self.fail_with = fail_with
        self.worker_init_fn = worker_init_fn
        self.pids: dict[str, set[int]] = {"train": set(), "val": set()}

    def loader(self, dataset: Any) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=4,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=self.persistent,
            worker_init_fn=self.worker_init_fn,
        )

    def train_dataloader(self) -> Any:
        return self.loader(self.train_set)

    def val_dataloader(self) -> Any:
        return self.loader(self.val_set)

    def step(self, stage: str, batch: Any) -> torch.Tensor:
        x, y, pid = batch
        self.pids[stage] |= {int(p) for p in pid}
        if self.fail_in == stage and self.current_epoch == 1 and not self.trainer.sanity_checking:
            raise self.fail_with(f"failed in {stage}")
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.step("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.step("val", batch)

    def test_dataloader(self) -> Any:
        return self.loader(self.val_set)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(callback: LeakCheckCallback, tmp_path: Path, package: Any = None, **kw: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": EPOCHS,
        "limit_train_batches": TRAIN_BATCHES,
        "limit_val_batches": VAL_BATCHES,
        "num_sanity_val_steps": VAL_BATCHES,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        "default_root_dir": str(tmp_path),
        "callbacks": [callback],
    }
    options.update(kw)
    return (package or pl).Trainer(**options)


@pytest.fixture
def no_leak_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPULeakWarning)
        yield


def labels(report: Report) -> list[str]:
    return [e.label for e in report.epochs]


def seen_pids(report: Report) -> set[int]:
    return {p.key.pid for e in report.epochs for p in e.processes if p.role != "parent"}


def children_of_this_process() -> set[int]:
    tasks = Path("/proc/self/task")
    return {int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()}


def kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("persistent", [False, True])
def test_clean_fit_tracks_train_and_val_epochs_apart(
    persistent: bool, tmp_path: Path, no_leak_warnings: None
) -> None:
    # Every worker exits by the end, as late as a loaded host lets it (Lightning leaves each
    # train iterator unfinished until the next epoch starts): close() waits only for what
    # is still alive.
    callback = LeakCheckCallback(grace=30)
    model = Tiny(persistent=persistent)
    # Children this process already had (an earlier test's multiprocessing resource tracker)
    # are the job's descendants too: the assertions below are about the fit's own processes.
    before = children_of_this_process()
    # This process's heap is the test harness's (an xdist worker's, of every earlier test): the
    # forked workers' garbage collector would copy its pages, a true copy-on-read of 67 MiB once,
    # but not the fit's. Frozen, the collector leaves it alone (the finding's own fix).
    gc.freeze()
    try:
        trainer(callback, tmp_path).fit(model)
    finally:
        gc.unfreeze()

    train, val = callback.report("train"), callback.report("val")
    assert set(callback.reports) == {"train", "val"}
    assert train.leaks == [] and val.leaks == [], train.format() + val.format()
    assert labels(train) == [f"train epoch {n}" for n in range(EPOCHS)]
    assert labels(val) == ["val sanity check"] + [f"val epoch {n}" for n in range(EPOCHS)]
    assert [e.batches for e in train.epochs] == [TRAIN_BATCHES] * EPOCHS
    assert [e.batches for e in val.epochs] == [VAL_BATCHES] * (EPOCHS + 1)
    assert {e.end_reason for e in train.epochs + val.epochs} == {"completed"}

    # Exact identities, from the first epoch on: every worker reported itself.
    train_workers = callback.trackers["train"].worker_keys()
    val_workers = callback.trackers["val"].worker_keys()
    assert len(train_workers) == (2 if persistent else 2 * EPOCHS)
    assert len(val_workers) == (2 if persistent else 2 * (EPOCHS + 1))
    assert {k.pid for k in train_workers} == model.pids["train"]
    assert {k.pid for k in val_workers} == model.pids["val"]
    for report, workers in ((train, train_workers), (val, val_workers)):
        procs = [p for e in report.epochs for p in e.processes if p.key.pid not in before]
        assert {p.role for p in procs if p.role != "parent"} == {"worker"}, report.format()
        assert seen_pids(report) - before == {k.pid for k in workers}
        assert {t.key for t in report.timeline.teardowns} <= set(workers)
    assert train.epochs[0].processes and all(
        p.born_in_epoch for p in train.epochs[0].processes if p.role == "worker"
    )


def test_forked_workers_copying_a_dataset_of_dicts_are_named_in_the_first_epoch(
    tmp_path: Path,
) -> None:
    callback = LeakCheckCallback(grace=0.5, on_leak="ignore", copy_tolerance="8MiB")
    trainer(callback, tmp_path).fit(Tiny(DictRows()))
    train, val = callback.report("train"), callback.report("val")
    (found,) = [f for f in train.leaks if f.rule == "copy-on-read"]
    assert found.epoch == 0 and found.message.startswith("2 forked workers of PID ")
    assert "again in epochs 1-2" in found.message  # per-epoch workers: each epoch again
    assert not [f for f in val.findings if f.rule == "copy-on-read"]  # validation: Pairs


def test_each_epoch_logs_leakcheck_scalars_to_the_trainers_csv_logger(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    callback = LeakCheckCallback(grace=0.5, on_leak="ignore", copy_tolerance="8MiB")
    logger = CSVLogger(tmp_path, name="run")
    trainer(callback, tmp_path, logger=logger).fit(Tiny(DictRows()))

    with open(Path(logger.log_dir, "metrics.csv")) as file:
        rows = list(csv.DictReader(file))
    columns = {c for c in rows[0] if c.startswith("leakcheck/")}
    per_stage = {"leaks", "parent_host_mib", "workers", "workers_host_mib"}
    # No GPU columns on CPU: GPU memory not read is left out, never logged as 0.
    assert columns == {f"leakcheck/{s}/{n}" for s in ("train", "val") for n in per_stage}
    for stage, epochs in (("train", EPOCHS), ("val", EPOCHS + 1)):  # + the sanity check
        logged = [r for r in rows if r[f"leakcheck/{stage}/workers"]]
        assert len(logged) == epochs
        assert {float(r[f"leakcheck/{stage}/workers"]) for r in logged} == {2.0}
        assert all(float(r[f"leakcheck/{stage}/parent_host_mib"]) > 0 for r in logged)
    train_leaks = [float(r["leakcheck/train/leaks"]) for r in rows if r["leakcheck/train/leaks"]]
    assert train_leaks == [1.0] * EPOCHS  # the copy-on-read of DictRows, found in epoch 0
    assert {r["leakcheck/val/leaks"] for r in rows} - {""} == {"0.0"}

    text = callback.format().splitlines()
    assert text[0].startswith("train_dataloader: leakcheck report: ")
    assert text[-1].startswith("val_dataloader: leakcheck: no leaks in 4 epochs")
    pytest.importorskip("matplotlib")
    png = callback.plot(str(tmp_path / "leaks.png"))  # both stages, side by side
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_on_epoch_receives_each_epoch_record_of_every_stage(tmp_path: Path) -> None:
    records: list[EpochRecord] = []
    callback = LeakCheckCallback(grace=0.5, on_leak="ignore", on_epoch=records.append)
    trainer(callback, tmp_path, max_epochs=2).fit(Tiny())

    assert [r.label for r in records] == [
        "val sanity check",
        "val epoch 0",  # validation runs inside the training epoch: it ends first
        "train epoch 0",
        "val epoch 1",
        "train epoch 1",
    ]
    val, train = VAL_BATCHES, TRAIN_BATCHES
    assert [r.batches for r in records] == [val, val, train, val, train]
    assert all(r.end_reason == "completed" for r in records)
    # The train loader's workers, named in their epoch's record.
    assert {p.role for p in records[2].processes} == {"parent", "worker"}


def test_a_bad_on_epoch_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"on_epoch: expected a callable"):
        LeakCheckCallback(on_epoch="print")  # type: ignore[arg-type]


class BlocksAt(Pairs):
    """Item 4 blocks until the file ``release`` exists."""

    def __init__(self, release: str) -> None:
        self.release = release

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        while index == 4 and not os.path.exists(self.release):
            time.sleep(0.01)
        return super().__getitem__(index)


def test_a_stalled_training_epoch_shows_the_blocked_workers_stack(tmp_path: Path) -> None:
    release = tmp_path / "release"
    # Above a slow first batch on a loaded machine, which is a stall too.
    callback = LeakCheckCallback(grace=0.5, on_leak="ignore", hang_after=2.0)

    def hangs() -> list[Any]:
        tracker = callback.trackers.get("train")
        return [] if tracker is None else [f for f in tracker.report().findings if f.rule == "hang"]

    def release_when_shown() -> None:
        wait_for(lambda: any("in __getitem__" in (f.stack or "") for f in hangs()), 120)
        release.touch()

    releaser = threading.Thread(target=release_when_shown)
    releaser.start()
    trainer(callback, tmp_path, max_epochs=1).fit(Tiny(BlocksAt(str(release))))
    releaser.join()

    [finding, *_] = [f for f in callback.report("train").findings if f.rule == "hang"]
    assert "no batch for" in finding.message and "in epoch 0" in finding.message
    assert "in __getitem__" in (finding.stack or "")
    assert [e.batches for e in callback.report("train").epochs] == [TRAIN_BATCHES]
    assert not [f for f in callback.report("val").findings if f.rule == "hang"]


def test_the_hang_watch_is_on_by_default_and_off_with_zero() -> None:
    assert "hang_after=120.0" in repr(LeakCheckCallback())
    assert "hang_after=0" in repr(LeakCheckCallback(hang_after=0))


def test_without_a_logger_no_report_is_built_at_epoch_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    windowed: list[int | None] = []
    report = Tracker.report

    def counting(self: Tracker, **kwargs: Any) -> Report:
        if not kwargs.get("fresh", True):  # the epoch-end judgement's windowed report
            windowed.append(kwargs.get("last_epochs"))
        return report(self, **kwargs)

    monkeypatch.setattr(Tracker, "report", counting)
    callback = LeakCheckCallback(grace=0.5, on_leak="ignore")
    trainer(callback, tmp_path, max_epochs=2).fit(Tiny())  # logger=False
    assert windowed == []
    assert labels(callback.report("train")) == ["train epoch 0", "train epoch 1"]


def test_loaders_and_strategy_get_their_own_back(tmp_path: Path) -> None:
    def user_init(worker_id: int) -> None:
        Path(tmp_path, f"init-{os.getpid()}").write_text(str(worker_id))

    callback = LeakCheckCallback(grace=30)
    train_loader = Tiny(worker_init_fn=user_init).train_dataloader()
    fit = trainer(callback, tmp_path, max_epochs=2, limit_val_batches=0)
    fit.fit(Tiny(), train_dataloaders=train_loader)

    assert train_loader.worker_init_fn is user_init
    assert "_get_iterator" not in vars(train_loader)
    assert "process_dataloader" not in vars(fit.strategy)
    # The user's own worker_init_fn ran in every worker the tracker knows.
    ran = {int(p.name.split("-")[1]) for p in tmp_path.glob("init-*")}
    assert ran == {k.pid for k in callback.trackers["train"].worker_keys()}
    assert set(callback.reports) == {"train"}


def test_the_users_policy_keeps_its_terminate_children(
    tmp_path: Path, no_leak_warnings: None
) -> None:
    policy = WorkerInit(terminate_children=True)
    callback = LeakCheckCallback(grace=30)
    model = Tiny(StartsGrandchild(), worker_init_fn=policy)
    trainer(callback, tmp_path, max_epochs=2, limit_val_batches=0).fit(model)
    kill(model.pids["train"])  # none should be left; a failed assertion must not leak
    assert callback.report("train").leaks == []


def test_combined_loaders_and_lists_of_loaders_are_all_adopted(
    tmp_path: Path, no_leak_warnings: None
) -> None:
    from lightning.pytorch.utilities import CombinedLoader

    class Many(Tiny):
        def train_dataloader(self) -> Any:
            loaders = {"a": self.loader(Pairs()), "b": self.loader(Pairs())}
            return CombinedLoader(loaders, mode="min_size")

        def val_dataloader(self) -> Any:
            return [self.loader(Pairs()), self.loader(Pairs())]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # typeshed: sum() of Tensors may be its start, 0 (never here: two loaders)
            return sum(self.step("train", part) for part in batch.values())  # type: ignore[return-value]

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.step("val", batch)

    callback = LeakCheckCallback(grace=30)
    model = Many()
    trainer(callback, tmp_path, max_epochs=2, num_sanity_val_steps=0).fit(model)
    train, val = callback.report("train"), callback.report("val")
    assert train.leaks == [] and val.leaks == []
    assert labels(val) == ["val epoch 0", "val epoch 1"]
    assert [e.batches for e in val.epochs] == [2 * VAL_BATCHES] * 2
    assert {k.pid for k in callback.trackers["train"].worker_keys()} == model.pids["train"]
    assert len(model.pids["train"]) == 2 * 2 * 2  # 2 loaders x 2 workers x 2 epochs
    assert {k.pid for k in callback.trackers["val"].worker_keys()} == model.pids["val"]
    assert len(model.pids["val"]) == 2 * 2 * 2


def test_an_orphan_of_a_train_worker_is_reported_by_the_train_report_only(
    tmp_path: Path,
) -> None:
    # The orphans live on, and close() waits the grace out for them; the train workers a
    # finished epoch left running (Lightning leaves its iterator unfinished) exit when the
    # next epoch starts, on a loaded host seconds later: 3 s, lest they read as survivors.
    callback = LeakCheckCallback(grace=3.0)
    model = Tiny(StartsGrandchild())
    try:
        with pytest.warns(GPULeakWarning) as caught:
            trainer(callback, tmp_path).fit(model)
    finally:
        kill(model.pids["train"])
    sleepers = model.pids["train"]
    assert len(sleepers) == 2 * EPOCHS
    train, val = callback.report("train"), callback.report("val")
    orphans = {f.pid for f in train.leaks if f.rule == "orphan"}
    assert orphans == sleepers, train.format()
    assert {f.rule for f in train.leaks} == {"orphan"}
    assert not any(f.pid in sleepers for f in val.findings), val.format()
    assert val.leaks == []
    warned = " ".join(str(w.message) for w in caught)
    assert all(str(pid) in warned for pid in sleepers)
    assert "LEAK orphan" in train.format()


def test_on_leak_raise_makes_fit_raise(tmp_path: Path) -> None:
    callback = LeakCheckCallback(grace=3.0, on_leak="raise")  # as in the orphan test above
    model = Tiny(StartsGrandchild())
    try:
        with pytest.raises(GPULeakError) as caught:
            trainer(callback, tmp_path).fit(model)
    finally:
        kill(model.pids["train"])
    assert caught.value.report is not None
    assert {f.pid for f in caught.value.report.leaks} <= model.pids["train"]
    assert caught.value.report.leaks
    # The run's trackers were closed on the way out; the reports were kept.
    assert callback.trackers["train"].closed and callback.trackers["val"].closed
    assert callback.report("train").leaks


@pytest.mark.parametrize("where", ["train", "val"])
def test_an_exception_closes_the_open_epochs(
    where: str, tmp_path: Path, no_leak_warnings: None
) -> None:
    callback = LeakCheckCallback(grace=30)
    with pytest.raises(Fails, match=f"failed in {where}"):
        trainer(callback, tmp_path).fit(Tiny(fail_in=where))
    train, val = callback.report("train"), callback.report("val")
    assert train.leaks == [] and val.leaks == [], train.format() + val.format()
    # Validation runs inside the train epoch: an exception there ends both.
    assert [e.end_reason for e in train.epochs] == ["completed", "exception"]
    assert train.epochs[-1].error == f"Fails: failed in {where}"
    last_val = val.epochs[-1]
    assert last_val.label == ("val epoch 1" if where == "val" else "val epoch 0")
    assert last_val.end_reason == ("exception" if where == "val" else "completed")
    assert train.epochs[-1].batches == (TRAIN_BATCHES if where == "val" else 1)


def test_keyboard_interrupt_in_fit_closes_the_epoch_as_interrupted(tmp_path: Path) -> None:
    callback = LeakCheckCallback(grace=30)
    handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning shuts down gracefully and then exits: SystemExit(1).
        with pytest.raises(SystemExit):
            trainer(callback, tmp_path).fit(Tiny(fail_in="train", fail_with=KeyboardInterrupt))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    train = callback.report("train")
    assert [e.end_reason for e in train.epochs] == ["completed", "interrupt"]
    assert train.epochs[-1].error == "KeyboardInterrupt"
    assert train.leaks == [], train.format()
    assert callback.trackers["train"].closed


def test_validate_and_test_after_fit_get_their_own_reports(
    tmp_path: Path, no_leak_warnings: None
) -> None:
    callback = LeakCheckCallback(grace=30)
    model = Tiny()
    run = trainer(callback, tmp_path, max_epochs=1)
    run.fit(model)
    fit_val = callback.report("val")
    run.validate(model, verbose=False)
    run.test(model, verbose=False)
    assert set(callback.reports) == {"train", "val", "test"}
    assert labels(callback.report("val")) == ["val epoch 0"]  # the validate run replaced fit's
    assert callback.report("val") is not fit_val
    assert labels(callback.report("test")) == ["test epoch 0"]
    assert len(callback.trackers["test"].worker_keys()) == 2
    assert all(r.leaks == [] for r in callback.reports.values())


def test_pytorch_lightning_trainer_works_too(tmp_path: Path, no_leak_warnings: None) -> None:
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as legacy

    class Legacy(legacy.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def train_dataloader(self) -> Any:
            return Tiny().loader(Pairs())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = LeakCheckCallback(grace=30)
    trainer(callback, tmp_path, package=legacy, max_epochs=2).fit(Legacy())
    report = callback.report("train")
    assert labels(report) == ["train epoch 0", "train epoch 1"]
    assert len(callback.trackers["train"].worker_keys()) == 4
    assert report.leaks == []


@pytest.mark.parametrize(("kwargs", "names"), BAD_OPTIONS)
def test_bad_options_are_one_line_usage_errors(
    kwargs: dict[str, Any], names: tuple[str, str]
) -> None:
    with pytest.raises(UsageError) as caught:
        LeakCheckCallback(**kwargs)
    message = str(caught.value)
    assert "\n" not in message
    assert all(name in message for name in names)


def test_report_of_a_stage_not_tracked_is_a_usage_error() -> None:
    callback = LeakCheckCallback()
    with pytest.raises(UsageError, match=r"stage: .*tracked: none yet.*'val'"):
        callback.report("val")
    with pytest.raises(UsageError, match="'training'"):
        callback.report("training")


def test_the_callback_pickles_for_spawned_ranks(tmp_path: Path) -> None:
    callback = LeakCheckCallback(grace=30, on_leak="raise", tolerance="1MiB")
    trainer(callback, tmp_path, max_epochs=1, limit_val_batches=0).fit(Tiny())
    copy = pickle.loads(pickle.dumps(callback))
    assert repr(copy) == repr(callback)
    assert copy.trackers == {} and set(callback.trackers) == {"train"}


def test_two_trainers_in_two_threads_do_not_wait_on_each_other(tmp_path: Path) -> None:
    """One Trainer stuck while its loader's iterator starts holds up no other callback's."""
    entered, go = threading.Event(), threading.Event()

    class WaitsToStart(DataLoader[Any]):
        def _get_iterator(self) -> Any:
            entered.set()
            go.wait(timeout=600)
            return super()._get_iterator()

    class Stuck(Tiny):
        def train_dataloader(self) -> Any:
            return WaitsToStart(self.train_set, batch_size=4)

    class InProcess(Tiny):
        def train_dataloader(self) -> Any:
            return DataLoader(self.train_set, batch_size=4)

    def fit(module: Tiny, folder: str) -> None:
        options = {"max_epochs": 1, "limit_val_batches": 0, "num_sanity_val_steps": 0}
        trainer(LeakCheckCallback(), tmp_path / folder, **options).fit(module)

    stuck = threading.Thread(target=fit, args=(Stuck(), "stuck"), daemon=True)
    other = threading.Thread(target=fit, args=(InProcess(), "other"), daemon=True)
    stuck.start()
    try:
        assert wait_for(entered.is_set, timeout_s=120)
        other.start()
        assert wait_for(lambda: not other.is_alive(), timeout_s=300), "waited on the other"
        assert stuck.is_alive() and not go.is_set()
    finally:
        go.set()
        stuck.join(timeout=300)
    assert not stuck.is_alive()


def test_importing_leakcheck_imports_no_lightning() -> None:
    done = run_python(
        """
        import sys
        import leakcheck, leakcheck.integrations
        from leakcheck import Tracker, watch
        import leakcheck.adapters.plugin, leakcheck.commands.cli
        print(sorted(m for m in sys.modules if "lightning" in m))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_lightning_example_names_each_helper_and_keeps_validation_clean() -> None:
    """The README's Lightning output comes from this example."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), *sys.path])}
    env.pop("LEAKCHECK_SESSION", None)
    done = subprocess.run(
        [sys.executable, str(repo / "examples" / "lightning_helper_leak.py")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2].startswith("leakcheck: 6 leaks in 3 epochs ("), done.stdout
    assert lines[-1].startswith("val_dataloader: leakcheck: no leaks in 4 epochs ("), done.stdout
    assert any(line.startswith("train_dataloader: leakcheck report: ") for line in lines)
    # One fix for the six, which kills them all; a line per epoch that left two.
    (fix,) = [line for line in lines if line.startswith("  fix: ") and " kill " in line]
    assert len(fix.split(" kill ")[1].split()) == 6, done.stdout
    assert 1 <= done.stdout.count("LEAK orphan  ") <= 3, done.stdout


SPAWN_MODEL = """\
import subprocess, sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader


def leave_a_sleep(worker_id):
    # Never waited for: an orphan (holding none of the test's pipes open).
    quiet = subprocess.DEVNULL
    sleeper = subprocess.Popen(["sleep", "120"], stdout=quiet, stderr=quiet)
    with open(sys.argv[1], "a") as handle:
        handle.write(f"{sleeper.pid}\\n")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(8, 4), batch_size=4, num_workers=1,
                          worker_init_fn=leave_a_sleep)
"""

SPAWN_FIT = """\
if __name__ == "__main__":
    # Lightning is imported here and in spawnmodel.py alone: each spawned DataLoader worker
    # imports this file again.
    import lightning.pytorch as pl
    from spawnmodel import Tiny

    from leakcheck.integrations.lightning import LeakCheckCallback

    pl.Trainer(
        strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[LeakCheckCallback(grace=0.5)],
    ).fit(Tiny())
"""


def test_a_ddp_spawn_rank_names_its_rank_in_what_its_workers_left(tmp_path: Path) -> None:
    """A ``ddp_spawn`` rank has no launcher variable naming it: the callback exports the
    trainer's rank (NOTE [exported rank]), so each rank's warning says whose orphan it is."""
    import psutil

    (tmp_path / "fit.py").write_text(SPAWN_FIT)
    (tmp_path / "spawnmodel.py").write_text(SPAWN_MODEL)
    pids = tmp_path / "sleepers"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEAKCHECK_")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            [sys.executable, "fit.py", str(pids)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for line in pids.read_text().split() if pids.exists() else []:
            with contextlib.suppress(psutil.Error):
                sleeper = psutil.Process(int(line))
                if sleeper.name() == "sleep":  # still ours, not a reused PID
                    sleeper.kill()
    assert done.returncode == 0, done.stderr
    # One warning per rank, each naming its own rank's orphan.
    said = re.findall(r"LEAK orphan  (rank \d+ )?sleep 120", done.stderr)
    assert sorted(said) == ["rank 0 ", "rank 1 "], done.stderr
