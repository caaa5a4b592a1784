"""tensor_parallel: split an already built model's layers over the ``tensor`` dim (Megatron style).

Config forms: ``"tensor_parallel"`` with ``("parallel_mode", ([("tensor", 2), ("data", N)], None))``.
Attention and MLP projections (Llama-style, BERT, GPT-2, plain MLP blocks) become column- then
row-parallel layers, the embedding and output head are split by vocabulary (see
atorch/parallel_layers/auto_shard.py for what is recognized); the math stays that of the serial
model. Composes with DDP and fsdp over the data dim.

``{"algorithm": "3d", "row": R, "col": C, "depth": D}`` (R x C x D = the tensor dim) runs AxoNN's
3D algorithm instead (atorch/intra_layer): every plain ``nn.Linear`` that divides the grid becomes
an ``intra_layer.Linear`` carrying its weights, the batch is split over data x depth, and
gradient hooks take DDP's place (see docs/intra_layer.md).
"""

import math
from typing import Literal

from pydantic import Field, model_validator

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import LayoutJob, MethodSpec, Stage, register_method
from atorch.auto.step_cost import Comm
from atorch.errors import MethodConfigError, StrategyConflictError
from atorch.parallel_layers.auto_shard import ShardingError, plan_shards, shard_model
from atorch.utils.log import logger
from atorch.utils.memo import once


class TensorParallelConfig(MethodConfig):
    algorithm: Literal["1d", "megatron", "3d"] = Field(
        default="1d", description="1d (or megatron): column/row-parallel layers; 3d: AxoNN's row x col x depth grid"
    )
    row: int | None = Field(default=None, ge=1, description="3d only: size of the row group (unset: 1)")
    col: int | None = Field(default=None, ge=1, description="3d only: size of the column group (unset: 1)")
    depth: int | None = Field(default=None, ge=1, description="3d only: size of the depth group (unset: 1)")

    @model_validator(mode="after")
    def _grid_only_for_3d(self) -> "TensorParallelConfig":
        given = [name for name in ("row", "col", "depth") if getattr(self, name) is not None]
        if given and self.algorithm != "3d":
            raise ValueError(f"{given} only apply to algorithm '3d'; set \"algorithm\": \"3d\" or remove them")
        return self

    @property
    def grid(self) -> tuple[int, int, int]:
        """(row, col, depth) of the 3d algorithm, unset sizes as 1."""
        return (self.row or 1, self.col or 1, self.depth or 1)


# Each of these would treat the depth-sharded 3D weights as replicated or ignore the 3D layout.
_NOT_WITH_3D = ("fsdp", "zero1", "zero2", "sequence_parallel")


def shard_3d(ctx: ModelContext, config: TensorParallelConfig) -> None:
    from atorch.intra_layer import install_gradient_sync, parallelize_model

    tensor = ctx.topology.size("tensor")
    row, col, depth = config.grid
    if row * col * depth != tensor:
        raise MethodConfigError(
            f"tensor_parallel 3d: row x col x depth = {row} x {col} x {depth} = {math.prod(config.grid)} but "
            f"parallel_mode's tensor dim has size {tensor}; set row, col and depth so they multiply to {tensor} "
            f"(for example {{\"algorithm\": \"3d\", \"row\": {tensor}}}) or change the tensor dim to "
            f"{math.prod(config.grid)}"
        )
    clash = [name for name in _NOT_WITH_3D if ctx.strategy is not None and name in ctx.strategy]
    if clash:
        raise StrategyConflictError(
            f"tensor_parallel 3d shards its weights over depth itself (ZeRO-3 inside each layer) and cannot be "
            f"combined with {clash[0]}; remove {clash[0]} or use algorithm '1d'"
        )
    ctx.topology.split_tensor(row, col, depth)
    replaced = parallelize_model(ctx.model, ctx.topology)
    if not replaced:
        raise MethodConfigError(
            f"tensor_parallel 3d found no nn.Linear in {type(ctx.model).__name__} whose sizes divide the grid "
            f"(input features by the column size {col}, output features by row x depth = {row * depth}); "
            "change the grid or use algorithm '1d'"
        )
    # DDP would average the weight shards over depth, where they differ: hooks reduce each
    # gradient over its own group instead (data x depth, or the data replicas of a shard).
    install_gradient_sync(ctx.model, ctx.topology, mean=True)  # the loss is a mean over each rank's share
    ctx.wrapped_by = "tensor_parallel"
    logger.info("tensor_parallel: 3d grid row %d x col %d x depth %d, %d Linear layers: %s", row, col, depth,
                len(replaced), ", ".join(replaced))


def shard(ctx: ModelContext, config: TensorParallelConfig) -> None:
    if config.algorithm == "3d":
        shard_3d(ctx, config)
        return
    tp = ctx.topology.size("tensor")
    sequence_parallel = ctx.strategy is not None and "sequence_parallel" in ctx.strategy
    try:
        plan = shard_model(ctx.model, ctx.topology.group("tensor"), tp, sequence_parallel=sequence_parallel)
    except ShardingError as error:
        raise MethodConfigError(f"tensor_parallel: {error}") from None
    kinds = {how: sum(1 for _, h in plan if h == how) for _, how in plan}
    logger.info("tensor_parallel: split over %d ranks%s: %s", tp, " with sequence parallelism" if sequence_parallel else "",
                ", ".join(f"{n} {k}" for k, n in kinds.items()))


def layouts(world_size: int, model=None) -> list[tuple[dict[str, int], dict]]:
    # The 1d algorithm over every tensor size that divides the world (3d grids are not searched).
    return [({"tensor": t}, {}) for t in range(2, world_size + 1) if world_size % t == 0]


_SPLITS = ("column", "row")


def tensor_ineligible(model, tensor: int) -> str | None:
    """Why the 1d algorithm cannot split ``model`` over ``tensor`` ranks, or None."""
    try:
        plan = shard_plan(model, tensor)
    except ShardingError as error:
        return f"tensor={tensor}: {error}"
    if not any(how.startswith(_SPLITS) and how != "column_gather" for _, how in plan):
        return (f"tensor={tensor}: tensor_parallel finds no attention or MLP it can split in {type(model).__name__} "
                "(see atorch/parallel_layers/auto_shard.py for what it recognizes)")
    return None


def ineligible(model, config: TensorParallelConfig, job: LayoutJob) -> str | None:
    tensor = job.dims.get("tensor", 1)
    if config.algorithm == "3d":
        # The search does not lay out 3d grids; a tensor dim fitted for one must be the grid's
        # size, and the model is checked when the grid is applied.
        grid = math.prod(config.grid)
        if grid != tensor:
            return (f"tensor={tensor}: the 3d grid row x col x depth = {' x '.join(map(str, config.grid))} "
                    f"needs a tensor dim of {grid}")
        return None
    return tensor_ineligible(model, tensor)


# Of the 34 bytes per token and hidden unit a transformer layer saves for backward, 24 lie inside
# the tensor-parallel regions (split) and 10 outside (norm inputs, residuals: replicated); with
# sequence parallelism those are split too. Korthikanti et al. 2022, arXiv:2205.05198, eq. 2-3.
REPLICATED_ACTIVATIONS = 10 / 34


def _blocks(spans, plan: list[tuple[str, str]]) -> list[bool]:
    """Which units hold layers the algorithm splits (the blocks)."""
    split = [name for name, how in plan if how.startswith(_SPLITS) and how != "column_gather"]
    return [any(name.startswith(span.name + ".") for name in split) for span in spans]


def _split_spans(spans, blocks: list[bool], inside: float, checkpointed: bool) -> tuple:
    """The probe's unit spans as one tensor rank sees them. A block keeps ``inside`` of what it
    kept, or all of it when checkpointed (a checkpointed block keeps its input, which the
    algorithm does not split); what it has alive beyond the earlier units' kept while it runs is
    ``inside`` too. The other units (the embedding, the norm, the head with its gathered logits
    and the loss) keep and run whole on every rank."""
    from dataclasses import replace

    base = rank_base = 0.0
    out = []
    for span, block in zip(spans, blocks):
        keep = 1.0 if not block or checkpointed else inside
        move = inside if block else 1.0
        out.append(replace(span, kept=keep * span.kept,
                           forward_peak=rank_base + move * max(span.forward_peak - base, 0.0),
                           backward_peak=rank_base + move * max(span.backward_peak - base, 0.0)
                           if span.backward_peak else 0.0))
        base += span.kept
        rank_base += keep * span.kept
    return tuple(out)


def _span_moments(spans, blocks: list[bool], model, checkpointed: bool) -> tuple:
    """The step's worst moments from unit spans, as ``StepCost.activation_profile`` takes them,
    with the gradients and autocast's weight copies alive at each, by the units' parameters. In
    a unit's forward: no gradient; the copies of it and the units before it (autocast keeps them
    to the forward's end). In its backward: the gradients of it and the units after it; the copies
    its and the earlier units' saved tensors hold (a checkpointed block's only while it is
    recomputed)."""
    params = [sum(p.numel() for p in model.get_submodule(span.name).parameters()) for span in spans]
    total = max(sum(p.numel() for p in model.parameters()), 1)
    moments = []
    for i, span in enumerate(spans):
        moments.append((span.forward_peak, 0.0, min(sum(params[:i + 1]) / total, 1.0)))
        if span.backward_peak:
            held = sum(params[j] for j in range(i) if not (checkpointed and blocks[j])) + params[i]
            moments.append((span.backward_peak, min(sum(params[i:]) / total, 1.0), min(held / total, 1.0)))
    return tuple(moments)


def shard_plan(model, tensor: int) -> list:
    """plan_shards, once per model and size while a search or plan costs its candidates."""
    return once(("plan_shards", id(model), tensor), lambda: plan_shards(model, tensor))


def tensor_activations(cost, tensor: int, sequence_parallel: bool = False) -> None:
    """Activations a rank has under the 1d algorithm over ``tensor`` ranks. With the probe's unit
    spans, block by block (``_split_spans``): the blocks' share inside the split regions divides,
    a checkpointed block's kept input and everything outside the blocks do not. Without them (meta
    tensors, a model the probe cannot cut into units), the whole step's activations scale by the
    replicated share plus the rest divided."""
    if tensor <= 1:
        return
    replicated = 0.0 if sequence_parallel else REPLICATED_ACTIVATIONS
    inside = replicated + (1 - replicated) / tensor
    if not cost.unit_spans:
        cost.activations *= inside
        return
    checkpointed = cost.checkpointed_saves > 0
    blocks = _blocks(cost.unit_spans, shard_plan(cost.model, tensor))
    cost.unit_spans = _split_spans(cost.unit_spans, blocks, inside, checkpointed)
    cost.activation_profile = _span_moments(cost.unit_spans, blocks, cost.model, checkpointed)


def tensor_terms(cost, tensor: int, sequence_parallel: bool = False, activations: bool = True) -> None:
    """Memory and time of the 1d algorithm over ``tensor`` ranks: the split layers' weights and
    the activations inside them divide (``tensor_activations``, unless ``activations`` is False:
    a caller that applied them itself); the collectives of :func:`_tensor_traffic`, not
    overlapped (under sequence parallelism two per row-parallel layer, one per embedding and
    head)."""

    if tensor <= 1:
        return
    if activations:
        tensor_activations(cost, tensor, sequence_parallel)
    plan = shard_plan(cost.model, tensor)
    modules = once(("modules", id(cost.model)), lambda: dict(cost.model.named_modules()))
    split = once(("tensor split bytes", id(cost.model), tensor), lambda: sum(
        p.numel() * p.element_size() for name, _ in plan for p in modules[name].parameters()))
    whole = max(cost.param_bytes(), 1)
    cost.split_layers(split / whole * (1 - 1 / tensor))
    # the FLOPs the split layers run, of those a token passes through (a MoE's routed experts run
    # whole on every tensor rank, and a token sees only its choices of them)
    from atorch.parallel_layers.experts import experts_summary

    moe = experts_summary(cost.model)
    share = 1 - split / (whole * (moe[2] if moe else 1.0)) * (1 - 1 / tensor)
    cost.compute_share *= share
    if sequence_parallel:
        _sequence_traffic(cost, tensor, plan, modules)
        return
    # the element-wise work outside the split regions runs whole on every tensor rank: not divided;
    # nor the copies atorch's layers make around their collectives, which the serial probe never saw
    cost.whole_traffic_factor /= share
    if cost.forward_traffic:  # their width resolved once amp's term has run (StepCost.rank_traffic)
        computed, stream = once(("tensor copies", id(cost.model), tensor), lambda: _copied_width(plan, modules))
        cost.tensor_copies = (cost.tokens * computed * cost.stage_share, cost.tokens * stream * cost.stage_share)
    recomputed = set()
    if "checkpoint" in cost.methods:
        recomputed = once(("recomputed rows", id(cost.model), tensor), lambda: _recomputed_rows(cost.model, plan))
    reduced, gathered, rows = once(("tensor traffic", id(cost.model), tensor, len(recomputed)),
                                   lambda: _tensor_traffic(plan, modules, recomputed))
    # Within one pipeline stage (mixed_parallel), a rank runs only its stage's layers.
    for kind, (width, calls), factor in (("all_reduce", reduced, 2 * (tensor - 1) / tensor),
                                         ("all_gather", gathered, (tensor - 1) / tensor)):
        if calls:
            # the gathers are the head's logits, a matmul's output: all in the compute dtype
            _append_split(cost, kind, factor, (width, calls), rows if kind == "all_reduce" else (width, calls))


def _append_split(cost, kind: str, factor: float, whole: tuple, computed: tuple) -> None:
    """The tensor collectives of ``kind`` a rank makes, ``whole`` = (width per token, calls), as
    two Comms: the ``computed`` part of them (the row-parallel outputs, made by a matmul: the
    compute dtype's width) and the rest, the residual stream's (the embedding's output, the
    column layers' input gradients, the sequence gathered from a norm: the weights' dtype, fp32
    under autocast; counted on 4 gloo ranks, tests/methods/test_mixed_parallel_virtual.py). The
    calls are rounded once, as a stage's share of them."""
    share = cost.stage_share
    calls = max(1, round(whole[1] * share))
    own = min(calls, round(computed[1] * share))
    for width, messages, stream in ((computed[0], own, False), (whole[0] - computed[0], calls - own, True)):
        if width or messages:
            cost.comms.append(Comm("tensor", cost.tokens * width * share, messages, factor, kind, "tensor_parallel",
                                   stream=stream))


def _sequence_traffic(cost, tensor: int, plan, modules: dict) -> None:
    """The collectives of the 1d algorithm under sequence parallelism, as atorch.parallel_layers
    makes them (a reduce-scatter is an all-reduce of the whole tensor, then each rank's chunk):
    each row-parallel output reduce-scattered (its backward gathers); before each group of
    column layers (attention's, the MLP's, the head's) the sequence gathered (its backward
    reduce-scatters); the vocabulary-split embedding's output reduce-scattered (its backward
    gathers); the head's logits gathered whole; and the gradients of the norm weights between
    them (each rank saw only its chunk) all-reduced, one each, in every micro-batch's backward. On
    2 gloo ranks a 2-layer Llama makes 15 all-reduces and 11 all-gathers
    (tests/auto/search/test_cost_traffic.py); the term had charged 10 all-reduces of other widths.
    A checkpointed block's recompute is not counted. Within a pipeline stage (mixed_parallel) the
    layers' collectives are the stage's share; the logits are gathered whole, on the last stage."""
    rows = [_features(modules[name])[1] for name, how in plan if how.startswith("row")]
    heads = [modules[name] for name, how in plan if how == "column_gather"]
    embeddings = [modules[name].embedding_dim for name, how in plan if how == "embedding"]
    hidden = heads[0].in_features if heads else (rows[0] if rows else 0)
    gathers = len(rows) + len(heads)  # one before each group of column layers
    width = sum(rows) + gathers * hidden + sum(embeddings)  # each such boundary: forward one way, backward the other
    calls = len(rows) + gathers + len(embeddings)
    logits = sum(head.out_features for head in heads)
    share = cost.stage_share
    for kind, factor in (("all_reduce", 2 * (tensor - 1) / tensor), ("all_gather", (tensor - 1) / tensor)):
        # the rows' outputs (reduce-scattered in forward, their gradients gathered in backward) in
        # the compute dtype; the gathered norm outputs and the embedding's, the residual stream's
        _append_split(cost, kind, factor, (width, calls), (sum(rows), len(rows)))
    if heads:
        cost.comms.append(Comm("tensor", cost.tokens * logits, len(heads), (tensor - 1) / tensor, "all_gather",
                               "tensor_parallel"))
    cost.comms.append(Comm("tensor", gathers * hidden * share, max(1, round(gathers * share)),  # the norm weights'
                           2 * (tensor - 1) / tensor, "all_reduce", "tensor_parallel", each_micro_batch=True,
                           stream=True))  # gradients, in the weights' dtype


def _features(module) -> tuple[int, int]:
    """(in, out) features of a Linear or a GPT-2 Conv1D (whose weight is (in, out))."""
    if hasattr(module, "out_features"):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.nf


def _recomputed_rows(model, plan) -> set[str]:
    """The row-parallel layers whose forward all-reduce a checkpointed block's recompute runs
    again: torch's checkpoint stops recomputing once it has every tensor the block's backward
    needs, so a block's last row layer (a pre-norm block's MLP output, which only the residual
    add takes) is not rerun. On 2 gloo ranks a checkpointed Llama layer all-reduced 8 times, not
    9 (tests/auto/search/test_cost_traffic.py). A post-norm block (BERT's), whose last norm saves
    that output, reruns it too: one all-reduce a layer more than this counts."""
    from atorch.utils.modules import find_block_classes

    classes = tuple(find_block_classes(model))
    blocks = [name for name, m in model.named_modules() if classes and isinstance(m, classes)]
    rows = [name for name, how in plan if how.startswith("row")]
    recomputed = set()
    for block in blocks:
        inside = [name for name in rows if name.startswith(block + ".")]
        recomputed.update(inside[:-1])
    return recomputed


def _tensor_traffic(plan, modules: dict, recomputed: set) -> tuple[tuple[int, int], ...]:
    """((width, calls) all-reduced, (width, calls) all-gathered, (width, calls) of the all-reduces
    that are row-parallel outputs) per token in one step of the
    split layers, as atorch.parallel_layers moves them: each column-parallel layer all-reduces its
    input's gradient in backward (q, k, v, gate and up each their own: 5 a Llama layer, where
    Megatron's fused projections make 2), each row-parallel layer its output in forward (again in
    a checkpointed block's recompute: those ``recomputed``), the vocabulary-split embedding its output; the head
    gathers its logits (an all-gather, of the whole vocabulary's width)."""
    reduce_width = reduce_calls = gather_width = gather_calls = row_width = row_calls = 0
    for name, how in plan:
        module = modules[name]
        if how == "embedding":
            reduce_width, reduce_calls = reduce_width + module.embedding_dim, reduce_calls + 1
            continue
        inputs, outputs = _features(module)
        if how.startswith("row"):
            times = 2 if name in recomputed else 1
            reduce_width, reduce_calls = reduce_width + times * outputs, reduce_calls + times
            row_width, row_calls = row_width + times * outputs, row_calls + times
        else:
            reduce_width, reduce_calls = reduce_width + inputs, reduce_calls + 1
            if how == "column_gather":
                gather_width, gather_calls = gather_width + outputs, gather_calls + 1
    return (reduce_width, reduce_calls), (gather_width, gather_calls), (row_width, row_calls)


def _copied_width(plan, modules: dict) -> tuple[int, int]:
    """Elements per token atorch.parallel_layers' forward copies around its collectives, on every
    tensor rank, as (those a matmul made: the compute dtype's width, those of the residual stream:
    the weights'): a row layer's output (a matmul's) and the embedding's cloned before their
    all-reduce (read and written: 2 x the width); the head's logits concatenated from the
    all-gather's buffers (read and written: 2 x the vocabulary; the all-gather's own writes are
    the collective's). Counted on 2 gloo ranks, in fp32 and bf16 autocast:
    tests/auto/search/test_tensor_traffic.py."""
    computed = stream = 0
    for name, how in plan:
        module = modules[name]
        if how == "embedding":
            stream += 2 * module.embedding_dim
        elif how.startswith("row") or how == "column_gather":
            computed += 2 * _features(module)[1]
    return computed, stream


def cost_term(config: TensorParallelConfig, cost) -> None:
    if config.algorithm != "3d":
        tensor_terms(cost, cost.size("tensor"), "sequence_parallel" in cost.methods)
    else:
        from atorch.intra_layer.cost import terms_3d

        terms_3d(cost, *config.grid)


def leaves_whole(model, config: TensorParallelConfig) -> str | None:
    """The routed experts of a mixture-of-experts model: neither algorithm splits them."""
    from atorch.parallel_layers.experts import experts_summary

    found = experts_summary(model)
    if found is None:
        return None
    blocks, share, _ = found
    return (f"splits attention and dense MLPs only; the routed experts of {blocks} MoE blocks ({share:.0%} of "
            f"{type(model).__name__}'s parameters) stay whole on every tensor rank. Shard them with fsdp (or "
            "zero2/zero1 for their gradients and optimizer state), or split them over the data ranks with "
            "expert_parallel beside it (each tensor rank then holds the same slice of the experts)")


register_method(
    MethodSpec(
        name="tensor_parallel",
        config_cls=TensorParallelConfig,
        hooks={Stage.REWRITE: shard},
        description="Megatron-style tensor parallelism of attention, MLP, embedding and head",
        distributed_only=True,
        uses_dims=("tensor",),
        needs_dims=("tensor",),
        layouts=layouts,
        ineligible=ineligible,
        leaves_whole=leaves_whole,
        cost_term=cost_term,
        probed=False,  # the split layers need the tensor group; cost_term divides the model instead
    )
)


class SequenceParallelConfig(MethodConfig):
    pass


def sequence_ineligible(model, config: SequenceParallelConfig, job: LayoutJob) -> str | None:
    """Why the search cannot add sequence parallelism on this layout: no tensor ranks, a model that
    is not Llama-style (auto_shard.sequence_parallel_problem), or a sequence the tensor ranks do
    not divide."""
    from atorch.parallel_layers.auto_shard import sequence_parallel_problem

    tensor = job.dims.get("tensor", 1)
    if tensor <= 1:
        return "sequence_parallel needs tensor ranks"
    if model is None:  # a space built without the model: the model is checked when applied
        return None
    why = tensor_ineligible(model, tensor)
    return why if why is not None else sequence_parallel_problem(model, shard_plan(model, tensor))


register_method(
    MethodSpec(
        name="sequence_parallel",
        config_cls=SequenceParallelConfig,
        # tensor_parallel applies it while it splits the layers (it reads the strategy); its
        # memory and collectives are in tensor_parallel's cost term (tensor_terms).
        hooks={},
        description="Megatron sequence parallelism: norms and residuals on sequence chunks (with tensor_parallel)",
        distributed_only=True,
        requires=("tensor_parallel",),
        needs_dims=("tensor",),
        search_space=({},),
        # it splits the activations between the blocks and moves more bytes than the all-reduces
        # it replaces (a reduce-scatter here is an all-reduce, then a chunk): memory for speed
        saves_memory=True,
        ineligible=sequence_ineligible,
        decided_by=("collectives",),
    )
)
