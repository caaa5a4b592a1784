"""A small chain model and its serial reference run, shared by the pipeline tests."""

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, CLASSES, BATCH, STEPS, LR = 8, 16, 4, 8, 5, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def chain_model(layers: int = 4, seed: int = 0, device=None) -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return nn.Sequential(nn.Linear(IN, HIDDEN), *(Block() for _ in range(layers)), nn.Linear(HIDDEN, CLASSES))


def batches(steps: int = STEPS):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
            for _ in range(steps)]


def chain_loss(batch, output):
    return F.cross_entropy(output, batch["target"])


def serial_losses(layers: int = 4) -> list[float]:
    model = chain_model(layers)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        loss = chain_loss({"target": y}, model(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def pipeline_losses(model, steps: int = STEPS) -> list[float]:
    """Train a PipelineModel (built with broadcast_and_average_loss=True) with SGD; losses on every rank."""
    optim = torch.optim.SGD(model.local_parameters(), lr=LR)
    losses = []
    for x, y in batches(steps):
        losses.append(model.run_train(input=x, target=y).item())
        optim.step()
        optim.zero_grad()
    return losses
