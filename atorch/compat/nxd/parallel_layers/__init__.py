"""``neuronx_distributed.parallel_layers`` on atorch (see :mod:`atorch.compat.nxd`)."""

from atorch.compat.nxd import parallel_state
from atorch.compat.nxd.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from atorch.compat.nxd.parallel_layers.loss_functions import parallel_cross_entropy
from atorch.parallel_layers import move_model_to_device, pad_model

__all__ = [
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "move_model_to_device",
    "pad_model",
    "parallel_cross_entropy",
    "parallel_state",
]
