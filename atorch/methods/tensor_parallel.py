"""tensor_parallel: split an already built model's layers over the ``tensor`` dim (Megatron style).

Config forms: ``"tensor_parallel"`` with ``("parallel_mode", ([("tensor", 2), ("data", N)], None))``.
Attention and MLP projections (Llama-style, BERT, GPT-2, plain MLP blocks) become column- then
row-parallel layers, the embedding and output head are split by vocabulary (see
atorch/parallel_layers/auto_shard.py for what is recognized); the math stays that of the serial
model. Composes with DDP and fsdp over the data dim.
"""

from typing import Literal

from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.registry import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError
from atorch.parallel_layers.auto_shard import ShardingError, shard_model
from atorch.utils.log import logger


class TensorParallelConfig(MethodConfig):
    algorithm: Literal["megatron"] = Field(default="megatron", description="megatron: column/row-parallel layers")


def shard(ctx: ModelContext, config: TensorParallelConfig) -> None:
    tp = ctx.topology.size("tensor")
    sequence_parallel = ctx.strategy is not None and "sequence_parallel" in ctx.strategy
    try:
        plan = shard_model(ctx.model, ctx.topology.group("tensor"), tp, sequence_parallel=sequence_parallel)
    except ShardingError as error:
        raise MethodConfigError(f"tensor_parallel: {error}") from None
    kinds = {how: sum(1 for _, h in plan if h == how) for _, how in plan}
    logger.info("tensor_parallel: split over %d ranks%s: %s", tp, " with sequence parallelism" if sequence_parallel else "",
                ", ".join(f"{n} {k}" for k, n in kinds.items()))


register_method(
    MethodSpec(
        name="tensor_parallel",
        config_cls=TensorParallelConfig,
        hooks={Stage.REWRITE: shard},
        description="Megatron-style tensor parallelism of attention, MLP, embedding and head",
        distributed_only=True,
        uses_dims=("tensor",),
        needs_dims=("tensor",),
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
