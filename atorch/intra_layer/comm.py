"""Collectives of the 3D layer that the Megatron region mappings do not cover.

The weight of a 3D layer is sharded over the depth group like ZeRO-3: gathered whole for the
matmul, and its gradient reduce-scattered back, which also sums the contributions of the depth
ranks' different samples. The activation collectives reuse atorch/parallel_layers/mappings.py.
"""

import torch
import torch.distributed as dist

from atorch.intra_layer.grid import Axis
from atorch.parallel_layers import mappings


def all_gather_dim(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """The pieces of ``x`` on the ranks of ``axis``, concatenated along ``dim`` (no autograd)."""
    if axis.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(axis.size)]
    dist.all_gather(parts, x.contiguous(), group=axis.group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The sum of ``x`` over ``axis``, of which this rank keeps its chunk along dim 0."""
    if axis.size == 1:
        return x
    chunks = [c.contiguous() for c in x.chunk(axis.size, dim=0)]
    out = torch.empty_like(chunks[axis.rank])
    dist.reduce_scatter(out, chunks, group=axis.group)
    return out


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, axis):
        ctx.axis = axis
        return all_gather_dim(shard, 0, axis)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.axis), None


def gather_shards(shard: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Forward: all-gather the depth shards along dim 0; backward: reduce-scatter the gradient."""
    return shard if axis.size == 1 else _GatherShards.apply(shard, axis)


def scatter(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """This rank's slice of the last dim (backward: all-gather)."""
    return x if axis.size == 1 else mappings.scatter_to_region(x, axis.group)


def gather(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """All-gather along the last dim (backward: keep this rank's slice)."""
    return x if axis.size == 1 else mappings.gather_from_region(x, axis.group)


def copy(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Identity (backward: all-reduce, summing the partial gradients of the ranks)."""
    return x if axis.size == 1 else mappings.copy_to_region(x, axis.group)


def reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """All-reduce, summing partial results (backward: identity)."""
    return x if axis.size == 1 else mappings.reduce_from_region(x, axis.group)


class _Drop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        if x.shape[dim] % axis.size:
            raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {axis.size} ranks")
        return x.chunk(axis.size, dim)[axis.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.axis), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return all_gather_dim(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.axis.size, ctx.dim)[ctx.axis.rank].contiguous(), None, None


def drop(x: torch.Tensor, axis: Axis, dim: int = -1) -> torch.Tensor:
    """This rank's chunk of ``dim`` over ``axis`` (backward: all-gather)."""
    return x if axis.size == 1 else _Drop.apply(x, axis, dim)


def gather_dim(x: torch.Tensor, axis: Axis, dim: int = -1) -> torch.Tensor:
    """The chunks of ``dim`` over ``axis`` concatenated (backward: keep this rank's chunk)."""
    return x if axis.size == 1 else _Gather.apply(x, axis, dim)
