"""Megatron-style tensor-parallel layers. Each holds its slice of the full layer and takes its
tensor-parallel group explicitly (``group=None`` reads it from :mod:`atorch.parallel_state`).

Weights are initialized in full (same seed on every rank) and sliced, so a layer built on N
ranks holds exactly the pieces of the serial layer built with the same seed.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atorch.parallel_layers.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)


def _group_or_default(group):
    if group is not None:
        return group
    from atorch import parallel_state

    return parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None


def _size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} {total} does not divide over {parts} tensor-parallel ranks; pad it to a multiple of {parts}")
    return total // parts


def _mark(param: nn.Parameter, dim: int, group) -> nn.Parameter:
    # Attributes other tools read to know how a parameter is split (Megatron's names).
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    if group is not None:
        param.shard_group = group  # atorch.auto.clip_grad_norm sums this piece's norm over it
    return param


def _linear_weight(out_features: int, in_features: int, dtype, device) -> torch.Tensor:
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's default
    return weight


def _linear_bias(out_features: int, in_features: int, dtype, device) -> torch.Tensor:
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's rows (output features) split: rank r holds rows
    ``[r*out/tp, (r+1)*out/tp)`` of the torch-layout weight (out, in) and of the bias.

    ``gather_output=True`` returns the full output; False leaves each rank its slice (to feed a
    RowParallelLinear). With ``sequence_parallel_enabled`` the input arrives split on the
    sequence dim and is all-gathered first.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 sequence_parallel_enabled: bool = False, dtype: torch.dtype = torch.float32, device=None, group=None):
        super().__init__()
        self.group = _group_or_default(group)
        self.world, rank = _size_rank(self.group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, self.world, "output_size")
        self.gather_output = gather_output
        self.sequence_parallel_enabled = sequence_parallel_enabled
        # Set when the enclosing block already gathered a sequence-parallel input (its backward
        # reduce-scatters the summed gradient), so this layer must not all-reduce it again.
        self.input_is_gathered = False
        rows = slice(rank * self.output_size_per_partition, (rank + 1) * self.output_size_per_partition)
        self.weight = _mark(nn.Parameter(_linear_weight(output_size, input_size, dtype, device)[rows].clone()), 0, self.group)
        if bias:
            self.bias = _mark(nn.Parameter(_linear_bias(output_size, input_size, dtype, device)[rows].clone()), 0, self.group)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel_enabled:
            x = gather_from_sequence(x, self.group)
        elif not self.input_is_gathered:
            x = copy_to_region(x, self.group)
        out = F.linear(x, self.weight, self.bias)
        return gather_from_region(out, self.group) if self.gather_output else out

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition}), tp={self.world}"


def row_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, group, input_is_parallel: bool,
                        sequence_parallel: bool) -> torch.Tensor:
    """``x A^T`` summed over ``group`` from each rank's column slice ``weight`` of A (no bias): a
    full ``x`` is split first unless ``input_is_parallel``; the sum is all-reduced, or
    reduce-scattered on the sequence dim under ``sequence_parallel``."""
    if not input_is_parallel:
        x = scatter_to_region(x, group)
    partial = F.linear(x, weight)
    return reduce_scatter_to_sequence(partial, group) if sequence_parallel else reduce_from_region(partial, group)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's columns (input features) split: rank r holds columns
    ``[r*in/tp, (r+1)*in/tp)`` of the weight; partial products are summed over ranks and the
    full bias is added once, after the reduction.

    ``input_is_parallel=True`` takes each rank's slice of the input (a ColumnParallelLinear's
    output); False splits a full input. With ``sequence_parallel_enabled`` the sum is
    reduce-scattered on the sequence dim instead of all-reduced.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 sequence_parallel_enabled: bool = False, dtype: torch.dtype = torch.float32, device=None, group=None):
        super().__init__()
        self.group = _group_or_default(group)
        self.world, rank = _size_rank(self.group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, self.world, "input_size")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError("sequence_parallel_enabled needs input_is_parallel=True (Megatron's layout)")
        cols = slice(rank * self.input_size_per_partition, (rank + 1) * self.input_size_per_partition)
        self.weight = _mark(nn.Parameter(_linear_weight(output_size, input_size, dtype, device)[:, cols].clone()), 1, self.group)
        if bias:
            self.bias = nn.Parameter(_linear_bias(output_size, input_size, dtype, device))
            # Under sequence parallelism each rank adds the bias to its own tokens: its gradient
            # is partial and must be summed over the group (allreduce_sequence_parallel_grads).
            self.bias.sequence_parallel = sequence_parallel_enabled
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = row_parallel_matmul(x, self.weight, self.group, self.input_is_parallel, self.sequence_parallel_enabled)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in={self.input_size} (local {self.input_size_per_partition}), out={self.output_size}, tp={self.world}"


class ParallelEmbedding(nn.Module):
    """An embedding table split over the tensor-parallel ranks: rank r holds rows
    ``[r*V/tp, (r+1)*V/tp)`` (ids outside them contribute zeros, summed over ranks), or, with
    ``shard_across_embedding=True``, columns ``[r*D/tp, (r+1)*D/tp)`` of every row (gathered)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method=nn.init.normal_,
                 dtype: torch.dtype = torch.float32, device=None, shard_across_embedding: bool = False, group=None):
        super().__init__()
        self.group = _group_or_default(group)
        self.world, rank = _size_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard_across_embedding = shard_across_embedding
        # The row that gets no gradient, as in nn.Embedding (set when built from one).
        self.padding_idx: int | None = None
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
        init_method(full)
        if shard_across_embedding:
            width = _divide(embedding_dim, self.world, "embedding_dim")
            self.weight = _mark(nn.Parameter(full[:, rank * width:(rank + 1) * width].clone()), 1, self.group)
        else:
            rows = _divide(num_embeddings, self.world, "num_embeddings")
            self.vocab_start, self.vocab_end = rank * rows, (rank + 1) * rows
            self.weight = _mark(nn.Parameter(full[self.vocab_start:self.vocab_end].clone()), 0, self.group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard_across_embedding:
            return gather_from_region(F.embedding(ids, self.weight, padding_idx=self.padding_idx), self.group)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        local = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight, padding_idx=local_pad)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(local, self.group)

    def extra_repr(self) -> str:
        how = "columns" if self.shard_across_embedding else "rows"
        return f"{self.num_embeddings}, {self.embedding_dim}, split by {how} over tp={self.world}"


def allreduce_sequence_parallel_grads(model: nn.Module, group) -> None:
    """Sum the partial gradients of parameters used on sequence shards (RowParallelLinear's
    bias, LayerNorms inside a sequence-parallel region) over the tensor-parallel group."""
    if group is None or not dist.is_initialized():
        return
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def _take(param: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = _size_rank(group)
    # contiguous: a chunk of a transposed weight (a Conv1D's, rebuilt as a Linear) keeps its strides
    # through a plain clone, and FSDP refuses non-contiguous parameters
    return param.detach().chunk(world, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def column_from_linear(linear: nn.Linear, group, gather_output: bool = False,
                       sequence_parallel_enabled: bool = False) -> ColumnParallelLinear:
    """A ColumnParallelLinear holding this rank's rows of an existing ``nn.Linear``."""
    layer = ColumnParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                 gather_output=gather_output, sequence_parallel_enabled=sequence_parallel_enabled,
                                 dtype=linear.weight.dtype, device="meta", group=group)
    layer.weight = _mark(nn.Parameter(_take(linear.weight, 0, group), linear.weight.requires_grad), 0, group)
    if linear.bias is not None:
        layer.bias = _mark(nn.Parameter(_take(linear.bias, 0, group), linear.bias.requires_grad), 0, group)
    return layer


def row_from_linear(linear: nn.Linear, group, input_is_parallel: bool = True,
                    sequence_parallel_enabled: bool = False) -> RowParallelLinear:
    """A RowParallelLinear holding this rank's columns of an existing ``nn.Linear``."""
    layer = RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              input_is_parallel=input_is_parallel, sequence_parallel_enabled=sequence_parallel_enabled,
                              dtype=linear.weight.dtype, device="meta", group=group)
    layer.weight = _mark(nn.Parameter(_take(linear.weight, 1, group), linear.weight.requires_grad), 1, group)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), linear.bias.requires_grad)
        layer.bias.sequence_parallel = sequence_parallel_enabled
    return layer


def embedding_from(embedding: nn.Embedding, group) -> ParallelEmbedding:
    """A ParallelEmbedding holding this rank's rows of an existing ``nn.Embedding``."""
    if embedding.max_norm is not None:
        raise ValueError("an nn.Embedding with max_norm cannot be split over ranks (its renormalization is per row)")
    layer = ParallelEmbedding(embedding.num_embeddings, embedding.embedding_dim, init_method=lambda t: t,
                              dtype=embedding.weight.dtype, device="meta", group=group)
    layer.weight = _mark(nn.Parameter(_take(embedding.weight, 0, group), embedding.weight.requires_grad), 0, group)
    layer.padding_idx = embedding.padding_idx
    return layer
