"""``intra_layer.Linear``: a drop-in ``nn.Linear`` whose weight is split over a 3D grid of ranks.

The weight ``(out_features, in_features)`` is cut into blocks: output features over one group of
the grid, input features over another (row and column groups; ``transpose`` swaps them), and each
block is sharded once more along its rows over the depth group (ZeRO-3 inside the layer).
Three contracts for the activations (the batch is split over the data and depth ranks in all):

- whole (default): inputs and outputs carry all the features, the same samples on every rank of
  a row x column group, so the layers around it do not change; the first call checks that the
  samples are the same (an error names the contract that fits, never a wrong output);
- per-rank batch (``batch_per_rank=True``, AxoNN's default): whole features in and out, but each
  rank of the row x column group passes its own samples; the layer regroups them around its
  block matmul (atorch/intra_layer/regroup.py), so everything outside it is data parallel over
  every rank (:func:`sync_gradients` then sums the other parameters over every rank);
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
import torch.distributed as dist
from torch import nn

from atorch.distributed.topology import Topology
from atorch.errors import AtorchConfigError, WorldSizeError
from atorch.intra_layer import comm, overlap, regroup
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
    - ``batch_per_rank``: AxoNN's default contract (with ``expert_mode=False``): whole features
      in and out, each rank of the row x column group with its own samples (any number of rows
      each). Default ``False``: the same samples on every rank of that group, which the first
      call checks (one small all-reduce per group, once per layer).
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
                 skip_bias_add: bool = False, *, expert_mode: bool = False, batch_per_rank: bool = False,
                 device=None, dtype=None, topology: Topology | None = None, **unknown):
        if unknown:
            raise AtorchConfigError(
                f"intra_layer.Linear got unknown keyword arguments {sorted(unknown)}; it takes in_features, "
                "out_features, bias, transpose, skip_bias_add, expert_mode, batch_per_rank, device, dtype and topology"
            )
        if expert_mode and batch_per_rank:
            raise AtorchConfigError(
                "intra_layer.Linear(expert_mode=True, batch_per_rank=True): the sliced contract keeps the same "
                "samples on every rank of a row x column group; pass one of the two"
            )
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.transpose, self.skip_bias_add = bool(transpose), bool(skip_bias_add)
        self.expert_mode, self.batch_per_rank = bool(expert_mode), bool(batch_per_rank)
        self._samples_checked = False
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
                    expert_mode: bool = False, batch_per_rank: bool = False) -> "Linear":
        """A 3D layer holding ``linear``'s weights (its shard of them); draws no random numbers."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, transpose=transpose,
                    expert_mode=expert_mode, batch_per_rank=batch_per_rank, device="meta", dtype=linear.weight.dtype,
                    topology=topology)
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
        regrouped = self.batch_per_rank and whole_in and whole_out
        if self.batch_per_rank and whole_in != whole_out:
            raise AtorchConfigError(
                f"intra_layer.Linear(batch_per_rank=True) called with scatter_input={scatter_input}, "
                f"gather_output={gather_output}: a per-rank batch is regrouped only with whole features in and out "
                "(both True), and sliced features in and out (both False) take the same samples on every rank"
            )
        if not regrouped:
            self._check_same_samples(x, whole_in)
        if not getattr(self.weight, "intra_layer_sharded", False):
            self._mark_shard()
        # through overlap: inside optimize_communication the collectives may run asynchronously
        weight = overlap.gathered_weight(self.weight, self._depth)
        if regrouped:
            y = self._regrouped(x, weight)
        else:
            h = comm.scatter(x, self._in) if whole_in else x
            y = comm.reduce(overlap.linear(h, weight, self._out), self._in)
        bias = self.bias
        if whole_out:
            if not regrouped:
                y = comm.gather(y, self._out)
        elif bias is not None:
            # backward all-gathers the slices' gradients: the whole bias gets the whole gradient,
            # as under the whole contract, so sync_gradients treats it the same either way
            bias = comm.scatter(bias, self._out)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def _regrouped(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """AxoNN's default contract: this rank's samples in, their whole output features out."""
        rows = x.reshape(-1, x.shape[-1])
        in_counts = regroup.row_counts(rows.shape[0], self._in, rows.device)
        h = regroup.rows_to_slices(rows, self._in, in_counts)
        out_counts = regroup.row_counts(h.shape[0], self._out, rows.device)
        h = regroup.gather_rows(h, self._out, out_counts)
        y = comm.reduce(overlap.linear(h, weight, self._out), self._in)
        y = regroup.own_rows(regroup.slices_to_rows(y, self._out, out_counts), self._in, in_counts)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _check_same_samples(self, x: torch.Tensor, whole_in: bool) -> None:
        """Once per layer: the whole and sliced contracts need the same samples on every rank of the
        row x column group (whole features: over both groups; sliced: over the output-feature
        group). Another rank's samples would be mixed into this rank's output without an error."""
        if self._samples_checked or not _real(x):
            return
        self._samples_checked = True
        axes = [(self._out, _group_names(self.transpose)[0])]
        if whole_in:
            axes.append((self._in, _group_names(self.transpose)[1]))
        for axis, name in axes:
            if axis.size > 1 and not _same_on_all(x, axis):
                raise AtorchConfigError(
                    f"intra_layer.Linear({self.in_features}, {self.out_features}) got different inputs on the ranks "
                    f"of its {name} group, but its contract (expert_mode={self.expert_mode}) needs the same samples "
                    "on every rank of a row x column group (give those ranks the same batch: "
                    "atorch.data.create_dataloader does). For AxoNN's default contract, each rank its own samples, "
                    "build the layer with batch_per_rank=True (atorch.compat.axonn.Linear does)"
                )

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
                f"transpose={self.transpose}, expert_mode={self.expert_mode}, batch_per_rank={self.batch_per_rank}, "
                f"grid(out x in x depth)={self._out.size}x{self._in.size}x{self._depth.size}")


def _real(x: torch.Tensor) -> bool:
    """A tensor with data on this process (not meta, fake, or traced by torch.compile)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (isinstance(x, torch.Tensor) and not x.is_meta and not isinstance(x, FakeTensor)
            and not torch.compiler.is_compiling())


def _same_on_all(x: torch.Tensor, axis) -> bool:
    """Whether ``x`` is the same on every rank of ``axis`` (shape, sum, sum of squares, hashed bytes)."""
    flat = x.detach().reshape(-1).double().nan_to_num(0.0, 1e300, -1e300)
    index = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    prints = torch.stack([torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device),
                          flat.sum(), flat.square().sum(), (flat * index.remainder(97)).sum()])
    both = torch.cat([prints, -prints])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=axis.group)
    return bool(torch.equal(both[:4], -both[4:]))


def _shard_full_weight(module: Linear, state_dict, prefix, *args) -> None:
    # A serial nn.Linear's weight has the full shape: shard it; a shard-shaped one loads as is.
    key = prefix + "weight"
    weight = state_dict.get(key)
    if weight is not None and tuple(weight.shape) == (module.out_features, module.in_features) \
            and tuple(weight.shape) != tuple(module.weight.shape):
        state_dict[key] = module.shard(weight)
