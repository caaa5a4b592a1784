"""Expert parallelism for fused routed experts: each rank of an expert group keeps a slice of the
experts, and the tokens reach them, and come back, by all-to-all.

A fused experts module (transformers 5's Mixtral, Qwen2-MoE, ...: ``gate_up_proj`` of shape
``[experts, 2 x intermediate, hidden]``, ``down_proj`` of ``[experts, hidden, intermediate]``,
``act_fn``) is called as ``experts(hidden_states, top_k_index, top_k_weights)`` with this rank's
tokens. :func:`shard_fused_experts` keeps the rank's ``experts / size`` experts and replaces the
forward: every (token, choice) pair is sent to the rank holding its expert (one all-to-all of
the counts, one of the hidden states and one of the expert ids), computed there, and sent back
(one all-to-all), then weighted by its routing weight and summed per token, as the serial module
does. No token is dropped (no capacity limit). Both data all-to-alls carry autograd (backward
runs them in reverse), so each expert's gradient sums the contributions of every rank's tokens.
"""

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


def shard_fused_experts(module: nn.Module, group, replicas=None) -> None:
    """Keep this rank's slice of ``module``'s experts and route its tokens over ``group``.

    A slice's gradient, which the all-to-all's backward brings from every token of the group, is
    divided by the group's size: each rank's loss is a mean over its own tokens, averaged over
    the ranks as DDP averages the other gradients. ``replicas``, when the same slice lives on other
    ranks (expert groups smaller than the data ranks), averages it over them; under gradient
    accumulation after the last micro-batch only (``module._atorch_expert_sync``, which
    atorch/auto/loop.py's ``set_gradient_sync`` turns off for the others). An average, not a sum:
    averaging again what is already equal on every replica leaves it equal, so a loop that never
    turns it off stays right.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    scale = 1.0 / size
    replicated = replicas is not None and dist.get_world_size(replicas) > 1
    module._atorch_expert_sync = True
    experts = module.gate_up_proj.shape[0]
    local = experts // size
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(module, name)
        shard = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone(), requires_grad=full.requires_grad)
        shard.expert_parallel = True
        shard.shard_group = group  # clip_grad_norm sums a sharded weight's norm over this group
        # a checkpoint stores the slices as one weight split on dim 0 over the group, as it does
        # a tensor-parallel layer's (atorch/checkpoint/state.py reads these and ``module.group``)
        shard.tensor_model_parallel, shard.partition_dim = True, 0
        shard.register_hook(lambda grad: grad * scale)
        if replicated:
            shard.register_post_accumulate_grad_hook(lambda p: _average(p, module, replicas))
        setattr(module, name, shard)
    module.group = group
    module.forward = _Dispatch(module, group, size, rank, local)


def _average(param: nn.Parameter, module: nn.Module, replicas) -> None:
    if module._atorch_expert_sync:
        dist.all_reduce(param.grad, group=replicas)
        param.grad.div_(dist.get_world_size(replicas))


class _Dispatch:
    def __init__(self, module: nn.Module, group, size: int, rank: int, local: int):
        self.module, self.group, self.size, self.first, self.local = module, group, size, rank * local, local

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from torch.distributed.nn.functional import all_to_all_single

        choices = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, hence by the rank that holds it
        chosen = flat[order]
        token = order // choices
        sent = torch.bincount(chosen // self.local, minlength=self.size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        send, recv = sent.tolist(), received.tolist()
        rows = hidden_states[token]
        arrived = all_to_all_single(rows.new_empty(sum(recv), rows.shape[-1]), rows, recv, send, group=self.group)
        ids = chosen.new_empty(sum(recv))
        dist.all_to_all_single(ids, chosen, recv, send, group=self.group)
        computed = self._experts(arrived, ids - self.first)
        back = all_to_all_single(computed.new_empty(len(order), computed.shape[-1]), computed, send, recv,
                                 group=self.group)
        weights = top_k_weights.reshape(-1)[order]
        weighted = (back * weights[:, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted)

    def _experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        module = self.module
        out = rows.new_zeros(rows.shape[0], module.down_proj.shape[1])
        used = False
        for expert in range(self.local):
            where = (ids == expert).nonzero().squeeze(-1)
            if where.numel() == 0:
                continue
            # in the rows' dtype: fsdp's mixed precision hands the block bf16 inputs while the
            # experts' slices, outside its units, stay fp32 (a differentiable cast, as FSDP's)
            gate_up, down = module.gate_up_proj[expert], module.down_proj[expert]
            gate, up = F.linear(rows[where], gate_up.to(rows.dtype)).chunk(2, dim=-1)
            part = F.linear(module.act_fn(gate) * up, down.to(rows.dtype))
            out = out.index_add(0, where, part.to(out.dtype))
            used = True
        if not used and torch.is_grad_enabled():
            # No token reached this rank's experts: zero gradients all the same, so every rank's
            # backward (and the replicas' all-reduce) runs the same collectives.
            out = out + 0 * (module.gate_up_proj.sum() + module.down_proj.sum()).to(out.dtype)
        return out
