"""NxD's (and Megatron's) ``parallel_state`` on atorch's one Topology.

    from neuronx_distributed.parallel_layers import parallel_state
        ->  from atorch.compat.nxd.parallel_layers import parallel_state

Every getter of :mod:`atorch.parallel_state` is here, plus the Megatron spellings NxD code also
uses (``get_tensor_model_parallel_world_size`` ...) and the source-rank helpers. The layout is
NxD's: tensor groups are contiguous ranks, then data, pipeline outermost.
"""

import torch.distributed as dist

from atorch import parallel_state as _core
from atorch.errors import NotSupportedError
from atorch.parallel_state import (  # noqa: F401 - re-exported under NxD's module
    current_topology,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_size,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
    model_parallel_is_initialized,
)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1, **kwargs):
    """NxD's ``initialize_model_parallel``: tensor x data x pipeline over the world.

    Expert parallelism and the Neuron-only options (``lnc_size``, ``skip_collective_init``, ...)
    are refused by name; atorch's MoE-free layouts are the ones here.
    """
    if expert_model_parallel_size != 1:
        raise NotSupportedError(
            f"initialize_model_parallel(expert_model_parallel_size={expert_model_parallel_size}): expert parallelism "
            "is not ported; use expert_model_parallel_size=1 (atorch has tensor, data and pipeline dims)")
    if kwargs:
        raise NotSupportedError(
            f"initialize_model_parallel({', '.join(sorted(kwargs))}): Neuron-specific options are not ported; "
            "leave them out (atorch.parallel_state.initialize_model_parallel takes the tensor and pipeline sizes)")
    return _core.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


# Megatron's spellings (NxD code and Megatron ports use both).
get_tensor_model_parallel_world_size = get_tensor_model_parallel_size
get_pipeline_model_parallel_world_size = get_pipeline_model_parallel_size
get_data_parallel_world_size = get_data_parallel_size


def _first_of_my_group(groups: list[list[int]]) -> int:
    me = dist.get_rank() if dist.is_initialized() else 0
    return next(group[0] for group in groups if me in group)


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's tensor group (a broadcast source)."""
    return _first_of_my_group(get_tensor_model_parallel_group(as_list=True))


def get_data_parallel_src_rank() -> int:
    """The global rank of data-parallel rank 0 in this rank's data group."""
    return _first_of_my_group(get_data_parallel_group(as_list=True))


def get_pipeline_model_parallel_first_rank() -> int:
    return _first_of_my_group(get_pipeline_model_parallel_group(as_list=True))


def get_pipeline_model_parallel_last_rank() -> int:
    me = dist.get_rank() if dist.is_initialized() else 0
    return next(group[-1] for group in get_pipeline_model_parallel_group(as_list=True) if me in group)


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_size() - 1


__all__ = [
    "current_topology",
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_size",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_size",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_size",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "model_parallel_is_initialized",
]
