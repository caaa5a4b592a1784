"""One training loop for every strategy: what ``result.backward(loss)`` and ``result.step()`` do.

Most strategies keep PyTorch's own calls (``loss.backward()``, ``optim.step()``,
``optim.zero_grad()``); pipeline strategies run backward inside the model call, and DeepSpeed's
engine owns backward and step. These two functions hide the difference, so a loop written with
them never branches on ``result.args``.
"""

from typing import Any

import torch


def backward(args: dict, optim: Any, loss: torch.Tensor | tuple | list) -> None:
    """Backward of ``loss`` (a loss or a sequence whose first item is the loss) the strategy's way."""
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    if args.get("backward_in_forward"):  # pipeline methods: the model call ran the backward
        return
    if args.get("use_optim_backward"):  # DeepSpeed ZeRO: the engine scales and reduces
        optim.backward(loss)
        return
    loss.backward()


def step(args: dict, optim: Any) -> None:
    """The optimizer step, then gradients cleared for the next one (DeepSpeed clears them itself)."""
    optim.step()
    if not args.get("use_optim_backward"):
        optim.zero_grad()
