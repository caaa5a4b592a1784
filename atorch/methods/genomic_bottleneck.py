"""genomic_bottleneck: train small g-nets that generate the model's large weights (torchGB's idea).

Config forms: ``"genomic_bottleneck"``, ``("genomic_bottleneck", {"tile_size": 64, "gnet_width":
32, "gnet_depth": 2, "min_numel": 4096, "lr": 1e-3})``. The user's loop stays
``loss.backward(); optim.step(); optim.zero_grad()`` (see :mod:`atorch.compression.wrap`); the
:class:`~atorch.compression.GenomicBottleneck` is ``result.args["gnets"]`` (save, load, repr).

The g-nets are spread over the data-parallel ranks. DDP skips the covered weights, and the
g-nets' backward averages their grads onto each owner only (a reduce, not an allreduce).
"""

from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.compression.bottleneck import GenomicBottleneck
from atorch.compression.wrap import GenomicOptimizer, predict_before_forward, without_covered
from atorch.errors import StrategyConflictError

_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class GenomicBottleneckConfig(MethodConfig):
    tile_size: tuple[int, int] = Field(default=(64, 64), description="tile (rows, cols) a g-net sees; an int means square")
    gnet_width: int = Field(default=32, ge=1, description="hidden units per g-net layer")
    gnet_depth: int = Field(default=2, ge=1, description="hidden layers per g-net")
    min_numel: int = Field(default=4096, ge=1, description="weights with fewer elements are trained directly")
    ignore_layers: list[str] = Field(default_factory=list, description="module/parameter names (fnmatch) trained directly")
    optimizer: Literal["adam", "adamw", "sgd"] = Field(default="adam", description="the g-nets' optimizer")
    lr: float = Field(default=1e-3, gt=0, description="the g-nets' learning rate")
    seed: int = Field(default=0, description="g-net initialization seed")
    bucket_mb: float = Field(default=25.0, gt=0, description="size of one broadcast/reduce bucket of weights")

    @field_validator("tile_size", mode="before")
    @classmethod
    def _square(cls, value: Any) -> Any:
        return (value, value) if isinstance(value, int) else value


def check_precision(ctx: ModelContext, config: GenomicBottleneckConfig) -> None:
    # Runs in the first stage, before anything is changed: fp16 loss scaling would hand the
    # g-nets scaled gradients that its optimizer wrapper never unscales.
    amp = ctx.strategy.get("amp_native") if "amp_native" in ctx.strategy else None
    if amp is not None and amp.dtype == torch.float16:
        raise StrategyConflictError(
            "genomic_bottleneck cannot run with fp16 amp_native (its loss scaling does not reach the g-nets); "
            "use ('amp_native', 'bf16') or drop amp_native"
        )


def build_gnets(ctx: ModelContext, config: GenomicBottleneckConfig) -> None:
    # MEMORY, after every REWRITE: the g-nets cover the modules that will finally run; before
    # REPLICATE: the covered weights must be marked for DDP to skip before DDP wraps the model.
    group = ctx.topology.data_parallel_group if ctx.topology.data_parallel_size > 1 else "local"
    gnets = GenomicBottleneck(
        ctx.model, tile_size=config.tile_size, gnet_width=config.gnet_width, gnet_depth=config.gnet_depth,
        min_numel=config.min_numel, ignore_layers=config.ignore_layers, optimizer_cls=_OPTIMIZERS[config.optimizer],
        optimizer_args={"lr": config.lr}, process_group=group, seed=config.seed, bucket_mb=config.bucket_mb,
    )
    predict_before_forward(ctx.model, gnets)
    user_param_func = ctx.optim_param_func

    def direct_params(model):
        return without_covered(user_param_func(model) if user_param_func else gnets.direct_parameters(), gnets)

    ctx.optim_param_func = direct_params
    ctx.args["gnets"] = gnets


def wrap_optimizer(ctx: ModelContext, config: GenomicBottleneckConfig) -> None:
    gnets = ctx.args["gnets"]
    if ctx.optim is not None:
        ctx.optim = GenomicOptimizer(ctx.optim, gnets)


register_method(
    MethodSpec(
        name="genomic_bottleneck",
        config_cls=GenomicBottleneckConfig,
        hooks={Stage.TOPOLOGY: check_precision, Stage.MEMORY: build_gnets, Stage.OPTIMIZER: wrap_optimizer},
        description="genomic bottleneck: small g-nets generate the large weights and are trained instead",
        # Sharding and tensor/sequence parallelism change the weights' shapes and owners under the
        # g-nets; half and compile are untested with them; zero1 builds its optimizer elsewhere.
        conflicts={
            "fsdp": "sharding changes the shapes and owners of the weights the g-nets generate",
            "zero1": "zero1 builds its optimizer itself, without the g-nets' step",
            "zero2": "sharding changes the shapes and owners of the weights the g-nets generate",
            "tensor_parallel": "split weights are not the whole matrices the g-nets generate",
            "sequence_parallel": "it needs tensor_parallel, whose split weights the g-nets cannot generate",
            "native_dynamo": "the g-nets' weight prediction before forward is not traced by torch.compile",
            "half": "the g-nets are trained in fp32; half would cast their generated weights",
            # Measured by the composition matrix: 5-9% off the serial genomic run on 2 ranks.
            **dict.fromkeys(("pipeline_parallel", "mixed_parallel", "ds_3d_parallel"),
                            "each pipeline stage holds part of the model while the g-nets are spread over "
                            "all data ranks as if each held all of it; the losses leave the serial run's"),
        },
        # The g-nets cover the weights of the modules that finally run (checkpoint wraps blocks).
        after=("parallel_mode", "checkpoint"),
    )
)
