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
from atorch.auto.registry import LayoutJob, MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError, StrategyConflictError
from atorch.parallel_layers.auto_shard import ShardingError, plan_shards, shard_model
from atorch.utils.log import logger


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


def layouts(world_size: int) -> list[tuple[dict[str, int], dict]]:
    # The 1d algorithm over every tensor size that divides the world (3d grids are not searched).
    return [({"tensor": t}, {}) for t in range(2, world_size + 1) if world_size % t == 0]


_SPLITS = ("column", "row")


def tensor_ineligible(model, tensor: int) -> str | None:
    """Why the 1d algorithm cannot split ``model`` over ``tensor`` ranks, or None."""
    try:
        plan = plan_shards(model, tensor)
    except ShardingError as error:
        return f"tensor={tensor}: {error}"
    if not any(how.startswith(_SPLITS) and how != "column_gather" for _, how in plan):
        return (f"tensor={tensor}: tensor_parallel finds no attention or MLP it can split in {type(model).__name__} "
                "(see atorch/parallel_layers/auto_shard.py for what it recognizes)")
    return None


def ineligible(model, config: TensorParallelConfig, job: LayoutJob) -> str | None:
    if config.algorithm == "3d":
        return None  # the search does not lay out 3d grids; a loaded one is checked when applied
    return tensor_ineligible(model, job.dims.get("tensor", 1))


# Of the 34 bytes per token and hidden unit a transformer layer saves for backward, 24 lie inside
# the tensor-parallel regions (split) and 10 outside (norm inputs, residuals: replicated); with
# sequence parallelism those are split too. Korthikanti et al. 2022, arXiv:2205.05198, eq. 2-3.
REPLICATED_ACTIVATIONS = 10 / 34


def tensor_terms(cost, tensor: int, sequence_parallel: bool = False) -> None:
    """Memory and time of the 1d algorithm over ``tensor`` ranks: the split layers' weights and
    the activations inside them divide; each row-parallel layer all-reduces its output in forward
    and its column partner's input gradient in backward (not overlapped); the vocabulary-split
    embedding all-reduces its output and the head gathers its logits."""
    from atorch.auto.search.cost import Comm

    if tensor <= 1:
        return
    plan = plan_shards(cost.model, tensor)
    modules = dict(cost.model.named_modules())
    split = sum(p.numel() * p.element_size() for name, _ in plan for p in modules[name].parameters())
    share = 1 - split / max(cost.param_bytes(), 1) * (1 - 1 / tensor)
    cost.split_model(share)
    cost.split *= share
    replicated = 0.0 if sequence_parallel else REPLICATED_ACTIVATIONS
    cost.activations *= replicated + (1 - replicated) / tensor
    cost.compute_share *= share
    widths, messages = 0, 0
    for name, how in plan:
        module = modules[name]
        if how.startswith("row"):
            widths += 2 * (module.out_features if hasattr(module, "out_features") else module.nf)
            messages += 2
        elif how in ("embedding", "column_gather"):
            widths += module.embedding_dim if how == "embedding" else module.out_features
            messages += 1
    # Within one pipeline stage (mixed_parallel), a rank runs only its stage's layers.
    cost.comms.append(Comm("tensor", cost.tokens * widths * cost.stage_share, max(1, round(messages * cost.stage_share)),
                           2 * (tensor - 1) / tensor))


def cost_term(config: TensorParallelConfig, cost) -> None:
    if config.algorithm != "3d":
        tensor_terms(cost, cost.size("tensor"), "sequence_parallel" in cost.methods)
    else:
        cost.grad_buckets = False  # hooks reduce each gradient over its own group: no DDP


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
        cost_term=cost_term,
        probed=False,  # the split layers need the tensor group; cost_term divides the model instead
    )
)


class SequenceParallelConfig(MethodConfig):
    pass


register_method(
    MethodSpec(
        name="sequence_parallel",
        config_cls=SequenceParallelConfig,
        # tensor_parallel applies it while it splits the layers (it reads the strategy).
        hooks={},
        description="Megatron sequence parallelism: norms and residuals on sequence chunks (with tensor_parallel)",
        distributed_only=True,
        requires=("tensor_parallel",),
        needs_dims=("tensor",),
    )
)
