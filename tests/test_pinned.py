"""The loop's pinned host memory per epoch and the ``pinned-growth`` rule, on the CPU.

torch's CUDA is the boundary: where a test needs pinned memory, ``torch.cuda``'s two calls
(``is_initialized``, ``host_memory_stats``) are stand-ins, true only in the loop's process
(a forked worker sees CUDA uninitialised, as a real one would not touch it). Everything
else is real: DataLoaders with forked workers, the tracker, ``leakcheck run``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import leakcheck
from leakcheck.core.model import MIB, RuleConfig, Timeline
from leakcheck.judge.stories import STORIES
from leakcheck.judge.verdict import pinned_growth
from leakcheck.observe.torch_state import pinned_host_bytes
from tests import timelines as tl
from tests.pyrun import run_python
from tests.test_dataloader import Squares
from tests.test_run import leakcheck_run, private_tmp  # noqa: F401 - a fixture

FAKE = """
import os, torch
_home = os.getpid()
_reads = []

def _stats():
    _reads.append(1)  # {grow_mib} MiB more reserved at each read: a kept pinned batch
    reserved = len(_reads) * {grow_mib} * 2**20
    return {{"active_bytes.current": reserved // 2, "allocated_bytes.current": reserved}}

torch.cuda.is_initialized = lambda: os.getpid() == _home
torch.cuda.host_memory_stats = _stats
"""


def _fake_cuda(grow_mib: int) -> None:
    """Install the stand-ins in this process (what ``FAKE`` does in a program)."""
    exec(FAKE.format(grow_mib=grow_mib), {})


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "is_initialized", torch.cuda.is_initialized)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", torch.cuda.host_memory_stats)
    _fake_cuda(32)
    yield


def _timeline(reserved_mib: list[float | None]) -> Timeline:
    return tl.timeline(
        [
            replace(
                tl.epoch(index, [tl.parent()]),
                pinned_reserved_bytes=tl.mib(value) if value is not None else None,
            )
            for index, value in enumerate(reserved_mib)
        ]
    )


def test_the_read_gives_allocated_and_reserved_where_cuda_is_initialised(fake_cuda: None) -> None:
    assert pinned_host_bytes() == (16 * MIB, 32 * MIB)


def test_the_read_is_none_without_cuda_and_initialises_nothing() -> None:
    out = run_python(
        "import torch\n"
        "from leakcheck.observe.torch_state import pinned_host_bytes\n"
        "print(pinned_host_bytes(), torch.cuda.is_initialized())\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None False"


def test_pinned_memory_that_grows_each_epoch_names_the_loops_process() -> None:
    [finding] = pinned_growth(_timeline([64, 100, 164, 228, 292]), RuleConfig())
    assert finding.severity == "leak" and finding.pid == tl.ROOT_PID
    grows = "pinned host memory grows 64 MiB/epoch over epochs 1-4: 100 -> 292 MiB"
    assert grows in finding.message
    assert finding.host_bytes == 192 * MIB
    assert "pinned batches" in finding.remedy and "per step" in finding.remedy


@pytest.mark.parametrize(
    "reserved_mib",
    [
        [64, 128, 128, 128, 128],  # a cache that filled in the warm-up, then stays
        [64, 64, 66, 68, 70],  # within the tolerance
        [None, None, None, None, None],  # never read (no CUDA in the loop's process)
        [64, 100, 164],  # too few epochs past the warm-up
    ],
)
def test_pinned_memory_that_does_not_keep_growing_is_no_finding(
    reserved_mib: list[float | None],
) -> None:
    assert pinned_growth(_timeline(reserved_mib), RuleConfig()) == ()


def test_a_loop_whose_pinned_memory_grows_gets_the_finding_and_the_column(
    fake_cuda: None,
) -> None:
    loader = leakcheck.watch(
        DataLoader(Squares(), batch_size=3, num_workers=1), on_leak="ignore", grace=0.5
    )
    for _ in range(5):
        for _batch in loader:
            pass
    loader.close()
    report = loader.report()
    reserved = [record.pinned_reserved_bytes for record in report.epochs]
    assert None not in reserved and len(reserved) == 5
    [finding] = [f for f in report.findings if f.rule == "pinned-growth"]
    assert finding.pid == os.getpid() and finding.role == "parent"
    assert "pinned MiB" in report.format()
    assert report.to_dict()["epochs"][-1]["pinned_reserved_bytes"] == reserved[-1]


def test_a_cpu_loop_records_no_pinned_memory_and_initialises_no_cuda() -> None:
    out = run_python(
        """
        import torch
        from torch.utils.data import DataLoader
        import leakcheck
        loader = leakcheck.watch(
            DataLoader(list(range(8)), batch_size=2, num_workers=1), on_leak="ignore"
        )
        for _ in range(4):
            for _batch in loader:
                pass
        loader.close()
        report = loader.report()
        print([r.pinned_allocated_bytes for r in report.epochs], torch.cuda.is_initialized())
        first = report.to_dict()["epochs"][0]
        print("pinned" in report.format(verbose=True), first["pinned_reserved_bytes"])
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[None, None, None, None] False", "False None"]


def test_leakcheck_run_reads_the_programs_pinned_memory(
    tmp_path: Path,
    private_tmp: Path,  # noqa: F811 - the fixture
) -> None:
    script = tmp_path / "pinned.py"
    script.write_text(
        FAKE.format(grow_mib=32)
        + "from torch.utils.data import DataLoader\n"
        + "loader = DataLoader(list(range(8)), batch_size=2, num_workers=1)\n"
        + "for _ in range(5):\n    for _batch in loader:\n        pass\n"
    )
    run = leakcheck_run("--", sys.executable, str(script), private_tmp=private_tmp, cwd=tmp_path)
    assert run.data is not None, run.stderr
    [item] = run.data["loaders"]
    report = item["report"]
    assert all(e["pinned_reserved_bytes"] for e in report["epochs"]), report["epochs"]
    [finding] = [f for f in report["findings"] if f["rule"] == "pinned-growth"]
    assert finding["pid"] == item["pid"]
    assert "pinned host memory grows" in run.stderr  # said with the loader's findings


def test_explain_tells_the_pinned_growth_story() -> None:
    text = STORIES["pinned-growth"]
    assert "host_memory_stats" in text and "pin_memory" in text


def test_the_lightning_callback_records_and_logs_the_pinned_memory(
    fake_cuda: None, tmp_path: Path
) -> None:
    pl: Any = pytest.importorskip("lightning.pytorch")
    from leakcheck.adapters.lightning import LeakCheckCallback, epoch_scalars
    from tests.test_lightning import trainer

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def train_dataloader(self) -> DataLoader[torch.Tensor]:
            return DataLoader(Squares(), batch_size=3, num_workers=1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.layer(batch.float()).sum()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = LeakCheckCallback(on_leak="ignore", grace=0.5)
    # 32 MiB per epoch end: 96 MiB over the judged 4 epochs, beyond the host's 64
    trainer(callback, tmp_path, max_epochs=5, limit_train_batches=1.0, limit_val_batches=0).fit(
        Tiny()
    )
    report = callback.report("train")
    assert None not in [e.pinned_reserved_bytes for e in report.epochs]
    assert [f.rule for f in report.findings if f.rule == "pinned-growth"] == ["pinned-growth"]
    assert "leakcheck/train/parent_pinned_mib" in epoch_scalars("train", report.timeline, 0)
