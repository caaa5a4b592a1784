"""``neuronx_distributed.parallel_layers.loss_functions``."""

from atorch.parallel_layers import parallel_cross_entropy

__all__ = ["parallel_cross_entropy"]
