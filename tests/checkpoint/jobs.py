"""Training jobs the checkpoint tests save, kill, resume and reshard (run inside spawned ranks)."""

import torch
from torch import nn

import atorch
from atorch.auto import auto_accelerate
from atorch.checkpoint.export import _full_state
from tests.helpers.models import TinyTransformer, TokenDataset, global_mean, lm_loss

STRATEGIES = {
    "single": [],
    "ddp": ["parallel_mode"],
    "fsdp": ["parallel_mode", "fsdp"],
    "zero1": ["parallel_mode", "zero1"],
    "tp": [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"],
}


class DropoutTransformer(TinyTransformer):
    """The tiny transformer with dropout in its MLPs: resuming must restore the random streams."""

    def __init__(self, p: float):
        super().__init__()
        for block in self.blocks:
            first, act, last = block.mlp
            block.mlp = nn.Sequential(first, act, nn.Dropout(p), last)


def build(strategy: str, seed: int = 0, dropout: float = 0.0, batch_size: int = 8):
    """An auto_accelerate result: Adam, a StepLR schedule and a shuffled global batch of ``batch_size``."""
    torch.manual_seed(seed)
    _, result, _ = auto_accelerate(
        DropoutTransformer(dropout), torch.optim.Adam, TokenDataset(), lm_loss, optim_args={"lr": 3e-3},
        dataloader_args={"batch_size": batch_size, "shuffle": True}, model_input_format="unpack_dict",
        load_strategy=STRATEGIES[strategy], lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
        lr_scheduler_args={"step_size": 3, "gamma": 0.5},
    )
    return result


def train(result, steps: int, after: dict | None = None, call=lambda model, batch: model(**batch)) -> list[float]:
    """``steps`` steps of the user's loop, epochs rolling over, the scheduler stepping; global losses.

    ``after[k]()`` is called once k steps are done (to save in the middle of one loop);
    ``call(model, batch)`` runs the model.
    """
    losses, batches = [], iter(result.dataloader)
    for step in range(steps):
        if step in (after or {}):
            after[step]()
        batch = next(batches, None)
        if batch is None:  # the epoch is over: the next one
            batches = iter(result.dataloader)
            batch = next(batches)
        batch = result.prepare_input(batch, atorch.device())
        loss = result.loss_func(batch, call(result.model, batch))
        if not result.args.get("backward_in_forward"):  # a pipeline runs backward inside its call
            loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        if result.lr_scheduler is not None:
            result.lr_scheduler.step()
        losses.append(global_mean(loss))
    return losses


def full_weights(result) -> dict[str, torch.Tensor]:
    """The serial model's weights, gathered from whatever strategy holds them."""
    return _full_state(result.model)
