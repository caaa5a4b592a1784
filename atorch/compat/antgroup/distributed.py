"""ATorch's ``atorch.distributed.distributed`` names on atorch's one Topology.

    from atorch.distributed.distributed import create_parallel_group, parallel_group
        ->  from atorch.compat.antgroup.distributed import create_parallel_group, parallel_group

``create_parallel_group(([("model", 2), ("data", 2)], None))`` builds a Topology (dims innermost
first, as ATorch lists them) and makes it the one :mod:`atorch.parallel_state` reads. ATorch's dim
names ``"model"`` (tensor) and ``"pipe"`` (pipeline) are accepted; the getters answer to either
name and read the one Topology, whoever made it (this function, ``parallel_mode`` in
``auto_accelerate``, ``parallel_state.initialize_model_parallel``). What differs: no coworker processes, no RPC network for ``"pipe"``
(atorch pipelines with torch.distributed.pipelining), one parallel instance (``world`` = product
of the sizes).
"""

import datetime
import os

import torch
import torch.distributed as dist

from atorch import parallel_state
from atorch.distributed import env
from atorch.distributed.topology import Topology, resolve_dims
from atorch.errors import AtorchConfigError, NotSupportedError, WorldSizeError
from atorch.utils.log import logger

# ATorch's dim names -> atorch's
DIM_NAMES = {"model": "tensor", "pipe": "pipeline"}


class _Groups:
    """What create_parallel_group made (its config is what parallel_config() returns for it)."""

    topology: Topology | None = None
    config = None


def atorch_dims(slicing_dim) -> list[tuple[str, int]]:
    """``[(name, size), ...]`` with ATorch's names turned into atorch's; unknown names raise."""
    dims = []
    for item in slicing_dim:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise WorldSizeError(f"parallel config entry {item!r} is not a (name, size) pair")
        dims.append((DIM_NAMES.get(item[0], item[0]), int(item[1])))
    return dims


def init_distributed(backend: str = "nccl", coworker_num_per_node: int = 0, elastic_or_fault_tolerant: bool = False,
                     set_cuda_device_using_local_rank: bool = False,
                     timeout: datetime.timedelta | None = None) -> bool:
    """ATorch's ``atorch.init_distributed``: joins torchrun's process group and returns True.

    A plain single process (no torchrun variables) is valid and also returns True (ATorch starts
    a one-process group there; atorch needs none). ``nccl`` without CUDA raises (ATorch returned
    False): pass ``backend="gloo"`` on CPU machines. Coworker processes and ATorch's elastic
    mode are not ported (torchrun's ``--max-restarts`` restarts a failed job).
    """
    backend = backend.lower()
    if backend not in ("nccl", "gloo"):
        raise NotSupportedError(f"init_distributed(backend={backend!r}): atorch supports 'nccl' and 'gloo'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise AtorchConfigError("init_distributed(backend='nccl') needs CUDA and none is available; pass "
                                "backend='gloo' to run on CPU")
    if coworker_num_per_node:
        raise NotSupportedError("init_distributed(coworker_num_per_node>0): ATorch's coworker processes are not "
                                "ported; use the dataloader's num_workers for data preprocessing")
    if elastic_or_fault_tolerant:
        raise NotSupportedError("init_distributed(elastic_or_fault_tolerant=True) is not ported; launch with "
                                "torchrun --max-restarts=N for fault tolerance")
    env.init_distributed(backend, None if timeout is None else timeout.total_seconds())
    if set_cuda_device_using_local_rank:
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank() % torch.cuda.device_count())
        else:
            logger.warning("set_cuda_device_using_local_rank: no GPU found, nothing set (as in ATorch)")
    return True


def create_parallel_group(parallel_config, use_atorch_pipe: bool = False) -> Topology:
    """ATorch's ``create_parallel_group((dims, rank_order[, support_multi_parallel_instance]))``.

    ``dims`` are ``(name, size)`` pairs, innermost first; their product must be the world size.
    Returns the Topology (ATorch returned None) and makes it current for the getters below and
    for :mod:`atorch.parallel_state`.
    """
    if not isinstance(parallel_config, (list, tuple)) or len(parallel_config) not in (2, 3):
        raise WorldSizeError("parallel_config is (dims, rank_order) or (dims, rank_order, "
                             f"support_multi_parallel_instance), got {parallel_config!r}")
    slicing_dim, rank_order = parallel_config[0], parallel_config[1]
    dims = atorch_dims(slicing_dim)
    product, world = 1, env.world_size()
    for _, size in dims:
        product *= size
    if product != world:
        if len(parallel_config) == 3 and parallel_config[2]:
            raise NotSupportedError(
                f"support_multi_parallel_instance=True with {product} of {world} ranks per instance: several "
                "parallel instances in one job are not ported; make the sizes multiply to the world size")
        raise WorldSizeError(f"the parallel_config sizes multiply to {product} but the world size is {world}; "
                             f"make them multiply to {world}")
    resolve_dims(dims, world, rank_order)  # names and rank order checked, with atorch's messages
    if _Groups.topology is not None:
        destroy_parallel_group()
    topology = Topology.build(dims, rank_order)
    _Groups.topology, _Groups.config = topology, parallel_config
    parallel_state.set_topology(topology)
    return topology


def destroy_parallel_group(destroy_rpc: bool = True) -> None:
    """Forget the parallel groups (the process group stays): the getters answer None afterwards,
    whether :func:`create_parallel_group` or ``auto_accelerate``'s ``parallel_mode`` made them,
    as in ATorch (one registry of groups)."""
    parallel_state.set_topology(None)
    _Groups.topology, _Groups.config = None, None


def _topology() -> Topology | None:
    """The one Topology: the getters read it whoever made it (create_parallel_group,
    ``parallel_mode`` in auto_accelerate, parallel_state.initialize_model_parallel)."""
    return parallel_state.current_topology()


def _dim(name: str) -> str | None:
    """atorch's dim for ATorch's ``name`` if the current Topology has it (ATorch: None otherwise)."""
    topology = _topology()
    if topology is None:
        return None
    dim = DIM_NAMES.get(name, name)
    names = {d for d, _ in topology.dims}
    if topology.tensor_split is not None:
        names.update(("row", "col", "depth"))
    if not topology.dims and dim == "data":  # one process, no mesh: a data dim of size 1
        return dim
    return dim if dim in names else None


def parallel_group(name: str):
    """This rank's process group along ``name``; None if the Topology has no such dim."""
    dim = _dim(name)
    return None if dim is None else _topology().group(dim)


def parallel_group_size(name: str) -> int | None:
    dim = _dim(name)
    return None if dim is None else _topology().size(dim)


def parallel_rank(name: str) -> int | None:
    """This rank's index in its ``name`` group (its position on the mesh)."""
    dim = _dim(name)
    return None if dim is None else _topology().coordinate(dim)


def parallel_group_and_ranks(name: str):
    """``(group, ranks)`` of this rank along ``name``; ``(None, None)`` if no such dim."""
    dim = _dim(name)
    if dim is None:
        return None, None
    topology = _topology()
    mesh = topology.named_mesh
    return topology.group(dim), mesh[dim].mesh.tolist() if mesh is not None else [0]


def parallel_config():
    """``(dims, rank_order)`` of the current Topology (as create_parallel_group got it, when it made it)."""
    topology = _topology()
    if topology is None:
        return None
    if topology is _Groups.topology:
        return _Groups.config
    return (list(topology.dims), topology.rank_order)


def parallel_instance_num() -> int | None:
    """How many parallel instances the job holds: 1 once groups exist (None before)."""
    return None if _topology() is None else 1


def parallel_instance_index() -> int | None:
    return None if _topology() is None else 0


def is_coworker() -> bool:
    """False: atorch starts no coworker processes (``init_distributed(coworker_num_per_node>0)``
    is refused), so every process is a worker, as in ATorch without coworkers."""
    return False


def use_coworker() -> bool:
    return False


def coworker_size() -> int:
    return 0


def coworker_num_per_node() -> int:
    return 0


def reset_distributed() -> None:
    """Forget the parallel groups and end the process group, as ATorch's ``reset_distributed``."""
    destroy_parallel_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return env.rank()


def local_rank() -> int:
    return env.local_rank()


def world_size() -> int:
    return env.world_size()


def is_distributed() -> bool:
    return env.world_size() > 1


def backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None


def nproc_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# Ulysses-style sequence parallelism (ATorch's sp_size); see atorch.compat.antgroup.sequence
from atorch.compat.antgroup.sequence import (  # noqa: E402,F401 - ATorch exposes them from this module
    create_sequence_parallel_group,
    destroy_sequence_parallel_group,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_size,
    seq_all_to_all,
)
