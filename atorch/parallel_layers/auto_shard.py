"""Shard an already built model with the tensor-parallel layers, keeping its math.

Recognized structures (by what a module holds, not by class name):
- attention with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` Linears (Llama, Mistral, Qwen, ...):
  q, k, v column-parallel (each rank keeps whole heads), o row-parallel;
- gated MLPs with ``gate_proj``/``up_proj``/``down_proj``: gate and up column, down row;
- plain MLPs, an ``nn.Sequential`` of Linear, element-wise activations, Linear: column then row;
- the input embedding (vocab rows split) and the output head (column-parallel, gathered), unless
  they share one weight.
"""

from collections.abc import Iterable

import torch
from torch import nn

from atorch.parallel_layers.layers import column_from_linear, embedding_from, row_from_linear

_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.LeakyReLU, nn.Mish)


class ShardingError(ValueError):
    """The model holds a structure tensor_parallel cannot split as asked."""


def _children(module: nn.Module, names: Iterable[str]) -> list[nn.Linear] | None:
    found = [getattr(module, name, None) for name in names]
    return found if all(type(m) is nn.Linear for m in found) else None


def _check_divides(name: str, features: int, tp: int, head_dim: int | None = None) -> None:
    if features % tp:
        raise ShardingError(f"{name}: {features} features do not divide over {tp} tensor-parallel ranks")
    if head_dim and (features // head_dim) % tp:
        raise ShardingError(
            f"{name}: {features // head_dim} heads do not divide over {tp} ranks; pad the heads first "
            "(atorch.parallel_layers.pad_model) or pick a tensor size that divides them"
        )


def plan_shards(model: nn.Module, tp: int) -> list[tuple[str, str]]:
    """``(module name, how)`` for every module to replace; how is column, column_gather, row or embedding."""
    plan: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        attention = _children(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
        if attention:
            head_dim = getattr(module, "head_dim", None)
            for child, how in zip(("q_proj", "k_proj", "v_proj", "o_proj"), ("column",) * 3 + ("row",)):
                linear = getattr(module, child)
                _check_divides(prefix + child, linear.out_features if how == "column" else linear.in_features, tp,
                               head_dim)
                plan.append((prefix + child, how))
            continue
        gated = _children(module, ("gate_proj", "up_proj", "down_proj"))
        if gated:
            _check_divides(prefix + "up_proj", gated[1].out_features, tp)
            plan += [(prefix + "gate_proj", "column"), (prefix + "up_proj", "column"), (prefix + "down_proj", "row")]
            continue
        if isinstance(module, nn.Sequential) and len(module) >= 2:
            first, last, middle = module[0], module[-1], list(module)[1:-1]
            if type(first) is nn.Linear and type(last) is nn.Linear and all(isinstance(m, _ELEMENTWISE) for m in middle):
                _check_divides(f"{prefix}0", first.out_features, tp)
                plan += [(f"{prefix}0", "column"), (f"{prefix}{len(module) - 1}", "row")]
    taken = {n for n, _ in plan}
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = inputs is not None and outputs is not None and inputs.weight is outputs.weight
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(inputs, nn.Embedding) and not tied and inputs.num_embeddings % tp == 0:
        plan.append((names[id(inputs)], "embedding"))
    if type(outputs) is nn.Linear and not tied and outputs.out_features % tp == 0 and names[id(outputs)] not in taken:
        plan.append((names[id(outputs)], "column_gather"))
    return plan


def shard_model(model: nn.Module, group, tp: int) -> list[tuple[str, str]]:
    """Replace the planned modules in place with this rank's shards; return the plan."""
    plan = plan_shards(model, tp)
    if not any(how in ("column", "row") for _, how in plan):
        raise ShardingError(
            f"tensor_parallel found nothing it can split in {type(model).__name__}: it knows attention with "
            "q_proj/k_proj/v_proj/o_proj, MLPs with gate_proj/up_proj/down_proj, and nn.Sequential(Linear, "
            "activation, Linear) blocks"
        )
    modules = dict(model.named_modules())
    build = {
        "column": lambda m: column_from_linear(m, group),
        "column_gather": lambda m: column_from_linear(m, group, gather_output=True),
        "row": lambda m: row_from_linear(m, group, input_is_parallel=True),
        "embedding": lambda m: embedding_from(m, group),
    }
    for name, how in plan:
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        with torch.no_grad():
            setattr(parent, child, build[how](modules[name]))
    return plan
