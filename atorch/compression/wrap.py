"""Running the g-nets inside the user's standard loop (what the ``genomic_bottleneck`` method uses).

- A forward pre-hook on the p-net calls :meth:`GenomicBottleneck.refresh`: the weights are
  predicted before a forward whenever the g-nets changed, or when a forward with grad needs the
  graph from the g-nets to the weights (after an optimizer step, or the first forward).
- :class:`GenomicOptimizer` wraps the user's optimizer: ``step()`` runs ``gnets.backward()``
  (the covered weights' grads into the g-nets, averaged to their owners), the user's optimizer
  (directly trained parameters) and ``gnets.step()``; ``zero_grad()`` clears both.

So ``loss.backward(); optim.step(); optim.zero_grad()`` is the whole loop, and gradient
accumulation (several forwards and backwards, then one step) works: the weights are predicted
once per step and the covered grads accumulate on the p-net until the step.
"""

from typing import Any

import torch
from torch import nn

from atorch.compression.bottleneck import GenomicBottleneck


def predict_before_forward(model: nn.Module, gnets: GenomicBottleneck):
    """Register the pre-hook that keeps ``model``'s covered weights predicted; returns its handle."""
    return model.register_forward_pre_hook(lambda module, args: gnets.refresh())


class GenomicOptimizer:
    """The user's optimizer with the g-nets' backward and step around its ``step``.

    Every other attribute (``param_groups``, ``state``, ``state_dict``...) is the wrapped
    optimizer's; the g-nets are saved with ``optim.gnets.save(path)``.
    """

    def __init__(self, optimizer: Any, gnets: GenomicBottleneck):
        self.optimizer, self.gnets = optimizer, gnets

    def step(self, closure=None):
        """Grads into the g-nets, then the user's optimizer, then the g-nets' optimizers."""
        self.gnets.backward()
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.gnets.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the user's optimizer's grads and the g-nets' (with the covered weights')."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.gnets.zero_grad()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)


def without_covered(param_groups: Any, gnets: GenomicBottleneck) -> Any:
    """``param_groups`` (a list of tensors or of group dicts) without the covered weights."""
    groups = list(param_groups)
    if groups and isinstance(groups[0], dict):
        return [{**group, "params": [p for p in group["params"] if not gnets.is_covered(p)]} for group in groups]
    return [p for p in groups if isinstance(p, torch.Tensor) and not gnets.is_covered(p)]
