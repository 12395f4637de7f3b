"""A clean training script with a training and a validation loader, as users write it.

No leakcheck in it: ``leakcheck run -- python examples/train_val.py`` reports each loader on a
line of its own and the whole run as clean.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 2, (256,)))
    train = DataLoader(data, batch_size=32, shuffle=True, num_workers=2)
    val = DataLoader(data, batch_size=64, num_workers=2)
    model = torch.nn.Linear(16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _epoch in range(4):  # warm-up 1 + the 3 epoch ends a growth rule judges
        for inputs, labels in train:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        with torch.no_grad():
            for inputs, _labels in val:
                model(inputs)
    print("done")


if __name__ == "__main__":
    main()
