"""One way through atorch's optimizer wrappers.

Every wrapper a method puts around the user's optimizer (``AmpOptimizer`` for loss scaling,
``GenomicOptimizer`` for the g-nets, ``SteppedByEngine`` for DeepSpeed's pipeline) keeps what it
wraps in its ``optimizer`` attribute and forwards the rest. Checkpointing, clipping and the LR
scheduler reach the real optimizer through :func:`unwrap_optimizer`, however many wrappers a
composition stacked.
"""

from collections.abc import Iterator
from typing import Any

import torch


def wrapper_chain(optim: Any) -> Iterator[Any]:
    """``optim``, then each optimizer it wraps, outermost first."""
    seen = set()
    while optim is not None and id(optim) not in seen:
        seen.add(id(optim))
        yield optim
        if isinstance(optim, torch.optim.Optimizer):
            return  # a torch optimizer's own ``optimizer`` attribute (if any) is not a wrapper's
        # vars(): the wrappers forward unknown attributes, so getattr would ask the inner one.
        optim = vars(optim).get("optimizer")


def unwrap_optimizer(optim: Any) -> Any:
    """The innermost optimizer under atorch's wrappers (a torch optimizer, or a backend's own)."""
    inner = optim
    for inner in wrapper_chain(optim):
        pass
    return inner


class OptimizerWrapper:
    """Base of an optimizer wrapper: the wrapped optimizer is ``self.optimizer``; its
    ``param_groups``, ``state``, ``zero_grad``, ``state_dict`` and every attribute the subclass
    does not define are the wrapped optimizer's. A subclass overrides ``step`` (and what it adds
    to the state)."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here: defer to the wrapped optimizer. Through
        # vars(): while unpickling, before ``optimizer`` is set, this raises AttributeError.
        if "optimizer" not in vars(self):
            raise AttributeError(name)
        return getattr(vars(self)["optimizer"], name)
