"""Regrouping a batch for AxoNN's default contract of ``intra_layer.Linear`` (``batch_per_rank``).

Under that contract every rank of the row x column group passes its own samples with all their
features ("pure data parallelism at the layer edge"). The layer regroups them around its block
matmul: on the way in, the input-feature group trades rows for feature slices (each rank sends
slice ``j`` of its rows to rank ``j``) and the output-feature group gathers its members' rows; on
the way out, the output-feature group trades back (each rank gets its rows' whole output
features) and each input-feature rank keeps its own rows. Every rank's batch may have its own
length (the last batch of an epoch); the lengths travel first.

Each step is an autograd function whose backward is the opposite step, so the input gradient
lands on the rank that owns the sample.
"""

import torch
import torch.distributed as dist

from atorch.intra_layer.grid import Axis


def row_counts(rows: int, axis: Axis, device=None) -> list[int]:
    """The number of rows every rank of ``axis`` passes, in group-rank order."""
    if axis.size == 1:
        return [rows]
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in range(axis.size)]
    dist.all_gather(counts, mine, group=axis.group)
    return [int(c.item()) for c in counts]


def _offset(counts: list[int], axis: Axis) -> int:
    return sum(counts[:axis.rank])


def _rows_to_slices(x: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """(my rows, f) -> (every rank's rows, f / size): my feature slice of the group's rows."""
    width = x.shape[1] // axis.size
    send = torch.cat([piece.reshape(-1) for piece in x.chunk(axis.size, dim=1)])
    recv = x.new_empty(sum(counts) * width)
    dist.all_to_all_single(recv, send, [n * width for n in counts], [x.shape[0] * width] * axis.size,
                           group=axis.group)
    return recv.view(sum(counts), width)


def _slices_to_rows(y: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """The inverse of :func:`_rows_to_slices`: (every rank's rows, f / size) -> (my rows, f)."""
    mine, width = counts[axis.rank], y.shape[1]
    recv = y.new_empty(axis.size * mine * width)
    dist.all_to_all_single(recv, y.contiguous().view(-1), [mine * width] * axis.size,
                           [n * width for n in counts], group=axis.group)
    return torch.cat([piece.view(mine, width) for piece in recv.chunk(axis.size)], dim=1)


def _gather_rows(x: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """Every rank's rows, concatenated in group-rank order (lengths may differ: padded to the longest)."""
    longest = max(counts)
    padded = x.new_zeros(longest, *x.shape[1:])
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(axis.size)]
    dist.all_gather(parts, padded, group=axis.group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def _own_rows(x: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    start = _offset(counts, axis)
    return x[start:start + counts[axis.rank]].contiguous()


class _Step(torch.autograd.Function):
    """One regrouping step forward, its opposite on the gradient backward."""

    @staticmethod
    def forward(ctx, x, step, opposite, axis, counts):
        ctx.opposite, ctx.axis, ctx.counts = opposite, axis, counts
        return step(x, axis, counts)

    @staticmethod
    def backward(ctx, grad):
        return ctx.opposite(grad.contiguous(), ctx.axis, ctx.counts), None, None, None, None


def rows_to_slices(x: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """Trade my rows' features for my feature slice of every rank's rows (backward: the reverse)."""
    return x if axis.size == 1 else _Step.apply(x.contiguous(), _rows_to_slices, _slices_to_rows, axis, counts)


def slices_to_rows(y: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """Trade my feature slice of every rank's rows for my rows' whole features (backward: the reverse)."""
    return y if axis.size == 1 else _Step.apply(y.contiguous(), _slices_to_rows, _rows_to_slices, axis, counts)


def gather_rows(x: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """Every rank's rows (backward: this rank's rows of a gradient already summed over ``axis``: the
    layer's backward all-reduces it, the block matmuls of the group's ranks sharing that input)."""
    return x if axis.size == 1 else _Step.apply(x.contiguous(), _gather_rows, _own_rows, axis, counts)


def own_rows(x: torch.Tensor, axis: Axis, counts: list[int]) -> torch.Tensor:
    """This rank's rows of rows the group holds in common (the output all-reduced over it); backward:
    every rank's gradient of its own rows, gathered, is the gradient of the whole."""
    return x if axis.size == 1 else _Step.apply(x, _own_rows, _gather_rows, axis, counts)
