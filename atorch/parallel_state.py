"""Megatron/NxD-style getters over the job's one Topology.

``initialize_model_parallel`` builds a Topology (tensor groups are contiguous ranks, then data,
then pipeline outermost) and makes it current; ``parallel_mode`` in a strategy does the same.
The getters read that object. atorch's own layers and methods take their groups as arguments;
these getters are a convenience for user code.

    atorch.init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    parallel_state.get_tensor_model_parallel_group(as_list=True)   # [[0, 1], [2, 3]] on 4 ranks
"""

import math

import torch.distributed as dist

from atorch.distributed.topology import DATA_PARALLEL_DIMS, TENSOR_SUB_DIMS, Topology
from atorch.errors import WorldSizeError

_CURRENT: Topology | None = None


def set_topology(topology: Topology | None) -> None:
    """Make ``topology`` the one the getters read (parallel_mode calls this)."""
    global _CURRENT
    _CURRENT = topology


def current_topology() -> Topology | None:
    """The topology the getters read (set by parallel_mode, initialize_model_parallel or
    atorch.intra_layer.init), or ``None`` before any of them ran."""
    return _CURRENT


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> Topology:
    if not dist.is_initialized():
        raise WorldSizeError("initialize_model_parallel needs a process group: call atorch.init_distributed() first")
    world = dist.get_world_size()
    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise WorldSizeError(
            f"tensor ({tp}) x pipeline ({pp}) parallel sizes must divide the world size {world}; "
            f"pick sizes whose product divides {world}"
        )
    topology = Topology.build([("tensor", tp), ("data", world // (tp * pp)), ("pipeline", pp)])
    set_topology(topology)
    return topology


def model_parallel_is_initialized() -> bool:
    return _CURRENT is not None


def destroy_model_parallel() -> None:
    set_topology(None)


def _topology() -> Topology:
    if _CURRENT is None:
        raise RuntimeError("model parallel is not initialized: call initialize_model_parallel() or use parallel_mode")
    return _CURRENT


def _groups_as_list(*names: str) -> list[list[int]]:
    """The rank lists of the groups spanning ``names`` (dims of the named mesh, the 3D sub-dims
    included), each list ordered as the group's ranks are numbered (outer dims slowest)."""
    mesh = _topology().named_mesh
    if mesh is None:
        return [[r] for r in range(dist.get_world_size() if dist.is_initialized() else 1)]
    dims = list(mesh.mesh_dim_names)
    if "tensor" in names and "tensor" not in dims:  # split into row x col x depth: they span it
        names = (*names, *TENSOR_SUB_DIMS)
    inside = [i for i, n in enumerate(dims) if n in names]
    outside = [i for i in range(len(dims)) if i not in inside]
    size = math.prod(mesh.mesh.shape[i] for i in inside)
    return mesh.mesh.permute(*outside, *inside).reshape(-1, size).tolist()


def _data_groups_as_list() -> list[list[int]]:
    # Every data-parallel dim, depth included: its ranks see different samples (AxoNN's G_intra_d).
    return _groups_as_list(*DATA_PARALLEL_DIMS)


def get_tensor_model_parallel_size() -> int:
    return _topology().size("tensor")


def get_tensor_model_parallel_rank() -> int:
    return _topology().coordinate("tensor")


def get_tensor_model_parallel_group(as_list: bool = False):
    return _groups_as_list("tensor") if as_list else _topology().group("tensor")


def get_pipeline_model_parallel_size() -> int:
    return _topology().size("pipeline")


def get_pipeline_model_parallel_rank() -> int:
    return _topology().coordinate("pipeline")


def get_pipeline_model_parallel_group(as_list: bool = False):
    return _groups_as_list("pipeline") if as_list else _topology().group("pipeline")


def get_data_parallel_size() -> int:
    return _topology().data_parallel_size


def get_data_parallel_rank() -> int:
    return _topology().data_parallel_rank


def get_data_parallel_group(as_list: bool = False):
    return _data_groups_as_list() if as_list else _topology().data_parallel_group
