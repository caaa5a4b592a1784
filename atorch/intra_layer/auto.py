"""Turn a model's ``nn.Linear`` layers into 3D layers: while it is built, or once it is built."""

import contextlib

import torch
from torch import nn

from atorch.distributed.topology import Topology
from atorch.intra_layer.grid import current
from atorch.intra_layer.linear import Linear, divides


def _serial_linear() -> type:
    return getattr(nn.Linear, "_atorch_serial_linear", nn.Linear)


@contextlib.contextmanager
def auto_parallelize(topology: Topology | None = None, *, batch_per_rank: bool = False):
    """Inside this block, ``nn.Linear(...)`` builds an :class:`intra_layer.Linear` when its sizes
    divide the grid, and a plain ``nn.Linear`` otherwise. ``nn.Linear`` is restored on exit, also
    when the block raises. ``batch_per_rank``: the layers take AxoNN's per-rank batch (see
    :class:`intra_layer.Linear`).

    Only the name ``torch.nn.Linear`` looked up while the block runs is affected (code that did
    ``from torch.nn import Linear`` earlier keeps the class it imported); ``isinstance(m,
    nn.Linear)`` keeps meaning a plain ``nn.Linear`` inside the block.

    Example::

        atorch.intra_layer.init(G_intra_r=2, G_intra_d=2)
        with atorch.intra_layer.auto_parallelize():
            model = MLP()
        model.load_state_dict(serial_state_dict)   # full weights: every 3D layer takes its shard
    """
    topology = topology if topology is not None else current()
    serial = _serial_linear()

    class _Meta(type(serial)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, serial)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, serial)

    class AutoParallelLinear(serial, metaclass=_Meta):
        _atorch_serial_linear = serial

        def __new__(cls, in_features, out_features, bias=True, device=None, dtype=None):
            if cls is not AutoParallelLinear:  # a subclass defined inside the block
                return serial.__new__(cls)
            if divides(in_features, out_features, topology):
                return Linear(in_features, out_features, bias, batch_per_rank=batch_per_rank, device=device,
                              dtype=dtype, topology=topology)
            return serial(in_features, out_features, bias, device=device, dtype=dtype)

    before = nn.Linear
    torch.nn.Linear = AutoParallelLinear
    try:
        yield
    finally:
        torch.nn.Linear = before


def parallelize_model(model: nn.Module, topology: Topology | None = None, *, batch_per_rank: bool = False) -> list[str]:
    """Replace, in a built model, every plain ``nn.Linear`` that divides the grid by a 3D layer
    carrying its weights; return the names of the replaced modules. ``batch_per_rank`` as in
    :func:`auto_parallelize`.

    Left alone: subclasses of ``nn.Linear`` (``nn.MultiheadAttention``'s output projection reads
    its weight directly), layers whose weight is shared with another module (tied embeddings),
    and layers whose sizes do not divide the grid.
    """
    topology = topology if topology is not None else current()
    replaced = []
    for name, module in replaceable_linears(model, topology.size("col"), topology.size("row") * topology.size("depth")):
        model.set_submodule(name, Linear.from_linear(module, topology=topology, batch_per_rank=batch_per_rank))
        replaced.append(name)
    return replaced


def replaceable_linears(model: nn.Module, col: int, rows: int) -> list[tuple[str, nn.Linear]]:
    """The layers :func:`parallelize_model` replaces on a grid of ``col`` column ranks and ``rows``
    row x depth ranks (the cost model counts the same ones): plain ``nn.Linear`` (no subclass), not
    the root, weight not shared with another module, input features dividing by ``col`` and output
    features by ``rows``."""
    serial = _serial_linear()
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return [(name, module) for name, module in model.named_modules()
            if name and type(module) is serial and uses.get(id(module.weight), 0) <= 1
            and module.in_features % col == 0 and module.out_features % rows == 0]
