"""LeakCheckCallback on a real GPU: a Lightning fit with the model on CUDA reports no leak.

Each scenario is a script file run by its own interpreter (tests/gpu/scenario.py): CUDA is
never initialised in the pytest process, and spawn workers import the script's dataset. The
script imports Lightning inside ``main()`` only, so spawned workers (which import the script)
do not pay for it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.scenario import leaks, run_job

pytestmark = pytest.mark.gpu

EPOCHS = 3

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Pairs(Dataset):
        def __init__(self, touch_cuda):
            self.touch_cuda = touch_cuda
        def __len__(self):
            return 64
        def __getitem__(self, index):
            generator = torch.Generator().manual_seed(index)
            x, y = torch.randn(32, generator=generator), torch.randn(1, generator=generator)
            if self.touch_cuda:  # the worker computes on the GPU: its own CUDA context
                z = torch.full((256, 256), float(index), device="cuda")
                x = x + 0.0 * (z @ z).sum().cpu()
            return x, y

    def main(touch_cuda, context, persistent, epochs):
        import lightning.pytorch as pl
        from leakcheck.adapters.lightning import LeakCheckCallback

        def loader():
            return DataLoader(Pairs(touch_cuda), batch_size=8, num_workers=2,
                              multiprocessing_context=context, persistent_workers=persistent)

        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(32, 1)
                self.devices_seen = set()
            def training_step(self, batch, batch_idx):
                x, y = batch
                self.devices_seen.add(str(x.device))
                return torch.nn.functional.mse_loss(self.layer(x), y)
            def validation_step(self, batch, batch_idx):
                x, y = batch
                torch.nn.functional.mse_loss(self.layer(x), y)
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)
            def train_dataloader(self):
                return loader()
            def val_dataloader(self):
                return loader()

        callback = LeakCheckCallback(grace=1.0, on_leak="ignore", teardown=True)
        logger = False
        if TENSORBOARD:
            from lightning.pytorch.loggers import TensorBoardLogger
            logger = TensorBoardLogger(os.path.dirname(os.path.abspath(__file__)), name="tb")
        trainer = pl.Trainer(
            max_epochs=epochs, limit_train_batches=4, limit_val_batches=2,
            num_sanity_val_steps=2, logger=logger, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            accelerator=ACCELERATOR, devices=1, callbacks=[callback],
            default_root_dir=os.path.dirname(os.path.abspath(__file__)),
        )
        model = Tiny()
        trainer.fit(model)
        result = {"devices": sorted(model.devices_seen)}
        for stage, report in callback.reports.items():
            result[stage] = {
                "report": report.to_dict(),
                "text": report.format(verbose=True),
                "workers": [k.pid for k in callback.trackers[stage].worker_keys()],
            }
        if TENSORBOARD:  # what the log dir holds, read back as TensorBoard reads it
            from tensorboard.backend.event_processing.event_accumulator import (
                EventAccumulator,
            )
            events = EventAccumulator(logger.log_dir)
            events.Reload()
            result["tensorboard"] = {
                tag: [event.value for event in events.Scalars(tag)]
                for tag in events.Tags()["scalars"]
            }
        print("RESULT " + json.dumps(result))

    if __name__ == "__main__":
        main(touch_cuda=TOUCH_CUDA, context=CONTEXT, persistent=PERSISTENT, epochs=EPOCHS)
    """
)


def script_for(
    *, touch_cuda: bool, context: str, persistent: bool, accelerator: str, tensorboard: bool = False
) -> str:
    """The scenario, with its settings as the script's first lines."""
    settings = {
        "TENSORBOARD": tensorboard,
        "TOUCH_CUDA": touch_cuda,
        "CONTEXT": context,
        "PERSISTENT": persistent,
        "EPOCHS": EPOCHS,
        "ACCELERATOR": accelerator,
    }
    return "".join(f"{name} = {value!r}\n" for name, value in settings.items()) + SCRIPT


def run_fit(
    tmp_path: Path, *, touch_cuda: bool, context: str, persistent: bool, tensorboard: bool = False
) -> dict[str, Any]:
    script = tmp_path / "lightning_fit.py"
    script.write_text(
        script_for(
            touch_cuda=touch_cuda,
            context=context,
            persistent=persistent,
            accelerator="gpu",
            tensorboard=tensorboard,
        )
    )
    return run_job(str(script), timeout_s=600)


@pytest.mark.parametrize(
    ("touch_cuda", "context", "persistent"),
    [
        (True, "spawn", False),  # every epoch's workers make and release a CUDA context
        (True, "spawn", True),
        (False, "fork", False),  # forked from a parent that uses CUDA, CPU-only workers
    ],
)
def test_gpu_fit_has_no_false_finding(
    tmp_path: Path, touch_cuda: bool, context: str, persistent: bool
) -> None:
    result = run_fit(tmp_path, touch_cuda=touch_cuda, context=context, persistent=persistent)
    assert result["devices"] == ["cuda:0"]  # the model trained on the GPU
    assert set(result) == {"devices", "train", "val"}
    expected_workers = {
        "train": 2 if persistent else 2 * EPOCHS,
        "val": 2 if persistent else 2 * (EPOCHS + 1),  # the sanity check's workers too
    }
    for stage in ("train", "val"):
        report, text = result[stage]["report"], result[stage]["text"]
        assert report["attribution"] == "ok", text
        assert leaks(report) == [], text
        workers = result[stage]["workers"]
        assert len(workers) == expected_workers[stage], text
        # Every worker reported itself and, at exit, what it held and freed.
        records = report["teardowns"]
        assert sorted(r["key"]["pid"] for r in records) == sorted(workers), text
        for record in records:
            assert record["error"] is None, text
            assert record["cuda_initialized"] is touch_cuda, text
            if touch_cuda:
                assert record["context_released"] is True, text
                assert record["left_nvml"] is True, text
        roles = {
            p["role"]
            for e in report["epochs"]
            for p in e["processes"]
            if p["key"]["pid"] in workers
        }
        assert roles == {"worker"}, text
    assert [e["label"] for e in result["train"]["report"]["epochs"]] == [
        f"train epoch {n}" for n in range(EPOCHS)
    ]
    assert [e["label"] for e in result["val"]["report"]["epochs"]] == ["val sanity check"] + [
        f"val epoch {n}" for n in range(EPOCHS)
    ]


def test_a_fit_logs_leakcheck_scalars_into_its_tensorboard_log_dir(tmp_path: Path) -> None:
    """The callback logs through the trainer's TensorBoardLogger: the event files hold them."""
    pytest.importorskip("tensorboard")
    result = run_fit(tmp_path, touch_cuda=True, context="spawn", persistent=True, tensorboard=True)
    scalars = result["tensorboard"]
    names = ("leaks", "workers", "parent_host_mib", "workers_host_mib", "parent_gpu_mib")
    for stage, epochs in (("train", EPOCHS), ("val", EPOCHS + 1)):  # val: + the sanity check
        for name in names:
            assert len(scalars[f"leakcheck/{stage}/{name}"]) == epochs, sorted(scalars)
        assert set(scalars[f"leakcheck/{stage}/workers"]) == {2.0}
        assert set(scalars[f"leakcheck/{stage}/leaks"]) == {0.0}
        assert min(scalars[f"leakcheck/{stage}/parent_gpu_mib"]) > 0  # the model's context
