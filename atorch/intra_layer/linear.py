"""``intra_layer.Linear``: a drop-in ``nn.Linear`` whose weight is split over a 3D grid of ranks.

The weight ``(out_features, in_features)`` is cut into blocks: output features over one group of
the grid, input features over another (row and column groups; ``transpose`` swaps them), and each
block is sharded once more along its rows over the depth group (ZeRO-3 inside the layer).
Inputs and outputs are ordinary activations: whole features, the batch split only over the data
and depth ranks, so the layers around it do not change.

Forward on one rank, with ``x`` of shape (..., in_features):

1. gather the depth shards into this rank's block (backward: reduce-scatter the block's gradient);
2. keep this rank's slice of the input features (backward: all-gather);
3. block matmul, then all-reduce the partial sums over the input-feature group;
4. all-gather the output features over the output-feature group (backward: keep the slice);
   the input gradient is all-reduced over the output-feature group on the way back.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from atorch.distributed.topology import Topology
from atorch.errors import AtorchConfigError, WorldSizeError
from atorch.intra_layer import comm
from atorch.intra_layer.grid import Axis, current


def _axes(topology: Topology, transpose: bool) -> tuple[Axis, Axis, Axis]:
    """(output-feature axis, input-feature axis, depth axis) of a layer."""
    row, col = Axis.of(topology, "row"), Axis.of(topology, "col")
    out_axis, in_axis = (col, row) if transpose else (row, col)
    return out_axis, in_axis, Axis.of(topology, "depth")


def divides(in_features: int, out_features: int, topology: Topology, transpose: bool = False) -> bool:
    """Whether a layer of these sizes splits evenly over ``topology``'s grid."""
    out_axis, in_axis, depth = _axes(topology, transpose)
    return in_features % in_axis.size == 0 and out_features % (out_axis.size * depth.size) == 0


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` split over the row x column x depth grid (AxoNN's 3D algorithm).

    Same arguments as ``nn.Linear``, plus:

    - ``transpose``: split the output features over the column group and the input features
      over the row group instead of the reverse. The result is the same; it changes which group
      carries which collective. (AxoNN alternates it so that in its expert mode, where the
      activations stay split between layers, consecutive layers chain without re-gathering; here
      activations are always whole, so it is a layout choice.)
    - ``skip_bias_add``: return ``(output, bias)`` without adding the bias (as Megatron's layers
      do, so the caller can fuse the addition with what follows); ``bias`` is ``None`` without one.
    - ``topology``: the grid (default: the one set by :func:`atorch.intra_layer.init`).

    ``weight`` holds this rank's shard of shape ``(out / (O * D), in / I)`` (O, I: the sizes of the
    output- and input-feature groups, D: depth); ``bias`` is whole on every rank. Loading a
    serial ``nn.Linear`` state dict (full-shaped weight) shards it; a state dict of this layer
    (shard-shaped) loads as it is. :meth:`full_weight` gathers the whole weight.
    Initialized like ``nn.Linear`` in full with the current RNG state, then sliced, so ranks with
    the same seed hold exactly the serial layer's pieces.

    Example::

        atorch.intra_layer.init(G_intra_r=2, G_intra_c=2)   # 4 processes
        layer = atorch.intra_layer.Linear(512, 2048)
        layer.load_state_dict(serial_linear.state_dict())
        y = layer(x)                                     # like serial_linear(x)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, transpose: bool = False,
                 skip_bias_add: bool = False, *, device=None, dtype=None, topology: Topology | None = None,
                 **unknown):
        if unknown:
            raise AtorchConfigError(
                f"intra_layer.Linear got unknown keyword arguments {sorted(unknown)}; it takes in_features, "
                "out_features, bias, transpose, skip_bias_add, device, dtype and topology"
            )
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.transpose, self.skip_bias_add = bool(transpose), bool(skip_bias_add)
        self.topology = topology if topology is not None else current()
        self._out, self._in, self._depth = _axes(self.topology, self.transpose)
        problems = []
        if self.in_features % self._in.size:
            problems.append(f"in_features={in_features} must divide by {self._in.size} (the input-feature group)")
        if self.out_features % (self._out.size * self._depth.size):
            problems.append(f"out_features={out_features} must divide by {self._out.size * self._depth.size} "
                            "(output-feature group x depth)")
        if problems:
            raise WorldSizeError(
                f"intra_layer.Linear({in_features}, {out_features}, transpose={transpose}) on this grid: "
                f"{' and '.join(problems)}; change the sizes or the grid, or keep an nn.Linear here "
                "(auto_parallelize does)"
            )
        full = torch.empty(self.out_features, self.in_features, device=device, dtype=dtype)
        # nn.Linear's initialization, drawn in full so every rank slices the same matrix.
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        full_bias = None
        if bias:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            full_bias = torch.empty(self.out_features, device=device, dtype=dtype).uniform_(-bound, bound)
        self._set_parameters(full, full_bias)
        self.register_load_state_dict_pre_hook(_shard_full_weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, transpose: bool = False, topology: Topology | None = None) -> "Linear":
        """A 3D layer holding ``linear``'s weights (its shard of them); draws no random numbers."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, transpose=transpose,
                    device="meta", dtype=linear.weight.dtype, topology=topology)
        bias = None if linear.bias is None else linear.bias.detach()
        layer._set_parameters(linear.weight.detach(), bias)
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if layer.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def _set_parameters(self, full_weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = nn.Parameter(self.shard(full_weight))
        self.bias = None if bias is None else nn.Parameter(bias.clone())
        self._mark_shard()

    def _mark_shard(self) -> None:
        # Let sync_gradients tell the shard from replicated parameters, and the global-norm
        # clipping (atorch/auto/clip.py) sum its pieces over the tensor ranks. Parameters lose
        # such attributes when copied (deepcopy), so forward marks the weight again if needed.
        self.weight.intra_layer_sharded = True
        self.weight.shard_group = self.topology.group("tensor") if self.topology.size("tensor") > 1 else None

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full ``(out_features, in_features)`` tensor (a copy)."""
        block = full.chunk(self._out.size, 0)[self._out.rank].chunk(self._in.size, 1)[self._in.rank]
        return block.chunk(self._depth.size, 0)[self._depth.rank].clone().contiguous()

    def full_weight(self, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The whole ``(out_features, in_features)`` tensor from every rank's ``shard`` (default: the
        weight; pass ``self.weight.grad`` for the full gradient). A collective over the tensor ranks."""
        shard = (self.weight if shard is None else shard).detach()
        block = comm.all_gather_dim(shard, 0, self._depth)
        return comm.all_gather_dim(comm.all_gather_dim(block, 1, self._in), 0, self._out)

    def forward(self, x: torch.Tensor):
        if not getattr(self.weight, "intra_layer_sharded", False):
            self._mark_shard()
        weight = comm.gather_shards(self.weight, self._depth)
        h = comm.copy(comm.scatter(x, self._in), self._out)
        y = comm.gather(comm.reduce(F.linear(h, weight), self._in), self._out)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"transpose={self.transpose}, grid(out x in x depth)={self._out.size}x{self._in.size}x{self._depth.size}")


def _shard_full_weight(module: Linear, state_dict, prefix, *args) -> None:
    # A serial nn.Linear's weight has the full shape: shard it; a shard-shaped one loads as is.
    key = prefix + "weight"
    weight = state_dict.get(key)
    if weight is not None and tuple(weight.shape) == (module.out_features, module.in_features) \
            and tuple(weight.shape) != tuple(module.weight.shape):
        state_dict[key] = module.shard(weight)
