"""Pad attention heads to a multiple of the tensor-parallel degree, leaving outputs unchanged.

An added head has zero query, key and value weights and a zero slice of the output projection:
its attention output is zero and contributes nothing, so the padded model computes exactly what
the original did, and its heads now divide over the ranks.
"""

from collections.abc import Callable, Sequence

import torch
from torch import nn

from atorch.auto.config_types import class_matches


def get_number_of_extra_heads(num_heads: int, tp_degree: int) -> int:
    """How many heads to add so that ``num_heads`` divides over ``tp_degree`` ranks."""
    if num_heads < 1 or tp_degree < 1:
        raise ValueError(f"num_heads ({num_heads}) and tp_degree ({tp_degree}) must be positive")
    return (-num_heads) % tp_degree


def _pad_rows(linear: nn.Linear, extra: int) -> None:
    """Append ``extra`` zero output features to ``linear``."""
    with torch.no_grad():
        weight = torch.cat([linear.weight, linear.weight.new_zeros(extra, linear.in_features)])
        linear.weight = nn.Parameter(weight, linear.weight.requires_grad)
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.cat([linear.bias, linear.bias.new_zeros(extra)]), linear.bias.requires_grad)
    linear.out_features += extra


def _pad_cols(linear: nn.Linear, extra: int) -> None:
    """Append ``extra`` zero input features to ``linear``."""
    with torch.no_grad():
        weight = torch.cat([linear.weight, linear.weight.new_zeros(linear.out_features, extra)], dim=1)
        linear.weight = nn.Parameter(weight, linear.weight.requires_grad)
    linear.in_features += extra


def _projections(module: nn.Module):
    """(q, k, v, o) Linears of a Llama-style or BERT attention module, else None."""
    for names in (("q_proj", "k_proj", "v_proj", "o_proj"),):
        found = [getattr(module, n, None) for n in names]
        if all(type(m) is nn.Linear for m in found):
            return found
    inner, output = getattr(module, "self", None), getattr(module, "output", None)
    if inner is not None and output is not None:
        found = [getattr(inner, "query", None), getattr(inner, "key", None), getattr(inner, "value", None),
                 getattr(output, "dense", None)]
        if all(type(m) is nn.Linear for m in found):
            return found
    return None


def pad_model(model: nn.Module, tp_degree: int, n_heads: int, wrapped_classes: Sequence = (),
              pad_hook_fn: Callable[[nn.Module, int], None] | None = None) -> nn.Module:
    """Add zero heads to every attention module so ``n_heads`` divides over ``tp_degree``.

    ``wrapped_classes`` limits padding to modules of these classes (or class names);
    ``pad_hook_fn(module, extra_heads)`` is called on each padded module so a custom attention
    can update its own bookkeeping. Grouped-query attention (fewer key/value heads) is refused:
    padding only query heads would change which keys each query reads.
    """
    extra = get_number_of_extra_heads(n_heads, tp_degree)
    if extra == 0:
        return model
    names = [c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}" for c in wrapped_classes]
    padded = 0
    for module in model.modules():
        if names and not any(class_matches(type(module), n) for n in names):
            continue
        projections = _projections(module)
        if projections is None:
            continue
        q, k, v, o = projections
        if q.out_features % n_heads:
            raise ValueError(f"{type(module).__name__}: {q.out_features} query features are not {n_heads} heads")
        head_dim = q.out_features // n_heads
        if k.out_features != q.out_features or v.out_features != q.out_features:
            raise ValueError(f"{type(module).__name__} uses grouped-query attention; pad_model supports equal "
                             "query and key/value heads")
        for linear in (q, k, v):
            _pad_rows(linear, extra * head_dim)
        _pad_cols(o, extra * head_dim)
        inner = getattr(module, "self", module)
        for attr, value in (("num_attention_heads", n_heads + extra), ("num_heads", n_heads + extra),
                            ("all_head_size", (n_heads + extra) * head_dim)):
            if isinstance(getattr(inner, attr, None), int):
                setattr(inner, attr, value)
        if pad_hook_fn is not None:
            pad_hook_fn(module, extra)
        padded += 1
    if padded == 0:
        raise ValueError(f"pad_model found no attention module to pad in {type(model).__name__}")
    return model


def move_model_to_device(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to(device)`` that keeps the tensor-parallel attributes on every parameter.

    ``Module.to`` keeps Parameter objects (and so their attributes) when it can change them in
    place; when it must create new ones, this copies the attributes over.
    """
    keep = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel")
    saved = {name: {a: getattr(p, a) for a in keep if hasattr(p, a)} for name, p in model.named_parameters()}
    model.to(device)
    for name, param in model.named_parameters():
        for attr, value in saved.get(name, {}).items():
            setattr(param, attr, value)
    return model
