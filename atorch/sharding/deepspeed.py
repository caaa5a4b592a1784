"""The DeepSpeed ZeRO path of zero1/zero2, imported only when a strategy asks for it."""

import importlib.util

from atorch.auto.context import ModelContext


def deepspeed_unavailable() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "use_ds_zero needs DeepSpeed, which is not installed (pip install 'atorch[deepspeed]')"
    return None


def wrap_deepspeed(ctx: ModelContext, stage: int) -> None:
    """Hand the model and optimizer to ``deepspeed.initialize`` with ZeRO ``stage``.

    DeepSpeed owns the backward pass and the step: the result's model and optimizer are its
    engine, and ``result.args["use_optim_backward"]`` tells the loop to call
    ``result.optim.backward(loss)``.
    """
    import deepspeed

    from atorch.auto.context import unwrap

    micro_batch = ctx.dataloader.batch_size if ctx.dataloader is not None else 1
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=unwrap(ctx.model), optimizer=ctx.base_optim, config=config, dist_init_required=False
    )
    ctx.model, ctx.optim = engine, engine
    ctx.wrapped_by = f"deepspeed zero{stage}"
    ctx.args["use_optim_backward"] = True
    ctx.args["requires_set_gradient_accumulation_boundary"] = True
