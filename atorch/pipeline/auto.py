"""The pipeline methods' common step: turn the strategy's model into a PipelineModel.

The training loop of a pipelined result differs in one place: calling the model runs forward
*and* backward of every microbatch and returns the loss (the user's ``loss_func`` runs on the
last stage, per microbatch); ``result.loss_func`` hands that loss through, and
``result.args["backward_in_forward"]`` tells the loop to skip ``loss.backward()``.
"""

from collections.abc import Callable

from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.errors import MethodConfigError
from atorch.pipeline.schedules import SCHEDULES, check_schedule


class PipelineFields(MethodConfig):
    """Config fields shared by pipeline_parallel and mixed_parallel."""

    num_microbatches: int = Field(default=1, ge=1, description="microbatches per step; divides the per-rank batch")
    schedule: str = Field(default="1f1b", description=f"one of {sorted(SCHEDULES)}")
    virtual_pipeline_size: int = Field(default=1, ge=1, description="stages per pipeline rank (interleaved schedules)")
    pipeline_cuts: list[str] | None = Field(
        default=None, description="names of the last module of every stage but the last; None: auto-partition")
    input_names: list[str] | None = Field(
        default=None, description="forward arguments the first stage takes (a traced model; the others go to the "
        "loss); None: every tensor of the batch that the forward takes")


def with_stage_microbatches(config: PipelineFields, stages: int) -> PipelineFields:
    """The short form (``num_microbatches`` not given) with as many microbatches as pipeline
    stages: the fewest that fill the pipeline (one microbatch left every stage but one idle)."""
    if "num_microbatches" in config.model_fields_set or stages <= 1:
        return config
    return config.model_copy(update={"num_microbatches": stages})


def check_fields(config: PipelineFields) -> None:
    """Schedule/virtual size combinations that cannot run, raised before anything is applied."""
    try:
        check_schedule(config.schedule, config.virtual_pipeline_size)
    except MethodConfigError as error:
        raise MethodConfigError(f"pipeline: {error}") from None


def pipeline_loss(user_loss: Callable | None) -> Callable | None:
    """PipelineModel's loss_fn(microbatch, output) from the user's ``loss_func(batch, output)``."""
    if user_loss is None:
        return None
    return lambda batch, output: _first(user_loss(batch, output))


def _first(loss):
    return loss if not isinstance(loss, (tuple, list)) else loss[0]


def pipeline_model(ctx: ModelContext, config: PipelineFields, method: str, stage_transform=None) -> None:
    """Replace ``ctx.model`` with a PipelineModel over ``ctx.topology``; adjust loss and args."""
    from atorch.pipeline.model import PipelineModel  # torch.distributed.pipelining: not at registry load

    if ctx.model_input_format not in (None, "unpack_dict"):
        raise MethodConfigError(
            f"pipeline methods call the model with the batch's fields as keyword arguments; model_input_format "
            f"{ctx.model_input_format!r} is not supported, use 'unpack_dict' (or None with dict batches)")
    ctx.model = PipelineModel(
        ctx.model, num_microbatches=config.num_microbatches, virtual_pipeline_size=config.virtual_pipeline_size,
        pipeline_cuts=config.pipeline_cuts, auto_partition=config.pipeline_cuts is None, input_names=config.input_names,
        broadcast_and_average_loss=True, schedule=config.schedule, loss_fn=pipeline_loss(ctx.loss_func),
        topology=ctx.topology, stage_transform=stage_transform, device=ctx.device,
    )
    # The model's gradients are averaged over the data ranks by PipelineModel: no DDP on top.
    ctx.wrapped_by = method
    ctx.loss_func = lambda batch, loss: loss
    ctx.args["backward_in_forward"] = True
