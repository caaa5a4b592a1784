"""ds_3d_parallel: DeepSpeed's pipeline engine over the ``pipeline`` and data dims.

Config forms: ``("ds_3d_parallel", {"num_microbatches": 4})`` with
``("parallel_mode", ([("pipeline", 2), ("data", N)], None))``. The model's units (the layouts of
atorch/pipeline/layouts.py) become a ``deepspeed.pipe.PipelineModule``; ``result.model(**batch)``
runs the engine's ``train_batch`` (forward, backward and optimizer step), so the result's
``args`` carry ``backward_in_forward`` and ``step_in_forward`` (docs/pipeline.md). Runs on CPU with
gloo (tested) as on GPUs. No tensor dim: DeepSpeed's 3D needs a Megatron model; use mixed_parallel.
"""

from typing import Literal

from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError
from atorch.pipeline.layouts import layout_for
from atorch.sharding.deepspeed import _merge
from atorch.sharding.deepspeed_config import TRUSTED_DESCRIPTION, StrategyDsConfig, TrustedField, merged


class Ds3dParallelConfig(MethodConfig):
    num_microbatches: int = Field(default=1, ge=1, description="microbatches per step (DeepSpeed's gradient accumulation steps)")
    partition_method: Literal["parameters", "uniform"] = Field(
        default="parameters", description="DeepSpeed's stage balance: by parameter count, or the same number of units")
    ds_config: StrategyDsConfig = Field(
        default=None, description="extra DeepSpeed config merged over atorch's; keys that write files or start "
        "services are refused (atorch/sharding/deepspeed_config.py)")
    trusted_ds_config: TrustedField = Field(default=None, exclude=True, description=TRUSTED_DESCRIPTION)


def _unsupported(device_ctx, config: Ds3dParallelConfig) -> str | None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "ds_3d_parallel needs DeepSpeed, which is not installed (pip install 'atorch[deepspeed]')"
    return None


def resolve(model, config: Ds3dParallelConfig) -> Ds3dParallelConfig:
    layout_for(model)
    return config


def split(ctx: ModelContext, config: Ds3dParallelConfig) -> None:
    from atorch.pipeline.deepspeed import pipeline_module

    if ctx.topology.size("tensor") > 1:
        raise MethodConfigError("ds_3d_parallel has no tensor dim (DeepSpeed's needs a Megatron model); drop the tensor "
                                "dim from parallel_mode, or use mixed_parallel for tensor x pipeline x data")
    ctx.model = pipeline_module(ctx, config.partition_method)
    ctx.wrapped_by = "ds_3d_parallel"  # the engine reduces gradients over the data ranks


def wrap(ctx: ModelContext, config: Ds3dParallelConfig) -> None:
    import deepspeed

    from atorch.pipeline.deepspeed import DeepSpeedPipelineCall, SteppedByEngine

    per_rank = ctx.dataloader.batch_size if ctx.dataloader is not None else config.num_microbatches
    if per_rank % config.num_microbatches:
        raise MethodConfigError(f"ds_3d_parallel: each data rank's batch of {per_rank} does not split into "
                                f"{config.num_microbatches} microbatches; make it a multiple")
    micro = per_rank // config.num_microbatches
    ds_config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": config.num_microbatches,
        "train_batch_size": micro * config.num_microbatches * ctx.topology.data_parallel_size,
        # DeepSpeed clips at 1.0 unless told otherwise; atorch clips only when asked.
        "gradient_clipping": 0.0,
    }
    engine, _, _, _ = deepspeed.initialize(model=ctx.model, optimizer=ctx.base_optim,
                                           config=_merge(ds_config, merged(config) or {}), dist_init_required=False)
    ctx.model = DeepSpeedPipelineCall(engine, engine.module.atorch_layout, config.num_microbatches,
                                      engine.module.atorch_weights)
    ctx.optim = SteppedByEngine(ctx.base_optim)
    ctx.loss_func = lambda batch, loss: loss
    ctx.args["backward_in_forward"] = True
    ctx.args["step_in_forward"] = True


def cost_term(config: Ds3dParallelConfig, cost) -> None:
    """A 1F1B pipeline over the pipeline dim (DeepSpeed's TrainSchedule), as pipeline_parallel's
    terms count it: the stage's share of the model, the microbatches in flight, the bubble and
    the sends; the engine then all-reduces the stage's gradients over the data ranks, bucket by
    bucket (reduce_bucket_size elements), after the schedule (nothing overlapped). Without it a loaded ds_3d_parallel strategy
    was costed as the whole model on every rank (150.6 GiB a rank for 7B on pipeline=4, where
    the pipeline_parallel equivalent is 32.6)."""
    from types import SimpleNamespace

    from atorch.methods.pipeline_parallel import pipeline_terms
    from atorch.sharding.deepspeed import reduce_bucket_elements

    fields = SimpleNamespace(num_microbatches=config.num_microbatches, virtual_pipeline_size=1, schedule="1f1b",
                             pipeline_cuts=None)
    pipeline_terms(cost, fields, cost.size("pipeline"), grad_sync=False)
    cost.sync_overlap = {}
    cost.sync_calls = {"bucket_bytes": reduce_bucket_elements(merged(config)) * cost.element_bytes()}


register_method(
    MethodSpec(
        name="ds_3d_parallel",
        config_cls=Ds3dParallelConfig,
        hooks={Stage.REWRITE: split, Stage.RUNTIME: wrap},
        description="DeepSpeed pipeline engine (PipelineModule) over the pipeline and data dims",
        distributed_only=True,
        # its split builds DeepSpeed's process groups (collectives), which a probe cannot call
        probed=False,
        uses_dims=("pipeline",),
        needs_dims=("pipeline",),
        conflicts={
            **dict.fromkeys(("fsdp", "zero1", "zero2"), "DeepSpeed's pipeline engine owns the data-parallel "
                            "gradient reduction; set ZeRO in ds_config instead"),
            **dict.fromkeys(("tensor_parallel", "sequence_parallel", "pipeline_parallel", "mixed_parallel"),
                            "DeepSpeed's pipeline engine splits the model itself; use mixed_parallel for "
                            "tensor x pipeline"),
            **dict.fromkeys(("amp_native", "half"), "DeepSpeed's engine sets precision itself; put "
                            '{"bf16": {"enabled": true}} in ds_config'),
        },
        unsupported=_unsupported,
        resolve=resolve,
        cost_term=cost_term,
    )
)
