"""Megatron-style tensor-parallel building blocks: layers, region mappings, vocab-parallel loss."""

from atorch.parallel_layers.cross_entropy import parallel_cross_entropy
from atorch.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
)
from atorch.parallel_layers.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    scatter_to_sequence,
)
from atorch.parallel_layers.padding import get_number_of_extra_heads, move_model_to_device, pad_model
from atorch.parallel_layers.random import RNGStatesTracker, get_rng_state_tracker, model_parallel_manual_seed

__all__ = [
    "RNGStatesTracker",
    "get_rng_state_tracker",
    "model_parallel_manual_seed",
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "allreduce_sequence_parallel_grads",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "get_number_of_extra_heads",
    "move_model_to_device",
    "pad_model",
    "parallel_cross_entropy",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "scatter_to_region",
    "scatter_to_sequence",
]
