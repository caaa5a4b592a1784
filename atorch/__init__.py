"""atorch: make a plain PyTorch training job fast on one or many devices.

    import atorch
    atorch.init_distributed()
    status, result, strategy = atorch.auto_accelerate(model, optim_func, dataset, loss_func,
                                                      load_strategy=["parallel_mode", "amp_native"])
"""

from atorch.auto import Strategy, auto_accelerate
from atorch.distributed.env import device, init_distributed, local_rank, rank, shutdown, world_size
from atorch.errors import AtorchConfigError

__version__ = "0.1.0"

__all__ = [
    "AtorchConfigError",
    "Strategy",
    "auto_accelerate",
    "device",
    "init_distributed",
    "local_rank",
    "rank",
    "shutdown",
    "world_size",
]
