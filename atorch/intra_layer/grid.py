"""The 3D grid of ranks the intra-layer (AxoNN-style) layers run on, kept in the job's Topology.

``init`` builds a Topology whose ``tensor`` dim is split into row x column x depth sub-dims and
makes it current (the ``parallel_state`` getters read the same object). Layers take a topology
explicitly; the current one is only the default for code that, like AxoNN's, names no groups.
"""

import math
from dataclasses import dataclass

import torch.distributed as dist

from atorch import parallel_state
from atorch.distributed.topology import Topology
from atorch.errors import WorldSizeError


def init(G_inter: int = 1, G_data: int = 1, G_intra_r: int = 1, G_intra_c: int = 1, G_intra_d: int = 1) -> Topology:
    """Build the data x pipeline x (row x column x depth) grid over every process; return it.

    The arguments are in AxoNN's positional order (``G_inter`` first, then ``G_data``); keywords
    read best. The product of the five sizes must equal the world size. Ranks are laid out innermost first:
    row, column, depth (together the ``tensor`` dim), then data, then pipeline (``G_inter``).
    A collective call: every rank runs it after ``atorch.init_distributed()``.

    Example::

        atorch.init_distributed()
        atorch.intra_layer.init(G_data=2, G_intra_r=2)       # 4 processes
        layer = atorch.intra_layer.Linear(1024, 4096)
    """
    sizes = {"G_inter": G_inter, "G_data": G_data, "G_intra_r": G_intra_r, "G_intra_c": G_intra_c,
             "G_intra_d": G_intra_d}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise WorldSizeError(f"{name}={size!r}: every grid size must be an integer >= 1")
    world = dist.get_world_size() if dist.is_initialized() else 1
    product = math.prod(sizes.values())
    if product != world:
        shown = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise WorldSizeError(
            f"{shown} = {product} processes, but the world size is {world}; choose sizes whose product is "
            f"{world} or launch {product} processes"
        )
    tensor = G_intra_r * G_intra_c * G_intra_d
    topology = Topology.build([("tensor", tensor), ("data", G_data), ("pipeline", G_inter)])
    topology.split_tensor(G_intra_r, G_intra_c, G_intra_d)
    parallel_state.set_topology(topology)
    return topology


def current() -> Topology:
    """The topology set by :func:`init` (or by the ``tensor_parallel`` method's 3d algorithm)."""
    topology = parallel_state.current_topology()
    if topology is None or topology.tensor_split is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            topology = Topology.single()
            topology.split_tensor(1, 1, 1)
            return topology
        raise WorldSizeError(
            "no 3D tensor-parallel grid is set up: call atorch.intra_layer.init(G_data=..., G_intra_r=..., "
            "G_intra_c=..., G_intra_d=...) on every rank first"
        )
    return topology


@dataclass(frozen=True)
class Axis:
    """One process group of the grid as a layer sees it (``group`` is None when alone)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    def __deepcopy__(self, memo) -> "Axis":
        return self  # immutable, and process groups cannot be copied

    @classmethod
    def of(cls, topology: Topology, name: str) -> "Axis":
        size = topology.size(name)
        if size == 1:
            return cls(None, 1, 0)
        group = topology.group(name)
        # The group rank, not the mesh coordinate: all_gather concatenates by group rank, so
        # slicing by it keeps split and gather consistent whatever the rank order.
        return cls(group, size, dist.get_rank(group))
