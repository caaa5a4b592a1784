"""Gradient clipping by the true global norm, whatever shards the gradients."""

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _local_power_sum(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max()
    return torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads]).sum()


def grad_norm(parameters: torch.nn.Module | Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, as the serial model would compute it.

    Plain gradients (DDP, ZeRO-1: the same on every rank) count once; sharded DTensor gradients
    (fsdp, zero2) contribute their local shard and are summed over the mesh dims they are split on.
    A parameter with a ``shard_group`` attribute (a process group, as the 3D layers of
    atorch.intra_layer and expert_parallel's slices set) holds a different piece on each rank of
    that group: summed over it too (after its mesh dims where fsdp shards it as well).
    """
    params = parameters.parameters() if isinstance(parameters, torch.nn.Module) else parameters
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    groups: dict[tuple, list[torch.Tensor]] = {}
    presummed = _presummed(params, norm_type, op)
    for p in params:
        if getattr(p, "presum_group", None) is not None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements), getattr(p, "shard_group", None)) if isinstance(g, DTensor) else None
        if key is None and getattr(p, "shard_group", None) is not None:
            key = ("group", p.shard_group)
        groups.setdefault(key, []).append(g.to_local() if isinstance(g, DTensor) else g)
    for key in presummed:
        groups.setdefault(key, [])
    parts = []
    for key, local in groups.items():
        part = _local_power_sum(local, norm_type) if local else torch.tensor(0.0)
        if key in presummed:  # summed over their own group first: one more piece of this key's
            part = torch.maximum(part, presummed[key]) if is_inf else part + presummed[key]
        if key is not None and isinstance(key[0], str):  # ("group", shard_group)
            dist.all_reduce(part, op=op, group=key[1])
        elif key is not None:
            mesh, placements, pieces = key
            for dim, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    dist.all_reduce(part, op=op, group=mesh.get_group(dim))
            if pieces is not None:
                dist.all_reduce(part, op=op, group=pieces)
        parts.append(part)
    total = torch.stack([p.to(parts[0].device) for p in parts])
    return total.max() if is_inf else total.sum() ** (1.0 / norm_type)


def _presummed(params: list[torch.Tensor], norm_type: float, op) -> dict[tuple, torch.Tensor]:
    """The power sums of the parameters that carry a ``presum_group`` (expert_parallel's slices in
    a pipeline stage: other experts on each rank of their expert group, other layers on each
    stage), each summed over that group first, by ``("group", shard_group)`` key, where they join
    the other parameters of the key (the pipeline's): every rank of a stage holds them alike."""
    pending: dict[tuple, dict] = {}
    for p in params:
        if getattr(p, "presum_group", None) is not None:
            pending.setdefault(("group", p.shard_group), {}).setdefault(p.presum_group, []).append(p.grad)
    out = {}
    for key, by_group in pending.items():
        sums = []
        for group, grads in by_group.items():
            part = _local_power_sum(grads, norm_type)
            dist.all_reduce(part, op=op, group=group)
            sums.append(part)
        out[key] = torch.stack(sums).max() if op == dist.ReduceOp.MAX else torch.stack(sums).sum()
    return out


def clip_grad_norm(model: torch.nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before clipping.

    Works under every strategy (DDP, zero1, zero2, fsdp, single process) and equals
    ``torch.nn.utils.clip_grad_norm_`` on the serial model. With fp16 ``amp_native``, call
    ``optim.unscale_()`` first.

    Example::

        loss.backward()
        norm = atorch.auto.clip_grad_norm(result.model, 1.0)
        optim.step()
    """
    if type(model).__name__ == "DeepSpeedEngine":
        from atorch.errors import NotSupportedError

        raise NotSupportedError(
            "DeepSpeed clips inside its engine: set it in the strategy, e.g. "
            "('zero2', {'use_ds_zero': True, 'ds_config': {'gradient_clipping': 1.0}})"
        )
    sharded_optims = getattr(model, "_sharded_optimizers", None)
    if sharded_optims:
        # fairscale's ShardedDataParallel keeps each gradient only on the rank that owns its
        # parameter; its OSS optimizer knows the split and computes the global norm itself.
        return sharded_optims[0].clip_grad_norm(max_norm, norm_type)
    params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
    total = grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coef.to(grad.device, grad.dtype))
    return total
