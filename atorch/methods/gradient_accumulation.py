"""gradient_accumulation: each batch trained as ``steps`` micro-batches whose gradients add up.

``("gradient_accumulation", {"steps": 4})``: the dataloader yields a quarter of the global batch
per call; ``result.backward`` weighs each micro-batch's loss by its label tokens
(docs/loss_normalization.md) and keeps the data-parallel gradient reduction off until the
fourth; ``result.step`` steps after that one. The optimizer steps on the same samples, with the
same gradient, as without the method (padded batches too), with
one micro-batch's activations alive instead of the whole batch's: memory for time (each
micro-batch runs the model's operators again). The search tries it when a candidate may not fit.

This keeps the job's math; ``auto_accelerate(gradient_accumulation_steps=n)`` changes it (n
whole batches per optimizer step). Both together accumulate ``steps x n`` micro-batches.

A pipeline's microbatches already are accumulation (raise its ``num_microbatches``); DeepSpeed's
engine and fairscale's ShardedDataParallel reduce on every backward: all are refused with it.
"""

from pydantic import Field

from atorch.auto import loop
from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import LayoutJob, MethodSpec, Stage, register_method
from atorch.errors import AtorchConfigError

PIPELINED = "a pipeline's microbatches already accumulate its gradients; raise its num_microbatches instead"


class GradientAccumulationConfig(MethodConfig):
    steps: int = Field(default=2, ge=2, description="micro-batches each batch is split into (one optimizer step)")


def _per_rank_batch(ctx: ModelContext) -> int:
    return int(ctx.dataloader_args.get("batch_size", 1)) // max(ctx.topology.data_parallel_size, 1)


def split_batches(ctx: ModelContext, config: GradientAccumulationConfig) -> None:
    """Rebuild the dataloader over micro-batches: ``batch_size // steps`` samples a call."""
    if ctx.dataset is None:
        raise AtorchConfigError("gradient_accumulation splits the batches of atorch's dataloader, and this job has "
                                "no dataset: accumulate in your own loop (or your trainer's setting) instead")
    per_rank = _per_rank_batch(ctx)
    if per_rank % config.steps:
        raise AtorchConfigError(
            f"gradient_accumulation steps={config.steps} does not divide the {per_rank} samples each data-parallel "
            f"rank gets per batch (batch_size {ctx.dataloader_args.get('batch_size', 1)} over "
            f"{ctx.topology.data_parallel_size} ranks); pick steps that divide {per_rank}, or a batch_size that "
            f"{config.steps} x the data-parallel size divides")
    ctx.dataloader_args = {**ctx.dataloader_args, "batch_size": int(ctx.dataloader_args.get("batch_size", 1))
                           // config.steps}
    ctx.build_dataloader()


def accumulate(ctx: ModelContext, config: GradientAccumulationConfig) -> None:
    loop.setup_accumulation(ctx.args, ctx.model, config.steps)


def ineligible(model, config: GradientAccumulationConfig, job: LayoutJob) -> str | None:
    """The search's check (atorch/auto/search/space.py): the steps must divide a rank's batch."""
    if job.batch_per_data_rank is not None and job.batch_per_data_rank % config.steps:
        return f"{config.steps} micro-batches do not divide the {job.batch_per_data_rank} samples a data rank gets"
    return None


def cost_term(config: GradientAccumulationConfig, cost) -> None:
    """One micro-batch's activations are alive; each runs the forward's operators again
    (StepCost.accumulation); the sharding methods' terms read the count (they run after this).
    Each micro-batch past the first costs the host a fixed time of its own (a forward and backward
    call, the loss, the sync switched off and on), calibrated: on search_quality's BERT and MLP (4
    ranks on 2 cores) a second micro-batch added 20-25 ms a step beyond its operators. The
    gradients' sync runs in the last micro-batch's backward: only that is its window (a sharding
    method that reduces every micro-batch widens it again)."""
    cost.accumulation *= config.steps
    cost.activations /= config.steps
    cost.charge("gradient_accumulation", cost.accumulation - 1)
    # the gradients' sync is off until the last micro-batch (atorch/auto/loop.py): DDP's
    # all-reduces and FSDP2's reduce-scatters hide behind that micro-batch's backward only
    deferred = 1.0 / cost.accumulation
    cost.sync_window = {**cost.sync_window, "all_reduce": deferred, "reduce_scatter": deferred}


register_method(
    MethodSpec(
        name="gradient_accumulation",
        config_cls=GradientAccumulationConfig,
        hooks={Stage.DATA: split_batches, Stage.RUNTIME: accumulate},
        description="gradient accumulation: each batch as `steps` micro-batches, one optimizer step (less memory)",
        conflicts=dict.fromkeys(("pipeline_parallel", "mixed_parallel", "ds_3d_parallel"), PIPELINED),
        # the sharding methods' cost terms read StepCost.accumulation
        before=("fsdp", "zero2"),
        search_space=({"steps": 2}, {"steps": 4}),
        saves_memory=True,
        memory_only=True,
        ineligible=ineligible,
        cost_term=cost_term,
    )
)
