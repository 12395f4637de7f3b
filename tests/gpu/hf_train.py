"""A transformers ``Trainer`` fit as users write it: train and eval loaders made by the library,
4 persistent fork workers each, the model on the GPU. No leakcheck in it (tests/gpu/
test_launchers_gpu.py runs it under ``leakcheck run``)."""

from __future__ import annotations

import inspect
import sys

import torch
from transformers import Trainer, TrainingArguments


class Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.full((16,), float(index % 7))
        return {"x": x, "labels": x.sum().reshape(1)}


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.linear(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def main(output_dir: str) -> None:
    each_epoch = {"eval_strategy": "epoch"}
    if "eval_strategy" not in inspect.signature(TrainingArguments).parameters:
        each_epoch = {"evaluation_strategy": "epoch"}  # older transformers
    args = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=2,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        dataloader_num_workers=4,
        dataloader_persistent_workers=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        **each_epoch,
    )
    trainer = Trainer(model=Regressor(), args=args, train_dataset=Pairs(), eval_dataset=Pairs())
    trainer.train()  # TRAIN
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
