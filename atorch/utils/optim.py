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
