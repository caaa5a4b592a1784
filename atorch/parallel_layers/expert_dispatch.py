"""Expert parallelism: each rank of an expert group keeps a slice of the routed experts, and the
tokens reach them, and come back, by all-to-all.

:class:`Dispatch` is called as ``dispatch(hidden_states, top_k_index, top_k_weights)`` with this
rank's tokens: every (token, choice) pair is sent to the rank holding its expert (one all-to-all
of the counts, one of the hidden states and one of the expert ids), computed there, and sent
back (one all-to-all), then weighted by its routing weight and summed per token, as the serial
block does. Both data all-to-alls carry autograd (backward runs them in reverse), so each
expert's gradient sums the contributions of every token of the group. No pair is dropped unless
a capacity factor is given: then each expert takes at most ``ceil(factor x pairs / experts)``
pairs from each rank, the first ones in token order, and the others add nothing (the token
keeps its residual), as Switch Transformer and GShard drop them.

Two kinds of experts are computed: the fused experts of transformers 5 (Mixtral, Qwen2-MoE,
...: ``gate_up_proj`` of shape ``[experts, 2 x intermediate, hidden]``, ``down_proj`` of
``[experts, hidden, intermediate]``, ``act_fn``; :func:`shard_fused_experts` replaces their
forward), and a ``ModuleList`` of expert MLPs (atorch/parallel_layers/expert_list.py).
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


def fused_shape(module: nn.Module) -> str | None:
    """Why ``module`` is not a fused experts module this dispatch computes, or None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and hasattr(module, "act_fn")):
        return (f"{type(module).__name__} is not a fused experts module (gate_up_proj and down_proj weights of shape "
                "[experts, ...] and an act_fn, as transformers 5's Mixtral and Qwen2-MoE hold them)")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return f"{type(module).__name__}'s gate_up_proj and down_proj are not [experts, ...] weights"
    if any(getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
        return f"{type(module).__name__} has expert biases, which this dispatch does not compute"
    return None


def mark_slice(param: nn.Parameter, owner: nn.Module, group, replicas, hooks: bool = True) -> None:
    """Make ``param`` one of this rank's expert weights: held apart from the data ranks, its
    gradient divided by the group's size and, where the same slice lives on other ranks (expert
    groups smaller than the data ranks), averaged over them. Without ``hooks``, fsdp will shard
    the slice over those copies and reduce it (:func:`over_copies`, then atorch/sharding/fsdp2.py
    ``shard_expert_copies``): the mark only.

    A slice's gradient, which the all-to-all's backward brings from every token of the group, is
    divided by the group's size: each rank's loss is a mean over its own tokens, averaged over
    the ranks as DDP averages the other gradients. Under gradient accumulation the copies are
    averaged after the last micro-batch only (``owner._atorch_expert_sync``, which
    atorch/auto/loop.py's ``set_gradient_sync`` turns off for the others). An average, not a sum:
    averaging again what is already equal on every copy leaves it equal, so a loop that never
    turns it off stays right.
    """
    scale = 1.0 / dist.get_world_size(group)
    param.expert_parallel = True
    param.shard_group = group  # clip_grad_norm sums a sharded weight's norm over this group
    param.replica_group = replicas  # a pipeline averages the copies itself, once a step
    if not hooks:
        return
    param.register_hook(lambda grad: grad * scale)
    if replicas is not None and dist.get_world_size(replicas) > 1:
        param.register_post_accumulate_grad_hook(lambda p: _average(p, owner, replicas))
    owner._atorch_expert_sync = True


def _average(param: nn.Parameter, owner: nn.Module, replicas) -> None:
    if owner._atorch_expert_sync:
        average_over_copies(param, replicas)


def average_over_copies(param: nn.Parameter, replicas) -> None:
    """``param``'s gradient averaged over ``replicas``, the ranks that hold the same slice."""
    if replicas is not None and dist.get_world_size(replicas) > 1:
        dist.all_reduce(param.grad, group=replicas)
        param.grad.div_(dist.get_world_size(replicas))


def over_copies(module: nn.Module, group, replicas, data: int) -> None:
    """Say that fsdp is to shard ``module`` (this rank's experts) over ``replicas``, the ranks that
    hold the same slice, and divide its reduced gradients by ``data`` (the data-parallel ranks:
    a slice's gradient sums the contributions of the ``data / copies`` ranks of its group and
    of its copies). torchtitan and Megatron-Core shard the experts so (EP x FSDP)."""
    module._atorch_expert_copies = (replicas, group, data)


def shard_fused_experts(module: nn.Module, group, replicas=None, capacity_factor: float | None = None,
                        hooks: bool = True) -> None:
    """Keep this rank's slice of ``module``'s fused experts and route its tokens over ``group``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = module.gate_up_proj.shape[0] // size
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(module, name)
        shard = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone(), requires_grad=full.requires_grad)
        mark_slice(shard, module, group, replicas, hooks)
        # a checkpoint stores the slices as one weight split on dim 0 over the group, as it does
        # a tensor-parallel layer's (atorch/checkpoint/state.py reads these and ``module.group``;
        # ``split_dims`` where fsdp has made them DTensors, which lose these attributes)
        shard.tensor_model_parallel, shard.partition_dim = True, 0
        setattr(module, name, shard)
    module.group, module.split_dims = group, {"gate_up_proj": 0, "down_proj": 0}
    module.forward = Dispatch(group, local, _FusedSlice(module), capacity_factor)


class _FusedSlice:
    """The rows sent to this rank through its slice of a fused experts module (``ids`` local)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, rows: torch.Tensor, ids: torch.Tensor, local: int) -> torch.Tensor:
        module = self.module
        out = rows.new_zeros(rows.shape[0], module.down_proj.shape[1])
        for expert, where in _rows_of(ids, local):
            # in the rows' dtype: fsdp's mixed precision hands the block bf16 inputs while the
            # experts' slices, outside its units, stay fp32 (a differentiable cast, as FSDP's)
            gate_up, down = module.gate_up_proj[expert], module.down_proj[expert]
            gate, up = F.linear(rows[where], gate_up.to(rows.dtype)).chunk(2, dim=-1)
            part = F.linear(module.act_fn(gate) * up, down.to(rows.dtype))
            out = out.index_add(0, where, part.to(out.dtype))
        if rows.shape[0] == 0 and torch.is_grad_enabled():
            out = out + untouched([module.gate_up_proj, module.down_proj, rows], out.dtype)
        return out


def untouched(tensors, dtype: torch.dtype) -> torch.Tensor:
    """0, joined to ``tensors`` in the graph: experts no token reached still get (zero) gradients,
    so every rank's backward runs the same hooks and collectives (the copies' all-reduce); and the
    (empty) rows that arrived stay an input of the result, so a backward to the block's inputs
    only (a pipeline stage's input gradients: torch.distributed.pipelining's shape inference, a
    split backward) still runs the all-to-alls back on this rank, as on the ranks that got rows."""
    return 0 * sum(t.sum() for t in tensors).to(dtype)


def _rows_of(ids: torch.Tensor, local: int):
    """(local expert, the rows sent to it) for each of this rank's experts that got any."""
    for expert in range(local):
        where = (ids == expert).nonzero().squeeze(-1)
        if where.numel():
            yield expert, where


def capacity_keep(top_k_index: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """Which (token, choice) pairs, flattened token-major, an expert with a capacity of
    ``ceil(factor x pairs / experts)`` takes: the first ones in token order."""
    flat = top_k_index.reshape(-1)
    capacity = math.ceil(factor * flat.numel() / experts)
    seen = F.one_hot(flat, experts).cumsum(0)  # pairs for each expert so far, this one included
    return seen.gather(1, flat[:, None]).squeeze(1) <= capacity


class Dispatch:
    """The routed experts' forward over an expert group (see the module docstring)."""

    def __init__(self, group, local: int, compute, capacity_factor: float | None = None):
        self.group, self.size = group, dist.get_world_size(group)
        self.first, self.local, self.compute = dist.get_rank(group) * local, local, compute
        self.capacity_factor = capacity_factor
        self.dropped = 0  # pairs the capacity left out in the last forward (this rank's tokens)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from torch.distributed.nn.functional import all_to_all_single

        pairs = torch.arange(top_k_index.numel(), device=top_k_index.device)
        if self.capacity_factor is not None:
            keep = capacity_keep(top_k_index, self.local * self.size, self.capacity_factor)
            pairs = pairs[keep]
            self.dropped = int(keep.numel() - pairs.numel())
        flat = top_k_index.reshape(-1)[pairs]
        order = torch.argsort(flat, stable=True)  # by expert, hence by the rank that holds it
        chosen, pairs = flat[order], pairs[order]
        token = pairs // top_k_index.shape[-1]
        sent = torch.bincount(chosen // self.local, minlength=self.size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        send, recv = sent.tolist(), received.tolist()
        rows = hidden_states[token]
        arrived = all_to_all_single(rows.new_empty(sum(recv), rows.shape[-1]), rows, recv, send, group=self.group)
        ids = chosen.new_empty(sum(recv))
        dist.all_to_all_single(ids, chosen, recv, send, group=self.group)
        computed = self.compute(arrived, ids - self.first, self.local)
        back = all_to_all_single(computed.new_empty(len(pairs), computed.shape[-1]), computed, send, recv,
                                 group=self.group)
        weights = top_k_weights.reshape(-1)[pairs]
        weighted = (back * weights[:, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted)
