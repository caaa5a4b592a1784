"""atorch: make a plain PyTorch training job fast on one or many devices.

    import atorch
    atorch.init_distributed()
    status, result, strategy = atorch.auto_accelerate(model, optim_func, dataset, loss_func,
                                                      load_strategy=["parallel_mode", "amp_native"])
"""

from atorch.errors import AtorchConfigError
from atorch.utils.lazy import lazy_exports

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that `import atorch.cli` (the `atorch` command) and
# `atorch --help` start without torch; `from atorch import auto_accelerate` works as before.
_LAZY = {
    "StepLoss": "atorch.loss",
    "Strategy": "atorch.auto",
    "TokenSum": "atorch.loss",
    "auto_accelerate": "atorch.auto",
    "device": "atorch.distributed.env",
    "init_distributed": "atorch.distributed.env",
    "local_rank": "atorch.distributed.env",
    "rank": "atorch.distributed.env",
    "shutdown": "atorch.distributed.env",
    "with_count": "atorch.loss",
    "world_size": "atorch.distributed.env",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "AtorchConfigError",
    "StepLoss",
    "Strategy",
    "TokenSum",
    "auto_accelerate",
    "device",
    "init_distributed",
    "local_rank",
    "rank",
    "shutdown",
    "with_count",
    "world_size",
]
