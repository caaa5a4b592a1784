"""One object for the process topology: a DeviceMesh whose dims have names.

Dims are written innermost first, as ATorch writes them: in ``[("tensor", 2), ("data", 2)]`` the
two ranks of a tensor group are neighbours (0,1 and 2,3) and data groups stride over them (0,2
and 1,3). Methods receive the group or sub-mesh they need from this object; nothing reads a
module-level global.
"""

import contextlib
import contextvars
import datetime
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from atorch.errors import WorldSizeError

KNOWN_DIMS = ("data", "zero", "tensor", "pipeline")
# The 3D tensor-parallel algorithm (atorch.intra_layer) splits the tensor dim into these sub-dims,
# outermost first: tensor rank = row + R * (col + C * depth). See Topology.split_tensor.
TENSOR_SUB_DIMS = ("depth", "col", "row")
# Ranks along these dims see different samples; the dataloader splits the global batch over them.
# ("depth" exists only once the tensor dim is split: its ranks hold shards of the same weights but
# see different samples.)
DATA_PARALLEL_DIMS = ("data", "zero", "depth")


def data_parallel_size(dims: dict[str, int]) -> int:
    """How many ranks share the global batch in a layout's ``{dim: size}``: the product of its
    data-parallel dims."""
    return math.prod(size for name, size in dims.items() if name in DATA_PARALLEL_DIMS)

_collective_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar("collective_timeout", default=None)


@contextlib.contextmanager
def collective_timeout(seconds: float | None) -> Iterator[None]:
    """Inside this block, :meth:`Topology.build` gives every dim a process group of its own (never
    the default group) whose collectives raise after ``seconds``; ``None`` changes nothing.

    A dry run builds its candidate's topology inside one: a rank left waiting in the model's
    all-reduce by a peer that failed alone raises within the candidate's timeout (gloo raises
    cleanly, and the group is destroyed with the candidate) instead of waiting the job's.

    Example::

        with collective_timeout(30.0):
            topology = Topology.build([("data", dist.get_world_size())])
    """
    token = _collective_timeout.set(seconds)
    try:
        yield
    finally:
        _collective_timeout.reset(token)


def _timed_backend() -> tuple | None:
    """A DeviceMesh backend override for the default backend with the block's timeout, or None."""
    seconds = _collective_timeout.get()
    if seconds is None:
        return None
    # DeviceMesh reads the timeout from the options; gloo takes any options, NCCL its own class.
    options = dist.ProcessGroupNCCL.Options() if "nccl" in dist.get_backend() else dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=max(float(seconds), 0.001))
    return (None, options)


def resolve_dims(
    dims: Sequence[tuple[str, int]], world_size: int, rank_order: Sequence[int] | None = None
) -> tuple[list[tuple[str, int]], list[str]]:
    """Fit ``dims`` to ``world_size`` without touching any process group.

    Returns the fitted dims and one note per adjustment. When the product of the sizes differs
    from the world size, the data dim absorbs the difference (it is added if absent); when the
    other dims do not divide the world size, :class:`WorldSizeError` says what would.
    """
    dims = [(str(name), int(size)) for name, size in dims]
    names = [name for name, _ in dims]
    for name, size in dims:
        if name not in KNOWN_DIMS:
            raise WorldSizeError(f"unknown parallel dim {name!r}; known dims are {list(KNOWN_DIMS)}")
        if size < 1:
            raise WorldSizeError(f"parallel dim {name!r} has size {size}; sizes must be >= 1")
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise WorldSizeError(f"parallel dims {duplicated} appear more than once; list each dim once")
    notes: list[str] = []
    product = math.prod(size for _, size in dims)
    if product != world_size:
        others = math.prod(size for name, size in dims if name != "data")
        if world_size % others != 0:
            raise WorldSizeError(
                f"parallel dims {dims} need a multiple of {others} processes but the world size is "
                f"{world_size}; change the sizes of the non-data dims so their product divides "
                f"{world_size}, or launch a multiple of {others} processes"
            )
        new_data = world_size // others
        if "data" in names:
            dims = [(n, new_data if n == "data" else s) for n, s in dims]
            notes.append(f"data dim rescaled to {new_data} so the dims multiply to world size {world_size}")
        else:
            dims.append(("data", new_data))
            notes.append(f"data dim of size {new_data} added so the dims multiply to world size {world_size}")
    if rank_order is not None:
        order = [int(r) for r in rank_order]
        if sorted(order) != list(range(world_size)):
            raise WorldSizeError(
                f"rank_order {order} must be a permutation of 0..{world_size - 1} (each rank of the "
                "world exactly once); pass None for the natural order"
            )
    return dims, notes


class Topology:
    """The named process mesh of one job.

    Build it collectively on every rank with :meth:`build`; a single process without a process
    group gets :meth:`single`, where every dim has size 1 and every group is ``None``.
    """

    def __init__(self, dims: list[tuple[str, int]], mesh: DeviceMesh | None, rank_order: list[int] | None):
        self.dims = dims
        self.mesh = mesh
        self.rank_order = rank_order
        # The groups derived later (data-parallel flattening, the tensor split) share the mesh's timeout.
        self._backend = _timed_backend() if mesh is not None else None
        # (row, col, depth) once split_tensor has run; the mesh with the sub-dims in place of tensor.
        self.tensor_split: tuple[int, int, int] | None = None
        self._split_mesh: DeviceMesh | None = None
        self._dp_mesh = self._build_dp_mesh() if mesh is not None else None
        # Data dims without depth: the ranks that hold the same 3D shard (equal to _dp_mesh unsplit).
        self._replica_mesh = self._dp_mesh

    @classmethod
    def single(cls) -> "Topology":
        return cls([], None, None)

    @classmethod
    def build(
        cls,
        dims: Sequence[tuple[str, int]],
        rank_order: Sequence[int] | None = None,
        device_type: str = "cpu",
    ) -> "Topology":
        """Create the mesh on every rank (a collective call); ``dims`` must already fit the world."""
        if not dist.is_initialized():
            if math.prod(size for _, size in dims) != 1:
                raise WorldSizeError(
                    f"parallel dims {list(dims)} need several processes but no process group is "
                    "running; launch with torchrun and call atorch.init_distributed() first"
                )
            return cls.single()
        dims = list(dims)
        world = dist.get_world_size()
        fitted, _ = resolve_dims(dims, world, rank_order)
        if fitted != dims:
            raise WorldSizeError(f"dims {dims} do not multiply to world size {world}; resolve them first")
        order = list(range(world)) if rank_order is None else [int(r) for r in rank_order]
        # DeviceMesh lists dims outermost first, the reverse of our innermost-first convention.
        outer_first = list(reversed(dims))
        shape = [size for _, size in outer_first] or [1]
        names = tuple(name for name, _ in outer_first) or ("data",)
        backend = _timed_backend()
        mesh = DeviceMesh(device_type, torch.tensor(order).reshape(shape), mesh_dim_names=names,
                          backend_override=None if backend is None else (backend,) * len(names))
        return cls(dims, mesh, None if rank_order is None else order)

    def _build_dp_mesh(self) -> DeviceMesh | None:
        mesh = self._named_mesh
        names = [n for n in mesh.mesh_dim_names if n in DATA_PARALLEL_DIMS]
        if not names:
            return None
        if len(names) == 1:
            return mesh[names[0]]
        # Flattening is how torch builds one group over several mesh dims (torchtitan does the
        # same for its data-parallel group); every rank takes part, so it happens once, here.
        return mesh[tuple(names)]._flatten("data_parallel" if mesh is self.mesh else "data_parallel_3d",
                                           backend_override=self._backend)

    @property
    def _named_mesh(self) -> DeviceMesh | None:
        """The mesh whose dim names are looked up: with the tensor sub-dims once split."""
        return self._split_mesh if self._split_mesh is not None else self.mesh

    @property
    def named_mesh(self) -> DeviceMesh | None:
        """The mesh with every named dim, the tensor sub-dims (row, col, depth) in place of
        ``tensor`` once :meth:`split_tensor` ran; ``None`` without a process group."""
        return self._named_mesh

    def split_tensor(self, row: int, col: int, depth: int) -> None:
        """Split the ``tensor`` dim into ``row`` x ``col`` x ``depth`` sub-dims (a collective call).

        Used by the 3D tensor-parallel algorithm (``atorch.intra_layer``). Afterwards
        ``group("row")``, ``group("col")`` and ``group("depth")`` exist, ``group("tensor")`` still
        spans all three, and ``depth`` counts as a data-parallel dim (its ranks see different
        samples): ``data_parallel_size`` includes it. Tensor rank = row + R * (col + C * depth).
        """
        sizes = (int(row), int(col), int(depth))
        if min(sizes) < 1 or math.prod(sizes) != self.size("tensor"):
            raise WorldSizeError(
                f"row x col x depth = {sizes[0]} x {sizes[1]} x {sizes[2]} = {math.prod(sizes)} must equal the "
                f"tensor dim's size {self.size('tensor')}; pick sizes that multiply to {self.size('tensor')} "
                "or change the tensor dim"
            )
        if self.tensor_split is not None:
            if self.tensor_split != sizes:
                raise WorldSizeError(f"the tensor dim is already split as {self.tensor_split}; build a new Topology")
            return
        self.tensor_split = sizes
        if self.mesh is None or "tensor" not in self.mesh.mesh_dim_names:
            return  # every size is 1 (checked above)
        self._split_mesh = self.mesh._unflatten("tensor", sizes[::-1], TENSOR_SUB_DIMS, backend_override=None
                                                if self._backend is None else dict.fromkeys(TENSOR_SUB_DIMS, self._backend))
        self._dp_mesh = self._build_dp_mesh()

    def size(self, name: str) -> int:
        """Size of a dim; 1 for a dim this topology does not have."""
        if name in TENSOR_SUB_DIMS and self.tensor_split is not None:
            return self.tensor_split[("row", "col", "depth").index(name)]
        return dict(self.dims).get(name, 1)

    def coordinate(self, name: str) -> int:
        """This rank's index along a dim; 0 for a dim this topology does not have."""
        mesh = self._named_mesh
        if mesh is None or name not in mesh.mesh_dim_names:
            if name == "tensor" and self._split_mesh is not None:
                return self.coordinate("row") + self.size("row") * (
                    self.coordinate("col") + self.size("col") * self.coordinate("depth"))
            return 0
        # The mesh coordinate, not the group rank: process groups number their members by global
        # rank, which differs from the position on the mesh when a rank_order permutes ranks.
        return mesh.get_coordinate()[mesh.mesh_dim_names.index(name)]

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of this rank along ``name`` (``None`` without a process group)."""
        if self._split_mesh is not None and name in TENSOR_SUB_DIMS:
            return self._split_mesh.get_group(name)
        if self.mesh is None or name not in self.mesh.mesh_dim_names:
            return None
        return self.mesh.get_group(name)

    def submesh(self, *names: str) -> DeviceMesh | None:
        """The sub-mesh over ``names`` (listed outermost first, as DeviceMesh expects)."""
        if self.mesh is None:
            return None
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[tuple(names)]

    @property
    def data_parallel_size(self) -> int:
        """How many ranks share the global batch: the product of the data and zero dims."""
        return math.prod(self.size(name) for name in DATA_PARALLEL_DIMS)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel ranks (outer dims vary slowest)."""
        index = 0
        for name in self._named_mesh.mesh_dim_names if self.mesh is not None else ():
            if name in DATA_PARALLEL_DIMS:
                index = index * self.size(name) + self.coordinate(name)
        return index

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return None if self._dp_mesh is None else self._dp_mesh.get_group()

    @property
    def data_parallel_mesh(self) -> DeviceMesh | None:
        return self._dp_mesh

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The data dims without depth: the ranks that hold the same 3D tensor-parallel shard."""
        return None if self._replica_mesh is None else self._replica_mesh.get_group()

    def __deepcopy__(self, memo) -> "Topology":
        # Process groups cannot be copied, and a copy of a model (a dry run's pristine copy, a
        # user's deepcopy) runs on the same processes: it shares the topology.
        return self

    def __repr__(self) -> str:
        return f"Topology(dims={self.dims}, rank_order={self.rank_order})"
