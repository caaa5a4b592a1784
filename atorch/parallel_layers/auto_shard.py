"""Shard an already built model with the tensor-parallel layers, keeping its math.

Recognized structures (by what a module holds, not by class name):
- attention with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` Linears (Llama, Mistral, Qwen, ...):
  q, k, v column-parallel (each rank keeps whole heads), o row-parallel;
- gated MLPs with ``gate_proj``/``up_proj``/``down_proj``: gate and up column, down row;
- plain MLPs, an ``nn.Sequential`` of Linear, element-wise activations, Linear: column then row;
- BERT: ``self.query/key/value`` column and ``output.dense`` row in attention, ``intermediate.dense``
  column and ``output.dense`` row in the MLP;
- GPT-2: the fused ``c_attn`` Conv1D split per q/k/v (each rank keeps whole heads of each), its
  ``c_proj`` row; ``c_fc`` column and ``c_proj`` row in the MLP;
- the input embedding (vocab rows split) and the output head (column-parallel, gathered), unless
  they share one weight.
"""

from collections.abc import Iterable

import torch
from torch import nn

from atorch.parallel_layers.layers import ColumnParallelLinear, column_from_linear, embedding_from, row_from_linear
from atorch.utils.modules import find_block_classes, first_block

_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.LeakyReLU, nn.Mish)


class ShardingError(ValueError):
    """The model holds a structure tensor_parallel cannot split as asked."""


def _children(module: nn.Module, names: Iterable[str]) -> list[nn.Linear] | None:
    """The Linears at these (dotted) paths under ``module``, or None if any is missing."""
    found = []
    for name in names:
        child = module
        for part in name.split("."):
            child = getattr(child, part, None) if isinstance(child, nn.Module) else None
        found.append(child)
    return found if all(type(m) is nn.Linear for m in found) else None


def _is_conv1d(module) -> bool:
    # transformers' Conv1D: a Linear with its weight stored (in, out)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.ndim == 2


def _linear_from_conv1d(conv: nn.Module, row_order: torch.Tensor | None = None) -> nn.Linear:
    weight = conv.weight.detach().t()
    bias = conv.bias.detach()
    if row_order is not None:
        weight, bias = weight[row_order], bias[row_order]
    linear = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    linear.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), conv.weight.requires_grad)
    linear.bias = nn.Parameter(bias.clone(), conv.bias.requires_grad)
    return linear


def _qkv_rows(out_features: int, tp: int) -> torch.Tensor:
    """Row order of a fused [q; k; v] weight so that contiguous chunk r holds q_r, k_r, v_r."""
    part = out_features // 3
    rows = torch.arange(out_features).reshape(3, tp, part // tp)  # (q/k/v, rank, rows)
    return rows.transpose(0, 1).reshape(-1)


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
        bert_attention = _children(module, ("self.query", "self.key", "self.value", "output.dense"))
        if bert_attention:
            head_dim = getattr(getattr(module, "self"), "attention_head_size", None)
            for child in ("self.query", "self.key", "self.value"):
                _check_divides(prefix + child, bert_attention[0].out_features, tp, head_dim)
                plan.append((prefix + child, "column"))
            plan.append((prefix + "output.dense", "row"))
            continue
        bert_mlp = _children(module, ("intermediate.dense", "output.dense"))
        if bert_mlp and not any(n.startswith(prefix + "output.") for n, _ in plan):
            _check_divides(prefix + "intermediate.dense", bert_mlp[0].out_features, tp)
            plan += [(prefix + "intermediate.dense", "column"), (prefix + "output.dense", "row")]
        if _is_conv1d(getattr(module, "c_attn", None)) and _is_conv1d(getattr(module, "c_proj", None)):
            embed = module.c_attn.nf // 3
            _check_divides(prefix + "c_attn", embed, tp, getattr(module, "head_dim", None))
            plan += [(prefix + "c_attn", "column_conv1d_qkv"), (prefix + "c_proj", "row_conv1d")]
            continue
        if _is_conv1d(getattr(module, "c_fc", None)) and _is_conv1d(getattr(module, "c_proj", None)):
            _check_divides(prefix + "c_fc", module.c_fc.nf, tp)
            plan += [(prefix + "c_fc", "column_conv1d"), (prefix + "c_proj", "row_conv1d")]
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


def split_regions(model: nn.Module) -> list[str]:
    """The modules whose work tensor parallelism splits whole: the parents of :func:`plan_shards`'
    column and row layers that hold no weight of their own kind besides them (a Llama's attention
    and MLP; not BERT's output block, whose LayerNorm runs on the whole features). What runs
    outside them runs whole on every tensor rank (the cost model's element-wise traffic)."""
    try:
        plan = plan_shards(model, 1)
    except Exception:  # noqa: BLE001 - a model tensor parallelism cannot plan has no regions
        return []
    split = {name for name, how in plan if how not in ("embedding", "column_gather")}
    parents = {name.rpartition(".")[0] for name in split}
    regions = []
    for parent in sorted(parents):
        module = model.get_submodule(parent)
        holders = [f"{parent}.{child}" if parent else child for child, m in module.named_children()
                   if any(True for _ in m.parameters())]
        if holders and all(name in split for name in holders):
            regions.append(parent)
    return regions


_SEQUENCE_PARALLEL_KINDS = {"column", "row", "embedding", "column_gather"}


class _SequenceInput:
    """Replaces a module's forward so its hidden-states input (first argument, or
    ``hidden_states`` / ``x``) is split on the sequence dim first (``scatter``: entering the
    sequence-parallel region) or all-gathered (an attention or MLP block, which then computes
    its shapes from the whole sequence as it was written to)."""

    def __init__(self, forward, group, scatter: bool):
        self.forward, self.group, self.scatter = forward, group, scatter

    def __call__(self, *args, **kwargs):
        from atorch.parallel_layers.mappings import gather_from_sequence, scatter_to_sequence

        move = scatter_to_sequence if self.scatter else gather_from_sequence
        if args:
            args = (move(args[0], self.group), *args[1:])
        else:
            key = "hidden_states" if "hidden_states" in kwargs else "x"
            kwargs[key] = move(kwargs[key], self.group)
        return self.forward(*args, **kwargs)


class _SummedGradients:
    """Replaces a module's forward so its replicated parameters enter the computation through
    ``copy_to_region``: identity forward, gradient summed over the tensor group in backward.

    Under sequence parallelism a norm's weight sees only this rank's tokens, so its gradient is
    partial. Summing inside autograd, before the gradient reaches the parameter, holds under any
    wrapper: a hook on the parameter object did not, since FSDP2 (fsdp, zero2) replaces the
    parameters with its own when it shards them, and each tensor rank's norms then trained on its
    own half of the tokens and drifted apart.
    """

    def __init__(self, forward, module: nn.Module, names: list[str], group):
        self.forward, self.module, self.names, self.group = forward, module, names, group

    def __call__(self, *args, **kwargs):
        from atorch.parallel_layers.mappings import copy_to_region

        params = self.module._parameters
        # Whatever holds the names now: the parameters, or FSDP2's gathered ones inside its unit.
        saved = {name: params[name] for name in self.names}
        for name, param in saved.items():
            params[name] = copy_to_region(param, self.group)
        try:
            return self.forward(*args, **kwargs)
        finally:
            params.update(saved)


def _sequence_parallel_grads(model: nn.Module, group) -> int:
    """Replicated parameters run on sequence chunks under sequence parallelism (the norms): each
    rank's gradient covers its own tokens, so they are summed over the group in backward (see
    :class:`_SummedGradients`)."""
    count = 0
    for module in model.modules():
        names = [name for name, param in module.named_parameters(recurse=False)
                 if param.requires_grad and not getattr(param, "tensor_model_parallel", False)]
        if not names:
            continue
        for name in names:
            # Summed already: allreduce_sequence_parallel_grads must not sum it again.
            module._parameters[name].sequence_parallel = False
        module.forward = _SummedGradients(module.forward, module, names, group)
        count += len(names)
    return count


def _fork_rng_in_attention(model: nn.Module, plan, group) -> None:
    """Attention runs on split heads: its dropout draws from the per-rank stream of a tracker of
    this model's own (attached to it, see atorch/parallel_layers/random.py), seeded here from the
    default stream's seed (equal on the group's ranks) plus the rank in ``group``. Only modules
    whose forward holds nothing but the split heads are forked (Llama-style attention, BERT's
    self-attention); GPT-2's attention also drops out its replicated output, so it stays on the
    default stream (its head masks are then alike across ranks)."""
    import torch.distributed as dist

    from atorch.parallel_layers.random import MODEL_PARALLEL_RNG, ForkedForward, RNGStatesTracker, attach_tracker

    tracker = RNGStatesTracker()
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.initial_seed())))
    rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    tracker.add(MODEL_PARALLEL_RNG, seed + rank)
    attach_tracker(model, tracker)
    modules = dict(model.named_modules())
    attention = {name.rpartition(".")[0] for name, how in plan if name.endswith(("q_proj", "self.query"))}
    for name in attention:
        modules[name].forward = ForkedForward(modules[name].forward, tracker)


def sequence_parallel_problem(model: nn.Module, plan: list[tuple[str, str]]) -> str | None:
    """Why sequence parallelism cannot run on ``model`` split as ``plan`` says, or None."""
    other = sorted({how for _, how in plan} - _SEQUENCE_PARALLEL_KINDS)
    has_head = any(how == "column_gather" for _, how in plan)
    if other or not has_head or not find_block_classes(model):
        return ("sequence_parallel supports Llama-style models (q/k/v/o_proj attention, repeated decoder blocks, "
                f"an untied output head); {type(model).__name__} has "
                f"{other or ('no splittable output head' if not has_head else 'no repeated blocks')}")
    return None


# shard_model's default sequence entry: the model's first repeated block
FIRST_BLOCK = "first block"


def shard_model(model: nn.Module, group, tp: int, sequence_parallel: bool = False,
                sequence_entry: nn.Module | str | None = FIRST_BLOCK) -> list[tuple[str, str]]:
    """Replace the planned modules in place with this rank's shards; return the plan.

    With ``sequence_parallel`` (Megatron's), the activations between a row-parallel output and
    the next column-parallel input (norms, residual adds) stay split on the sequence dim; this
    needs a model whose embedding feeds the blocks directly and whose head reads the last norm
    (the Llama family). The residual stream is split where it enters ``sequence_entry``: the
    model's first block by default. For one pipeline stage of a model (mixed_parallel), checked
    whole before it was cut: the model's first block where the stage holds it, else None (the
    stage's input arrives split from the stage before; a stage without the head hands its output
    on split).
    """
    plan = plan_shards(model, tp)
    whole = isinstance(sequence_entry, str) and sequence_entry == FIRST_BLOCK
    why = sequence_parallel_problem(model, plan) if sequence_parallel and whole else None
    if why is not None:
        raise ShardingError(why)
    if not any(how.startswith(("column", "row")) and how != "column_gather" for _, how in plan):
        raise ShardingError(
            f"tensor_parallel found nothing it can split in {type(model).__name__}: it knows attention with "
            "q_proj/k_proj/v_proj/o_proj, MLPs with gate_proj/up_proj/down_proj, and nn.Sequential(Linear, "
            "activation, Linear) blocks"
        )
    modules = dict(model.named_modules())
    sp = sequence_parallel
    build = {
        "column": lambda m: column_from_linear(m, group),
        "column_gather": lambda m: column_from_linear(m, group, gather_output=True, sequence_parallel_enabled=sp),
        "row": lambda m: row_from_linear(m, group, input_is_parallel=True, sequence_parallel_enabled=sp),
        "embedding": lambda m: embedding_from(m, group),
        "column_conv1d": lambda m: column_from_linear(_linear_from_conv1d(m), group),
        "column_conv1d_qkv": lambda m: column_from_linear(_linear_from_conv1d(m, _qkv_rows(m.nf, tp)), group),
        "row_conv1d": lambda m: row_from_linear(_linear_from_conv1d(m), group, input_is_parallel=True),
    }
    for name, how in plan:
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        with torch.no_grad():
            layer = build[how](modules[name])
        if "conv1d" in how:
            # Its weight is the transpose of the Conv1D it replaces (c_attn's rows also regrouped
            # per rank): atorch.checkpoint reads this to store the serial layout.
            layer.serial_layout = how
        setattr(parent, child, layer)
        if how == "column_conv1d_qkv":
            # GPT-2 splits the fused output by split_size and infers heads from it: both per rank now.
            parent.split_size //= tp
            if hasattr(parent, "num_heads"):
                parent.num_heads //= tp
            if hasattr(parent, "embed_dim"):
                parent.embed_dim //= tp
    _fork_rng_in_attention(model, plan, group)
    if sequence_parallel:
        # The residual stream is split on the sequence from the first block's input to the
        # output head: the model-level code before the blocks (positions, masks) sees it whole.
        first = first_block(model) if whole else sequence_entry
        if first is not None:
            first.forward = _SequenceInput(first.forward, group, scatter=True)
        for block in {name.rpartition(".")[0] for name, how in plan if how in ("column", "row")}:
            module = modules[block]
            module.forward = _SequenceInput(module.forward, group, scatter=False)
            for child in module.children():
                if isinstance(child, ColumnParallelLinear):
                    child.input_is_gathered = True
        _sequence_parallel_grads(model, group)
    return plan
