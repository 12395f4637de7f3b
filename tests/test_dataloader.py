"""leakcheck.watch on CPU: real DataLoaders with real workers (NOTE [epoch ends])."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import leakcheck
from leakcheck.adapters import dataloader
from leakcheck.adapters.dataloader import WatchedLoader
from leakcheck.core.errors import GPULeakError, GPULeakWarning, UsageError
from leakcheck.core.model import EpochRecord
from leakcheck.track import sampler
from leakcheck.worker.teardown import WorkerInit


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, index * index])


class FailsAt(Squares):
    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise ValueError("bad sample 5")
        return super().__getitem__(index)


class StartsGrandchild(Squares):
    """Each worker starts one sleeper that outlives it; items carry the sleeper's PID."""

    def __init__(self) -> None:
        self.sleepers: dict[int, int] = {}

    def __getitem__(self, index: int) -> torch.Tensor:
        me = os.getpid()
        if me not in self.sleepers:
            code = "import time; time.sleep(60)  # leakcheck-test-grandchild"
            self.sleepers[me] = subprocess.Popen([sys.executable, "-c", code]).pid
        return torch.tensor([self.sleepers[me]])


class InterruptAfter(Sampler[int]):
    """Index stream of the parent that is interrupted, as by Ctrl-C, after ``count``."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> Iterator[int]:
        yield from range(self.count)
        raise KeyboardInterrupt

    def __len__(self) -> int:
        return 12


def touch(folder: str, worker_id: int) -> None:
    Path(folder, f"init-{worker_id}").write_text(str(os.getpid()))


def make(dataset: Any = None, *, workers: int = 2, context: str = "fork", **kw: Any) -> Any:
    return DataLoader(
        dataset if dataset is not None else Squares(),
        batch_size=3,
        num_workers=workers,
        multiprocessing_context=context if workers else None,
        **kw,
    )


def run_epochs(watched: WatchedLoader[Any], epochs: int) -> list[list[torch.Tensor]]:
    return [list(watched) for _ in range(epochs)]


@pytest.fixture
def no_leak_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPULeakWarning)
        yield


@pytest.mark.parametrize(
    ("context", "persistent"), [("fork", False), ("fork", True), ("spawn", True)]
)
def test_clean_loader_has_no_findings_over_5_epochs(
    context: str, persistent: bool, no_leak_warnings: None
) -> None:
    with leakcheck.watch(make(context=context, persistent_workers=persistent)) as watched:
        batches = run_epochs(watched, 5)
    report = watched.report()
    assert report.leaks == []
    assert [e.end_reason for e in report.epochs] == ["completed"] * 5
    assert all(len(epoch) == 4 for epoch in batches)
    workers = watched.tracker.worker_keys()
    assert len(workers) == (2 if persistent else 10)
    assert {t.key for t in report.timeline.teardowns} <= set(workers)


def test_batches_are_those_of_the_raw_loader() -> None:
    raw = [batch.clone() for batch in make(workers=2)]
    with leakcheck.watch(make(workers=2)) as watched:
        seen = list(watched)
    assert len(seen) == len(raw) == 4
    assert all(torch.equal(a, b) for a, b in zip(raw, seen, strict=True))


def test_the_wrapper_looks_like_the_loader() -> None:
    loader = make(workers=2, persistent_workers=True)
    watched = leakcheck.watch(loader)
    assert len(watched) == len(loader) == 4
    assert watched.batch_size == 3 and watched.num_workers == 2
    assert watched.dataset is loader.dataset and watched.persistent_workers is True
    with pytest.raises(AttributeError):
        watched.no_such_attribute  # noqa: B018
    watched.close()


def test_user_worker_init_fn_runs_and_is_restored(tmp_path: Path) -> None:
    user_fn = functools.partial(touch, str(tmp_path))
    loader = make(workers=2, worker_init_fn=user_fn)
    watched = leakcheck.watch(loader)
    list(watched)
    # NOTE [iterator policy]: the loader has its own back as soon as the workers started.
    assert loader.worker_init_fn is user_fn
    watched.close()
    assert loader.worker_init_fn is user_fn
    pids = {int(p.read_text()) for p in tmp_path.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init-0", "init-1"]
    assert {key.pid for key in watched.tracker.worker_keys()} == pids


def test_persistent_workers_started_from_a_thread_outlive_it(no_leak_warnings: None) -> None:
    # The kernel sends PR_SET_PDEATHSIG when the thread that started a worker exits.
    lengths: list[int] = []
    with leakcheck.watch(make(workers=2, persistent_workers=True), grace=30) as watched:
        thread = threading.Thread(target=lambda: lengths.append(len(list(watched))))
        thread.start()
        thread.join()
        lengths.append(len(list(watched)))  # the same workers, their starter thread gone
    assert lengths == [4, 4]
    assert len(watched.tracker.worker_keys()) == 2
    assert [e.end_reason for e in watched.report().epochs] == ["completed"] * 2


def test_break_closes_the_epoch_and_the_next_one_runs(no_leak_warnings: None) -> None:
    # The abandoned epoch's workers exit after its end, as late as a loaded host makes them:
    # a grace that covers it, and close() waits only for what is still alive.
    with leakcheck.watch(make(workers=2), grace=30) as watched:
        for _ in watched:
            break
        assert len(list(watched)) == 4
    report = watched.report()
    assert [e.end_reason for e in report.epochs] == ["break", "completed"]
    assert report.leaks == []  # the abandoned epoch's workers were shut down


def test_on_epoch_receives_each_epochs_record_as_it_ends(no_leak_warnings: None) -> None:
    records: list[EpochRecord] = []
    seen_at_end: list[int] = []

    def on_epoch(record: EpochRecord) -> None:
        records.append(record)
        seen_at_end.append(len(batches))

    batches: list[torch.Tensor] = []
    with leakcheck.watch(make(workers=2), grace=30, on_epoch=on_epoch) as watched:
        for _ in range(2):
            batches.extend(watched)
        for batch in watched:
            batches.append(batch)
            break
    assert [(r.index, r.end_reason, r.batches) for r in records] == [
        (0, "completed", 4),
        (1, "completed", 4),
        (2, "break", 1),
    ]
    assert seen_at_end == [4, 8, 9]  # called as each epoch ended, not at close
    workers = {p.key for r in records for p in r.processes if p.role == "worker"}
    assert len(workers) == 6 and workers == set(watched.tracker.worker_keys())


def test_an_on_epoch_that_raises_is_warned_about_and_the_loop_goes_on(
    no_leak_warnings: None,
) -> None:
    def on_epoch(record: EpochRecord) -> None:
        raise ValueError(f"logger down in epoch {record.index}")

    watched = leakcheck.watch(make(workers=0), on_epoch=on_epoch)
    with pytest.warns(RuntimeWarning) as caught, watched:
        epochs = run_epochs(watched, 2)
    assert [str(w.message) for w in caught] == [
        f"leakcheck: on_epoch raised ValueError: logger down in epoch {n}; the loop goes on"
        for n in (0, 1)
    ]
    assert [len(epoch) for epoch in epochs] == [4, 4]
    assert [e.end_reason for e in watched.report().epochs] == ["completed"] * 2
    with pytest.raises(UsageError, match="on_epoch: expected a callable"):
        leakcheck.watch(make(workers=0), on_epoch=42)  # type: ignore[arg-type]


def test_worker_exception_closes_the_epoch_and_is_reraised(no_leak_warnings: None) -> None:
    watched = leakcheck.watch(make(FailsAt(), workers=2), grace=30)  # as in the break test
    with pytest.raises(ValueError, match="bad sample 5"):
        list(watched)
    watched.close()
    report = watched.report()
    (epoch,) = report.epochs
    assert epoch.end_reason == "exception"
    assert epoch.error is not None and "ValueError" in epoch.error and "\n" not in epoch.error
    assert report.leaks == []


def test_keyboard_interrupt_closes_the_epoch(no_leak_warnings: None) -> None:
    watched = leakcheck.watch(make(workers=2, sampler=InterruptAfter(4)), grace=30)
    with pytest.raises(KeyboardInterrupt):
        list(watched)
    watched.close()
    report = watched.report()
    assert [e.end_reason for e in report.epochs] == ["interrupt"]
    assert report.leaks == []


def _leave_in_body(watched: WatchedLoader[Any], how: str) -> None:
    for epoch in range(2):
        for index, _ in enumerate(watched):
            if epoch == 1 and index == 1:
                if how == "break":
                    break
                raise KeyboardInterrupt if how == "interrupt" else RuntimeError("bad step")


@pytest.mark.parametrize(
    ("how", "reason", "error"),
    [
        ("break", "break", None),
        ("raise", "exception", "RuntimeError: bad step"),
        ("interrupt", "interrupt", "KeyboardInterrupt"),
    ],
)
def test_an_error_in_the_loop_body_ends_the_epoch_by_it_not_by_a_break(
    how: str, reason: str, error: str | None, no_leak_warnings: None
) -> None:
    # The generator is only closed as the error unwinds the loop's frame; `with` names it.
    watched = leakcheck.watch(make(workers=2), grace=30)
    with contextlib.suppress(KeyboardInterrupt, RuntimeError), watched:
        _leave_in_body(watched, how)
    epochs = watched.report().epochs
    assert [(e.end_reason, e.error) for e in epochs] == [("completed", None), (reason, error)]


def test_epochs_ended_by_errors_the_program_caught_are_not_named_by_a_later_one(
    no_leak_warnings: None,
) -> None:
    # An error each epoch that the loop's own code catches, then one that escapes: only its
    # epoch is named by it, and nothing is kept for the caught ones.
    watched = leakcheck.watch(make(workers=0), grace=30)

    def leave(error: Exception) -> None:
        for _batch in watched:
            raise error

    with contextlib.suppress(ValueError), watched:
        for _ in range(50):
            with contextlib.suppress(RuntimeError):
                leave(RuntimeError("caught"))
        leave(ValueError("uncaught"))
    errors = [(e.end_reason, e.error) for e in watched.report().epochs]
    assert errors == [("exception", None)] * 50 + [("exception", "ValueError: uncaught")]
    assert not dataloader._unnamed


def test_a_break_over_a_generator_of_the_loader_is_a_break(no_leak_warnings: None) -> None:
    # The generator's frame unwinds the GeneratorExit its close threw in at its `yield`.
    watched = leakcheck.watch(make(workers=2), grace=30)

    def batches() -> Iterator[Any]:
        yield from (batch for batch in watched)  # a loop over the loader, in a generator

    def own_batches() -> Iterator[Any]:
        for batch in watched:
            yield [tensor * 2 for tensor in batch]  # a step per batch

    with watched:
        for wrapped in (batches, own_batches):
            for index, _ in enumerate(wrapped()):
                if index == 1:
                    break
    assert [e.end_reason for e in watched.report().epochs] == ["break", "break"]


def test_iterator_collected_by_gc_closes_the_epoch() -> None:
    watched = leakcheck.watch(make(workers=0), grace=0.3)
    iterator = iter(watched)
    next(iterator)
    cycle: list[Any] = [iterator]
    cycle.append(cycle)
    del iterator, cycle
    gc.collect()
    watched.close()
    assert [e.end_reason for e in watched.report().epochs] == ["collected"]


def test_a_kept_iterator_dropped_later_ends_only_its_own_epoch(no_leak_warnings: None) -> None:
    """A peek at the first batch, its iterator kept: the next loop closes the peek's epoch,
    and dropping the kept iterator in the middle of a later epoch leaves that one running."""
    counts: list[int] = []
    # The peek's workers outlive its epoch until the kept iterator is dropped, after epoch
    # 1's first batch (a second or more on a loaded host): a grace that covers it, and
    # ``close()`` does not wait for it, every worker having exited by then.
    with leakcheck.watch(make(workers=2), grace=30) as watched:
        kept: Iterator[torch.Tensor] | None = iter(watched)
        assert kept is not None
        next(kept)
        for epoch in range(3):
            count = 0
            for _ in watched:
                count += 1
                if epoch == 1 and count == 1:
                    kept = None  # the kept iterator is finalized here
            counts.append(count)
    epochs = watched.report().epochs
    assert counts == [4, 4, 4]
    assert [(e.end_reason, e.batches) for e in epochs] == [("closed", None)] + [
        ("completed", 4)
    ] * 3


class KeepsTenMiBPerItem(Squares):
    """Each worker keeps 10 MiB of its own, touched, per item: host growth, as copy-on-read."""

    kept: ClassVar[list[bytearray]] = []

    def __getitem__(self, index: int) -> torch.Tensor:
        block = bytearray(10 * 1024 * 1024)
        block[::4096] = b"\x01" * len(block[::4096])
        self.kept.append(block)
        return super().__getitem__(index)


def test_a_host_growth_warning_gives_the_figures_of_the_final_report() -> None:
    """The epoch end that makes the warning planned a USS read: the warning waits for it,
    instead of judging on resident memory what the report later judges on USS."""
    loader = make(KeepsTenMiBPerItem(), workers=2, persistent_workers=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with leakcheck.watch(loader, grace=30) as watched:
            for _ in range(4):
                run_epochs(watched, 1)
    said = [str(w.message) for w in caught if isinstance(w.message, GPULeakWarning)]
    final = [f for f in watched.report().leaks if f.rule == "host-growth"]
    assert len(final) == 2, watched.report().format()
    lines = watched.report().finding_lines(final, indent="  ")  # grouped, as the report does
    assert len(said) == 1 and all(line in said[0] for line in lines), (said, lines)
    assert all("host memory (USS) grows" in f.message for f in final)


def test_dropped_wrapper_stops_its_tracker() -> None:
    loader = make(workers=2)
    watched = leakcheck.watch(loader, grace=0.3)
    list(watched)
    tracker = watched.tracker
    del watched
    gc.collect()
    assert tracker.closed
    assert not isinstance(loader.worker_init_fn, WorkerInit)


def kill_sleepers(pids: list[int]) -> None:
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if "leakcheck-test-grandchild" in " ".join(proc.cmdline()):
                proc.kill()
        except psutil.Error:
            pass


def sleeper_pids(batches: list[torch.Tensor]) -> list[int]:
    return sorted({int(pid) for batch in batches for pid in batch.flatten()})


def test_grandchild_outliving_its_worker_is_named() -> None:
    watched = leakcheck.watch(make(StartsGrandchild(), workers=2), grace=0.3, on_leak="ignore")
    sleepers = sleeper_pids(list(watched))
    try:
        watched.close()
        report = watched.report()
        named = {f.pid: f for f in report.leaks if f.rule in ("orphan", "survivor")}
        assert None not in named
        assert sorted(pid for pid in named if pid is not None) == sleepers
        for finding in named.values():
            assert finding.cmdline is not None and "leakcheck-test-grandchild" in finding.cmdline
            assert str(finding.pid) in finding.message
    finally:
        kill_sleepers(sleepers)


def test_on_leak_warn_names_the_culprits_as_the_report_does() -> None:
    """One line per group of alike findings and one fix, not every message on one line."""
    watched = leakcheck.watch(make(StartsGrandchild(), workers=2), grace=0.3)
    with pytest.warns(GPULeakWarning) as caught:
        sleepers = sleeper_pids(list(watched))
        try:
            watched.close()
        finally:
            kill_sleepers(sleepers)
    (text,) = [str(w.message) for w in caught]
    head, *lines = text.splitlines()
    assert head == "leakcheck: 2 leaks after epoch 0:", text
    assert lines[0].startswith("  LEAK orphan  2 \u00d7 python -c"), text
    assert lines[-1].startswith("    fix: ") and len(lines) == 2, text
    assert all(str(pid) in lines[-1] for pid in sleepers), text


def test_on_leak_raise_carries_the_report() -> None:
    watched = leakcheck.watch(make(StartsGrandchild(), workers=1), grace=0.3, on_leak="raise")
    sleepers: list[int] = []
    try:
        with pytest.raises(GPULeakError) as caught:
            for batch in watched:
                sleepers = sleeper_pids([batch])
            watched.close()
    finally:
        kill_sleepers(sleepers)
    assert caught.value.report is not None
    assert [f.pid for f in caught.value.report.leaks] == sleepers
    watched.close()  # idempotent, nothing left to raise


BAD_OPTIONS: list[tuple[dict[str, Any], tuple[str, str]]] = [
    ({"tolerance": "lots"}, ("tolerance", "'lots'")),
    ({"on_leak": "explode"}, ("on_leak", "'explode'")),
    ({"warmup_epochs": -1}, ("warmup_epochs", "-1")),
    ({"warmup_epochs": 1.5}, ("warmup_epochs", "1.5")),
    ({"grace": -1}, ("grace", "-1")),
    ({"interval": 0}, ("interval", "0")),
    ({"teardown": "yes"}, ("teardown", "'yes'")),
    ({"rollup_share": 5}, ("rollup_share", "5")),
]
"""Bad options of ``watch()`` (and of the Lightning callback, which takes the same), with
the words each one-line error must name."""


@pytest.mark.parametrize(("kwargs", "names"), BAD_OPTIONS)
def test_bad_arguments_are_one_line_usage_errors(
    kwargs: dict[str, Any], names: tuple[str, str]
) -> None:
    with pytest.raises(UsageError) as caught:
        leakcheck.watch(make(workers=0), **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    assert all(name in message for name in names)


def test_a_non_iterable_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="loader: expected an iterable"):
        leakcheck.watch(42)  # type: ignore[arg-type]


def test_watch_keeps_the_users_terminate_children(no_leak_warnings: None) -> None:
    policy = leakcheck.worker_init_fn(terminate_children=True)
    loader = make(StartsGrandchild(), workers=2, worker_init_fn=policy)
    with leakcheck.watch(loader, grace=30) as watched:
        sleepers = sleeper_pids(list(watched))
    try:
        assert watched.report().leaks == []
        assert loader.worker_init_fn is policy
        assert not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in sleepers
        )
    finally:
        kill_sleepers(sleepers)


class StartsChildOnce(Squares):
    """The first item starts a sleeper in the loading process (num_workers=0)."""

    def __init__(self) -> None:
        self.sleeper: subprocess.Popen[bytes] | None = None

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.sleeper is None:
            code = "import time; time.sleep(60)  # leakcheck-test-grandchild"
            self.sleeper = subprocess.Popen([sys.executable, "-c", code])
        return super().__getitem__(index)


@pytest.mark.parametrize("sampler_thread", [True, False])
def test_survivor_of_an_epoch_is_raised_when_the_next_epoch_starts(
    monkeypatch: pytest.MonkeyPatch, sampler_thread: bool
) -> None:
    """Judged on a walk the next epoch's start takes: without it, a sampler thread that had
    not walked since the grace ended (here: none at all) left the survivor undecided."""
    if not sampler_thread:
        monkeypatch.setattr(sampler.Sampler, "_start_thread", lambda self: None)
    dataset = StartsChildOnce()
    watched = leakcheck.watch(make(dataset, workers=0), grace=0.2, on_leak="raise")
    try:
        list(watched)  # the survivor cannot be judged yet: no error, no wait
        time.sleep(0.5)  # the grace period passes between epochs
        with pytest.raises(GPULeakError) as caught:
            list(watched)
        assert dataset.sleeper is not None
        assert caught.value.report is not None
        assert [(f.rule, f.pid) for f in caught.value.report.leaks] == [
            ("survivor", dataset.sleeper.pid)
        ]
        assert len(watched.report().epochs) == 1  # raised before epoch 1 began
    finally:
        if dataset.sleeper is not None:
            dataset.sleeper.kill()
            dataset.sleeper.wait()
    watched.close()


def test_epoch_ends_judge_a_window_and_close_judges_the_whole_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [judged window]: an epoch end judges the latest epochs only; close() all."""
    from leakcheck.adapters import dataloader as watching
    monkeypatch.setattr(watching, "JUDGED_EPOCHS", 1)
    dataset = StartsChildOnce()
    watched = leakcheck.watch(make(dataset, workers=0), grace=0.2, on_leak="raise")
    try:
        list(watched)  # epoch 0 starts the survivor
        list(watched)  # epoch 1, then the grace period passes
        time.sleep(0.5)
        list(watched)  # judged at its start and end: only epoch 1, then epoch 2
        assert len(watched.report().epochs) == 3  # report() judges everything
        assert [f.rule for f in watched.report().leaks] == ["survivor"]
        with pytest.raises(GPULeakError) as caught:
            watched.close()  # the whole run: epoch 0's survivor
        assert dataset.sleeper is not None
        assert caught.value.report is not None
        assert [(f.rule, f.pid, f.epoch) for f in caught.value.report.leaks] == [
            ("survivor", dataset.sleeper.pid, 0)
        ]
    finally:
        if dataset.sleeper is not None:
            dataset.sleeper.kill()
            dataset.sleeper.wait()


class WorkerPids(Dataset[torch.Tensor]):
    """Items carry the PID of the process that made them."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getpid()])


def _pids(batches: list[torch.Tensor]) -> set[int]:
    return {int(pid) for batch in batches for pid in batch.flatten().tolist()}


@pytest.mark.parametrize(
    ("context", "val_persistent", "val_inside"),
    [
        ("fork", False, True),
        ("fork", True, True),
        ("fork", False, False),
        ("fork", True, False),
        ("spawn", True, True),
    ],
)
def test_train_and_val_loaders_judge_only_their_own_workers(
    context: str, val_persistent: bool, val_inside: bool, no_leak_warnings: None
) -> None:
    """NOTE [claims]: a validation loader run inside (or after) the training epoch; each
    tracker sees its own workers, none calls the other's healthy workers survivors."""
    # Healthy workers exit as late as a loaded host lets them: a grace close() waits out
    # for them only; what would be another's shows in the epochs' processes (asserted below).
    train = leakcheck.watch(
        make(WorkerPids(), workers=2, context=context), on_leak="raise", grace=30
    )
    val = leakcheck.watch(
        make(WorkerPids(), workers=1, context=context, persistent_workers=val_persistent),
        on_leak="raise",
        grace=30,
    )
    train_pids: set[int] = set()
    val_pids: set[int] = set()
    with train, val:
        for _ in range(2):
            for index, batch in enumerate(train):
                train_pids |= _pids([batch])
                if val_inside and index == 0:
                    val_pids |= _pids(list(val))
            if not val_inside:
                val_pids |= _pids(list(val))
    assert train_pids and val_pids and not train_pids & val_pids
    for watched, own, other in ((train, train_pids, val_pids), (val, val_pids, train_pids)):
        report = watched.report()
        assert report.leaks == [], report.format()
        seen = {p.key.pid for e in report.epochs for p in e.processes if p.role != "parent"}
        assert seen & own == own
        assert not seen & other, (seen, other)


def test_an_orphan_is_reported_by_its_own_loader_only() -> None:
    leaky = leakcheck.watch(make(StartsGrandchild(), workers=1), on_leak="ignore", grace=0.5)
    clean = leakcheck.watch(make(Squares(), workers=1), on_leak="ignore", grace=0.5)
    sleepers: set[int] = set()
    try:
        with leaky, clean:
            for batch in leaky:
                sleepers |= _pids([batch])
                list(clean)
            assert sleepers
            # The worker exits at the epoch end; its sleeper is reparented away.
            time.sleep(0.3)
        leaky_report, clean_report = leaky.report(), clean.report()
    finally:
        for pid in sleepers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    orphans = {f.pid for f in leaky_report.leaks if f.rule == "orphan"}
    assert orphans == sleepers, leaky_report.format()
    assert not any(f.pid in sleepers for f in clean_report.findings), clean_report.format()


def test_an_exhausted_iterable_says_so_instead_of_recording_empty_epochs() -> None:
    """A generator can be iterated once: watch() says so when a later epoch yields nothing."""
    watched = leakcheck.watch((torch.tensor([i]) for i in range(3)), on_leak="ignore")
    with watched:
        assert len(list(watched)) == 3
        with pytest.warns(UserWarning, match="yielded no batches.*exhausted"):
            assert list(watched) == []
    assert [e.batches for e in watched.report().epochs] == [3, 0]


class StartsAHelper(Dataset[int]):
    """Each worker starts a helper nobody reaps and leaves its PID as a file's name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.helper: subprocess.Popen[bytes] | None = None

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        if self.helper is None:
            self.helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            (self.folder / str(self.helper.pid)).touch()
        return index


def test_orphans_found_epochs_late_are_named_with_the_epoch_they_started_in(
    tmp_path: Path,
) -> None:
    """Epochs of a fraction of a second: a helper is seen outside the tree only epochs after
    its worker started it; "started in" names the epoch its create time falls in."""
    loader = leakcheck.watch(
        DataLoader(StartsAHelper(tmp_path), num_workers=1), on_leak="ignore", grace=0.3
    )
    born: dict[int, int] = {}
    try:
        for epoch in range(6):
            for _ in loader:
                pass
            for name in os.listdir(tmp_path):
                born.setdefault(int(name), epoch)
        loader.close()
        orphans = {f.pid: f.message for f in loader.report().leaks if f.rule == "orphan" and f.pid}
        assert sorted(orphans) == sorted(born), loader.report().format()
        for pid, epoch in born.items():
            message = orphans[pid]  # the epoch it left the tree in, where it started in it
            assert f"since epoch {epoch}," in message or f"started in epoch {epoch}, " in message
    finally:
        for pid in born:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


@pytest.mark.parametrize("close_order", ["made", "reverse"])
def test_two_wrappers_of_one_loader_closed_in_either_order_leave_nothing(
    close_order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader gets its own worker_init_fn back and the process its variables, whichever
    wrapper closes first (a hook or a session tag of a closed wrapper points at a mailbox
    that is gone)."""
    monkeypatch.delenv("LEAKCHECK_SESSION", raising=False)
    monkeypatch.delenv("LEAKCHECK_MAILBOX", raising=False)

    def own_init(worker_id: int) -> None:
        pass

    loader = make(workers=1, worker_init_fn=own_init)
    first = leakcheck.watch(loader, on_leak="ignore", grace=0.1)
    second = leakcheck.watch(loader, on_leak="ignore", grace=0.1)
    for _ in first:
        pass
    for _ in second:
        pass
    for wrapper in [first, second] if close_order == "made" else [second, first]:
        wrapper.close()
    assert loader.worker_init_fn is own_init
    assert "LEAKCHECK_SESSION" not in os.environ
    assert "LEAKCHECK_MAILBOX" not in os.environ


def test_a_wrapper_of_a_wrapper_sets_nothing_on_the_inner_one() -> None:
    inner = leakcheck.watch(make(workers=1), on_leak="ignore", grace=0.1)
    outer = leakcheck.watch(inner, on_leak="ignore", grace=0.1)
    for _ in outer:
        pass
    outer.close()
    inner.close()
    assert "worker_init_fn" not in vars(inner)


class _LazyLoader(DataLoader):  # type: ignore[type-arg]
    """A subclass whose ``__iter__`` is a generator: its workers start at the first batch."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        yield from super().__iter__()


def _assert_both_ran_in_the_two_workers(watched: Any, touched: Path) -> None:
    """The user's worker_init_fn ran in two workers (``touch`` files), and the policy in front
    of it: those workers reported themselves to the mailbox."""
    pids = {int(p.read_text()) for p in touched.iterdir()}
    assert len(pids) == 2
    assert {key.pid for key in watched.tracker.worker_keys()} == pids


def test_a_generator_iter_gets_the_policy_until_its_workers_started(tmp_path: Path) -> None:
    user_fn = functools.partial(touch, str(tmp_path))
    loader = _LazyLoader(Squares(), batch_size=3, num_workers=2, worker_init_fn=user_fn)
    with leakcheck.watch(loader) as watched:
        assert len(list(watched)) == 4
        assert loader.worker_init_fn is user_fn
    _assert_both_ran_in_the_two_workers(watched, tmp_path)


def test_a_loader_that_accelerate_prepared_gets_the_policy_in_its_workers(
    tmp_path: Path,
) -> None:
    """``accelerator.prepare(loader)`` wraps the DataLoader (attributes read through, not set):
    the policy goes on the DataLoader inside, so each worker reports itself."""
    needs = "needs accelerate: pip install -e '.[dev]'"
    accelerate = pytest.importorskip("accelerate", reason=needs)
    user_fn = functools.partial(touch, str(tmp_path))
    made = DataLoader(Squares(), batch_size=3, num_workers=2, worker_init_fn=user_fn)
    loader = accelerate.Accelerator(cpu=True).prepare(made)
    with leakcheck.watch(loader) as watched:
        assert len(list(watched)) == 4
    assert loader.worker_init_fn is user_fn
    _assert_both_ran_in_the_two_workers(watched, tmp_path)
