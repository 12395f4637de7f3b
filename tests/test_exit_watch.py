"""A worker that does not exit at its loader's shutdown: its stacks, said (``shutdown-hang``).

Real DataLoaders with real forked workers: the iterator's own shutdown joins each worker for
torch's 5 s, then terminates it (NOTE [exit watch] in hang.py).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import leakcheck
from leakcheck.judge.stories import STORIES
from tests.polling import wait_for
from tests.test_run import leakcheck_run, private_tmp  # noqa: F401 - a fixture


class SlowTail(Dataset[int]):
    """Items from ``first_slow`` on take a minute, each first touching ``marker``: a worker
    prefetching them is stuck (a loop that breaks before one started would stop it)."""

    def __init__(self, marker: Path, first_slow: int = 4) -> None:
        self.marker = marker
        self.first_slow = first_slow

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        if index >= self.first_slow:
            self.marker.touch()
            time.sleep(60)  # the long read
        return index


def _blocks_forever() -> None:
    time.sleep(60)  # the non-daemon thread's work


def _start_blocking_thread(worker_id: int) -> None:
    threading.Thread(target=_blocks_forever, name="blocker").start()


def _stuck(report: leakcheck.Report) -> list[Any]:
    return [f for f in report.findings if f.rule == "shutdown-hang"]


def test_a_worker_in_a_long_getitem_at_an_early_break_has_its_stack_said(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "slow"
    loader = leakcheck.watch(
        DataLoader(SlowTail(marker), batch_size=2, num_workers=1, collate_fn=list),
        on_leak="ignore",
    )
    for batch in loader:
        assert batch == [0, 1]
        assert wait_for(marker.exists, timeout_s=120)  # the worker is in item 4 now
        break
    loader.close()
    [worker] = loader.tracker.worker_keys()
    [finding] = _stuck(loader.report())
    assert finding.pid == worker.pid and finding.epoch == 0
    assert "did not exit within 5 s" in finding.message
    assert "terminated in __getitem__ (test_exit_watch.py:" in finding.message
    assert "in __getitem__" in (finding.stack or "")
    assert f"DataLoader worker PID {worker.pid} did not exit" in capfd.readouterr().err


def test_a_worker_held_by_a_non_daemon_thread_has_that_threads_stack_said(tmp_path: Path) -> None:
    loader = leakcheck.watch(
        DataLoader(
            SlowTail(tmp_path / "slow", first_slow=64),  # never slow
            batch_size=2,
            num_workers=1,
            worker_init_fn=_start_blocking_thread,
        ),
        on_leak="ignore",
    )
    for _batch in loader:
        pass
    loader.close()
    [finding] = _stuck(loader.report())
    assert "in _blocks_forever" in (finding.stack or "")  # the thread that holds the exit
    assert "in _shutdown" in (finding.stack or "")  # the main thread waits for it
    assert "non-daemon thread" in finding.remedy


class FillsAQueue(Dataset[int]):
    """Each worker puts 4 MiB into a queue nobody reads: its exit waits for the flush."""

    def __init__(self) -> None:
        self.queue: Any = torch.multiprocessing.get_context("fork").Queue()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 0:
            self.queue.put(b"x" * (4 << 20))  # more than a pipe holds
        return index


def test_a_worker_held_by_its_queues_flush_at_exit_has_that_stack_said() -> None:
    """Steps after leakcheck's teardown (a queue's flush) still show their stacks."""
    loader = leakcheck.watch(
        DataLoader(FillsAQueue(), batch_size=2, num_workers=1), on_leak="ignore"
    )
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    loader.close()
    [finding] = _stuck(loader.report())
    assert "in _finalize_join" in (finding.stack or ""), finding.stack


def test_workers_that_exit_at_once_after_a_break_give_no_finding(tmp_path: Path) -> None:
    never_slow = SlowTail(tmp_path / "slow", first_slow=64)
    loader = leakcheck.watch(DataLoader(never_slow, batch_size=2, num_workers=2), on_leak="ignore")
    for _ in range(2):
        for _batch in loader:
            break
    loader.close()
    report = loader.report()
    assert len(loader.tracker.worker_keys()) == 4
    assert _stuck(report) == [] and [f.rule for f in report.findings if f.rule == "hang"] == []


def test_leakcheck_run_says_a_worker_stuck_at_shutdown(
    tmp_path: Path,
    private_tmp: Path,  # noqa: F811 - the fixture
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, time\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "class SlowTail(Dataset):\n"
        "    def __len__(self):\n        return 64\n"
        "    def __getitem__(self, index):\n"
        "        if index >= 4:\n"
        "            open('slow', 'w').close()\n"
        "            time.sleep(60)\n"
        "        return index\n"
        "for batch in DataLoader(SlowTail(), batch_size=2, num_workers=1):\n"
        "    while not os.path.exists('slow'):\n        time.sleep(0.01)\n"
        "    break\n"
    )
    run = leakcheck_run("--", sys.executable, str(script), private_tmp=private_tmp, cwd=tmp_path)
    assert run.data is not None, run.stderr
    [item] = run.data["loaders"]
    [finding] = [f for f in item["report"]["findings"] if f["rule"] == "shutdown-hang"]
    assert "terminated in __getitem__ (stuck.py:9)" in finding["message"]
    assert "did not exit within 5 s" in run.stderr


def test_the_lightning_callback_says_a_worker_stuck_at_its_epochs_end(tmp_path: Path) -> None:
    pl: Any = pytest.importorskip("lightning.pytorch")
    marker = tmp_path / "slow"
    from leakcheck.adapters.lightning import LeakCheckCallback
    from tests.test_lightning import trainer

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def train_dataloader(self) -> DataLoader[int]:
            # Two batches an epoch (and Lightning's look-ahead, items 4-5): the worker
            # prefetches items 6 and on, and sleeps.
            return DataLoader(SlowTail(marker, first_slow=6), batch_size=2, num_workers=1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1:
                assert wait_for(marker.exists, timeout_s=120)
            loss: torch.Tensor = self.layer(batch.float().unsqueeze(1)).sum()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = LeakCheckCallback(on_leak="ignore", grace=0.5)
    trainer(callback, tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=0).fit(
        Tiny()
    )
    [finding] = _stuck(callback.report("train"))
    assert "terminated in __getitem__ (test_exit_watch.py:" in finding.message


def test_a_worker_terminated_before_any_join_is_no_hang(tmp_path: Path) -> None:
    """Ctrl-C as workers start: torch's shutdown fails before its joins and its ``finally``
    terminates each live worker at once; that was said as "did not exit within 5 s"."""
    from leakcheck.track.hang import watch_exits

    marker = tmp_path / "slow"
    stuck: list[tuple[object, ...]] = []
    iterator: Any = iter(DataLoader(SlowTail(marker, first_slow=0), num_workers=1))
    watch_exits(iterator, lambda *args: stuck.append(args))
    [worker] = iterator._workers
    assert wait_for(marker.exists, timeout_s=120)  # inside its minute-long item
    worker.terminate()  # what the `finally` does, no join before it
    worker.join(60)
    assert stuck == []
    iterator._shutdown_workers()


def test_a_worker_terminated_after_its_join_ran_out_is_said_with_that_join(
    tmp_path: Path,
) -> None:
    from leakcheck.track.hang import watch_exits

    marker = tmp_path / "slow"
    stuck: list[tuple[object, ...]] = []
    iterator: Any = iter(DataLoader(SlowTail(marker, first_slow=0), num_workers=1))
    watch_exits(iterator, lambda *args: stuck.append(args))
    [worker] = iterator._workers
    assert wait_for(marker.exists, timeout_s=120)
    worker.join(timeout=0.2)  # as torch's shutdown joins, with its own timeout
    worker.terminate()
    worker.join(60)
    assert stuck == [(worker.pid, 0.2)]
    iterator._shutdown_workers()


def test_explain_tells_the_shutdown_hang_story() -> None:
    text = STORIES["shutdown-hang"]
    assert "terminate" in text and "worker_init_fn" in text and "daemon" in text


def test_an_odd_iterator_is_left_alone_and_nothing_is_raised_into_the_loop() -> None:
    from leakcheck.track.hang import watch_exits

    class Odd:
        def __init__(self, workers: object) -> None:
            self._workers = workers

    for workers in (5, [object()], [None], "ab"):  # not a list of Processes
        watch_exits(Odd(workers), lambda pid, joined_s: None)


def test_a_stuck_worker_without_the_stack_signal_is_said_without_stacks(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A worker that never registered the stack signal (no leakcheck ``worker_init_fn``):
    the stall is kept and said, its stacks a placeholder, and nothing waits for a dump."""
    import multiprocessing

    go = multiprocessing.get_context("fork").Event()
    worker = multiprocessing.get_context("fork").Process(target=go.wait, args=(60,))
    with leakcheck.Tracker(use_nvml=False, grace=0.1) as tracker:
        with tracker.epoch():
            worker.start()
            assert worker.pid is not None
            tracker.worker_stuck(worker.pid, 5.0)
            go.set()
            worker.join(60)
        [stall] = tracker.timeline().stalls
    assert stall.pid == worker.pid and stall.epoch == 0
    assert stall.stacks == f"--- worker PID {worker.pid} ---\n(no stack signal)"
    assert f"DataLoader worker PID {worker.pid} did not exit within 5 s" in capfd.readouterr().err
