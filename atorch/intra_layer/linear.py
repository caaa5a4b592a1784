"""``intra_layer.Linear``: a drop-in ``nn.Linear`` whose weight is split over a 3D grid of ranks.

The weight ``(out_features, in_features)`` is cut into blocks: output features over one group of
the grid, input features over another (row and column groups; ``transpose`` swaps them), and each
block is sharded once more along its rows over the depth group (ZeRO-3 inside the layer).
Two contracts for the activations (the batch is split over the data and depth ranks in both):

- whole (default): inputs and outputs carry all the features, the same on every rank of a
  row x column group, so the layers around it do not change;
- sliced (``expert_mode=True``, AxoNN's drop/gather contract): each rank passes its slice of the
  input features (over the input-feature group) and gets back its slice of the output features
  (over the output-feature group); the user parallelizes what lies between the layers.

Forward on one rank, with ``x`` of shape (..., in_features) (the sliced contract skips 2 and 4):

1. gather the depth shards into this rank's block (backward: reduce-scatter the block's gradient);
2. keep this rank's slice of the input features (backward: all-gather);
3. block matmul, then all-reduce the partial sums over the input-feature group;
4. all-gather the output features over the output-feature group (backward: keep the slice);
   the input gradient is all-reduced over the output-feature group on the way back.
"""

import math

import torch
from torch import nn

from atorch.distributed.topology import Topology
from atorch.errors import AtorchConfigError, WorldSizeError
from atorch.intra_layer import comm, overlap
from atorch.intra_layer.grid import Axis, current


def _axes(topology: Topology, transpose: bool) -> tuple[Axis, Axis, Axis]:
    """(output-feature axis, input-feature axis, depth axis) of a layer."""
    row, col = Axis.of(topology, "row"), Axis.of(topology, "col")
    out_axis, in_axis = (col, row) if transpose else (row, col)
    return out_axis, in_axis, Axis.of(topology, "depth")


def _group_names(transpose: bool) -> tuple[str, str]:
    """(output-feature group, input-feature group) as the grid names them."""
    return ("column", "row") if transpose else ("row", "column")


def divides(in_features: int, out_features: int, topology: Topology, transpose: bool = False) -> bool:
    """Whether a layer of these sizes splits evenly over ``topology``'s grid."""
    out_axis, in_axis, depth = _axes(topology, transpose)
    return in_features % in_axis.size == 0 and out_features % (out_axis.size * depth.size) == 0


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` split over the row x column x depth grid (AxoNN's 3D algorithm).

    Same arguments as ``nn.Linear``, plus:

    - ``transpose``: split the output features over the column group and the input features
      over the row group instead of the reverse. The result is the same; it changes which group
      carries which collective. Under the sliced contract (``expert_mode``) alternating it lets
      consecutive layers chain without re-gathering, as AxoNN does.
    - ``skip_bias_add``: return ``(output, bias)`` without adding the bias (as Megatron's layers
      do, so the caller can fuse the addition with what follows); ``bias`` is ``None`` without one.
    - ``expert_mode``: AxoNN's sliced contract. ``forward`` takes this rank's slice of the input
      features (``local_in_features`` wide: the input-feature group's share, as AxoNN's ``drop``
      cuts it) and returns this rank's slice of the output features (``local_out_features``
      wide, with the matching slice of the bias), so consecutive layers (``transpose``
      alternating) chain without gathering. Default ``False``: whole features in and out.
      ``forward(x, scatter_input=, gather_output=)`` picks each side per call (AxoNN's older
      keywords; ``True`` means whole). An input whose last dim is not what the contract
      expects is an error that says which contract it fits.
    - ``topology``: the grid (default: the one set by :func:`atorch.intra_layer.init`).

    ``weight`` holds this rank's shard of shape ``(out / (O * D), in / I)`` (O, I: the sizes of the
    output- and input-feature groups, D: depth); ``bias`` is whole on every rank.
    ``local_in_features = in / I`` and ``local_out_features = out / O`` (AxoNN's names). Loading a
    serial ``nn.Linear`` state dict (full-shaped weight) shards it; a state dict of this layer
    (shard-shaped) loads as it is. :meth:`full_weight` gathers the whole weight.
    Initialized like ``nn.Linear`` in full with the current RNG state, then sliced, so ranks with
    the same seed hold exactly the serial layer's pieces.

    Example::

        atorch.intra_layer.init(G_intra_r=2, G_intra_c=2)   # 4 processes
        layer = atorch.intra_layer.Linear(512, 2048)
        layer.load_state_dict(serial_linear.state_dict())
        y = layer(x)                                     # like serial_linear(x)

        sliced = atorch.intra_layer.Linear(512, 2048, expert_mode=True)
        y_local = sliced(x.chunk(2, -1)[col_rank])      # = y.chunk(2, -1)[row_rank]
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, transpose: bool = False,
                 skip_bias_add: bool = False, *, expert_mode: bool = False, device=None, dtype=None,
                 topology: Topology | None = None, **unknown):
        if unknown:
            raise AtorchConfigError(
                f"intra_layer.Linear got unknown keyword arguments {sorted(unknown)}; it takes in_features, "
                "out_features, bias, transpose, skip_bias_add, expert_mode, device, dtype and topology"
            )
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.transpose, self.skip_bias_add = bool(transpose), bool(skip_bias_add)
        self.expert_mode = bool(expert_mode)
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
        self.local_in_features = self.in_features // self._in.size
        self.local_out_features = self.out_features // self._out.size
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
    def from_linear(cls, linear: nn.Linear, transpose: bool = False, topology: Topology | None = None,
                    expert_mode: bool = False) -> "Linear":
        """A 3D layer holding ``linear``'s weights (its shard of them); draws no random numbers."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, transpose=transpose,
                    expert_mode=expert_mode, device="meta", dtype=linear.weight.dtype, topology=topology)
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

    def forward(self, x: torch.Tensor, scatter_input: bool | None = None, gather_output: bool | None = None):
        """``x @ W^T + b``. ``scatter_input``: ``x`` has the whole input features (this rank keeps its
        slice) rather than its slice already; ``gather_output``: return the whole output features
        rather than this rank's slice. Both default to ``not expert_mode``."""
        whole_in = not self.expert_mode if scatter_input is None else bool(scatter_input)
        whole_out = not self.expert_mode if gather_output is None else bool(gather_output)
        self._check_input(x, whole_in)
        if not getattr(self.weight, "intra_layer_sharded", False):
            self._mark_shard()
        # through overlap: inside optimize_communication the collectives may run asynchronously
        weight = overlap.gathered_weight(self.weight, self._depth)
        h = comm.scatter(x, self._in) if whole_in else x
        y = comm.reduce(overlap.linear(h, weight, self._out), self._in)
        bias = self.bias
        if whole_out:
            y = comm.gather(y, self._out)
        elif bias is not None:
            # backward all-gathers the slices' gradients: the whole bias gets the whole gradient,
            # as under the whole contract, so sync_gradients treats it the same either way
            bias = comm.scatter(bias, self._out)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def _check_input(self, x: torch.Tensor, whole: bool) -> None:
        width = x.shape[-1] if x.dim() else None
        expected = self.in_features if whole else self.local_in_features
        if width == expected:
            return
        _, in_name = _group_names(self.transpose)
        sliced = (f"this rank's slice of the input features ({self.local_in_features} = {self.in_features} / "
                  f"{self._in.size} {in_name} ranks)")
        if whole:
            wanted = f"the whole input features ({self.in_features})"
            fix = ("for AxoNN's contract (each rank its slice in, its slice of the output out) build the layer with "
                   "expert_mode=True or call it with scatter_input=False")
            fits = sliced if width == self.local_in_features else None
        else:
            wanted = sliced
            fix = (f"cut the input to this rank's slice over the {in_name} group (atorch.intra_layer.drop does), or "
                   "build the layer with expert_mode=False (or call it with scatter_input=True) to pass whole features")
            fits = f"the whole input features ({self.in_features})" if width == self.in_features else None
        got = f"last dim {width}" + (f", which is {fits}" if fits else
                                     f", which is neither the whole input features ({self.in_features}) nor "
                                     f"this rank's slice ({self.local_in_features})")
        raise AtorchConfigError(
            f"intra_layer.Linear({self.in_features}, {self.out_features}, expert_mode={self.expert_mode}) expects "
            f"{wanted} for this call; got an input with {got}: {fix}"
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"transpose={self.transpose}, expert_mode={self.expert_mode}, "
                f"grid(out x in x depth)={self._out.size}x{self._in.size}x{self._depth.size}")


def _shard_full_weight(module: Linear, state_dict, prefix, *args) -> None:
    # A serial nn.Linear's weight has the full shape: shard it; a shard-shaped one loads as is.
    key = prefix + "weight"
    weight = state_dict.get(key)
    if weight is not None and tuple(weight.shape) == (module.out_features, module.in_features) \
            and tuple(weight.shape) != tuple(module.weight.shape):
        state_dict[key] = module.shard(weight)
