"""Checkpoints that survive strategy changes, crashes and restarts (docs/checkpoint.md).

    import atorch.checkpoint as ckpt
    ckpt.save("ckpt/latest", model, optim, lr_scheduler, dataloader, extra={"step": step})
    extra = ckpt.load("ckpt/latest", model, optim, lr_scheduler, dataloader)  # any strategy, any world size
    ckpt.export("out/final", model)  # one plain safetensors file (and config.json for transformers)
"""

from atorch.checkpoint.api import load, save
from atorch.checkpoint.export import export
from atorch.checkpoint.io import exists

__all__ = ["exists", "export", "load", "save"]
