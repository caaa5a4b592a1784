"""Cutting activations for the sliced contract of ``intra_layer.Linear`` (``expert_mode=True``).

Under that contract each rank holds its slice of the features: a layer takes its input cut over
its input-feature group (the column group; the row group with ``transpose=True``) and returns its
output cut over the other group, which is how the next layer, with ``transpose`` flipped, takes
its input. :func:`drop` and :func:`gather` (AxoNN's names and meaning) cut and rejoin an
activation over the input-feature group of a layer with the given ``transpose``: the output of a
non-transposed layer is rejoined with ``gather(y, transpose=True)``. Unlike AxoNN's ``drop``,
the batch is not cut over depth: the dataloader already gives every depth rank its own samples
(as under the whole contract).
"""

import torch

from atorch.distributed.topology import Topology
from atorch.intra_layer import comm
from atorch.intra_layer.grid import Axis, current


def _axis(transpose: bool, topology: Topology | None) -> Axis:
    topology = topology if topology is not None else current()
    return Axis.of(topology, "row" if transpose else "col")


def drop(x: torch.Tensor, transpose: bool = False, dim: int = -1, topology: Topology | None = None) -> torch.Tensor:
    """This rank's slice of ``dim``, cut as the input of a layer with this ``transpose`` expects
    (over the column group; ``transpose=True``: the row group). Backward: all-gather.

    Example::

        layer = atorch.intra_layer.Linear(64, 128, expert_mode=True)
        y_local = layer(atorch.intra_layer.drop(x))             # x: whole features
        y = atorch.intra_layer.gather(y_local, transpose=True)  # whole output features again
    """
    return comm.drop(x, _axis(transpose, topology), dim)


def gather(x: torch.Tensor, transpose: bool = False, dim: int = -1, topology: Topology | None = None) -> torch.Tensor:
    """The whole ``dim`` from slices cut as :func:`drop` cuts them (over the column group;
    ``transpose=True``: the row group). Backward: keep this rank's slice."""
    return comm.gather_dim(x, _axis(transpose, topology), dim)
