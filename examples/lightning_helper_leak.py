"""A Lightning fit whose training workers each start a helper that outlives them: orphans named
by the training loader's report, while the validation loader's report stays clean.

``LeakCheckCallback`` watches every loader the trainer iterates, one report per stage. The
example kills the helpers it made, as the report's fix suggests. Needs ``lightning``.

Run: python examples/lightning_helper_leak.py
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from grandchild_leak import kill_orphans
from torch.utils.data import DataLoader, Dataset

from leakcheck.adapters.lightning import LeakCheckCallback

HELPER = "import time; time.sleep(600)  # a 'prefetch server' nobody stops"


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random pairs; with ``helpers``, each worker starts one helper at its first item."""

    def __init__(self, helpers: bool) -> None:
        self.helpers = helpers
        self.started = False

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.helpers and not self.started:
            self.started = True
            subprocess.Popen([sys.executable, "-c", HELPER])
        return torch.randn(4), torch.randn(1)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def loader(self, helpers: bool) -> DataLoader[Any]:
        return DataLoader(Pairs(helpers), batch_size=4, num_workers=2)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.loader(helpers=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self.loader(helpers=False)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    callback = LeakCheckCallback(on_leak="ignore", grace=1.0)
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[callback],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny())
    print(callback.format())  # each stage's report, named by its loader: train, then val
    kill_orphans(callback.report("train"))


if __name__ == "__main__":
    main()
