"""Autograd functions that move activations into and out of tensor-parallel regions.

Each takes its process group explicitly. "Region" functions split or combine the last (hidden)
dim; "sequence" functions the second-to-last dim (the sequence of a (batch, seq, hidden) input,
the tokens of a (tokens, hidden) input), as Megatron's sequence parallelism does.
"""

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {size} tensor-parallel ranks")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    # gloo has no reduce_scatter: all-reduce then keep this rank's chunk.
    return _split(_all_reduce(x, group), dim, group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -2, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -2, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -2, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, -2, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, -2, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -2, ctx.group), None


def copy_to_region(x, group):
    """Identity forward; gradients all-reduced over ``group`` (entering a column-parallel layer)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    """All-reduce forward (leaving a row-parallel layer); identity backward."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x, group):
    """Keep this rank's slice of the last dim; gradients gathered."""
    return _ScatterToRegion.apply(x, group)


def gather_from_region(x, group):
    """Concatenate every rank's slice of the last dim; gradients split."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence(x, group):
    """Keep this rank's chunk of the sequence dim; gradients gathered."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence(x, group):
    """All-gather the sequence dim; gradients reduce-scattered (sequence parallel -> tensor parallel)."""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x, group):
    """Sum over ranks and keep this rank's sequence chunk (tensor parallel -> sequence parallel)."""
    return _ReduceScatterToSequence.apply(x, group)
