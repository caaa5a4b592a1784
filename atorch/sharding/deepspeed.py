"""The DeepSpeed ZeRO path of zero1/zero2, imported only when a strategy asks for it."""

import importlib.util
from typing import Any

import torch

from atorch.amp.optimizer import ScaledLossFunc
from atorch.auto.context import ModelContext, unwrap
from atorch.utils.optim import unwrap_optimizer


def deepspeed_unavailable() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "use_ds_zero needs DeepSpeed, which is not installed (pip install 'atorch[deepspeed]')"
    return None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(ctx: ModelContext, stage: int, user_config: dict[str, Any] | None) -> dict:
    micro_batch = ctx.dataloader.batch_size if ctx.dataloader is not None else 1
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        # DeepSpeed's ZeRO optimizer clips at norm 1.0 unless told otherwise, which changed the
        # updates of any model whose gradient norm passed 1; atorch clips only when asked
        # (ds_config={"gradient_clipping": x}, or clip_grad_norm in the loop).
        "gradient_clipping": 0.0,
    }
    amp = ctx.strategy.get("amp_native") if ctx.strategy is not None else None
    if amp is not None:
        # DeepSpeed keeps fp32 master weights and scales fp16 losses itself.
        config["bf16" if amp.dtype == torch.bfloat16 else "fp16"] = {"enabled": True}
    return _merge(config, user_config or {})


def wrap_deepspeed(ctx: ModelContext, stage: int, user_config: dict[str, Any] | None = None) -> None:
    """Hand the model and optimizer to ``deepspeed.initialize`` with ZeRO ``stage``.

    DeepSpeed owns the backward pass and the step: the result's model and optimizer are its
    engine, and ``result.args["use_optim_backward"]`` tells the loop to call
    ``result.optim.backward(loss)`` then ``result.optim.step()`` (which also zeroes gradients).
    """
    import deepspeed

    # amp_native's loss scaling and step wrapper give way to DeepSpeed's own precision handling.
    if isinstance(ctx.loss_func, ScaledLossFunc):
        ctx.loss_func = ctx.loss_func.loss_func
    optimizer = unwrap_optimizer(ctx.optim)
    engine, _, _, _ = deepspeed.initialize(
        model=unwrap(ctx.model), optimizer=optimizer, config=deepspeed_config(ctx, stage, user_config),
        dist_init_required=False,
    )
    ctx.model, ctx.optim = engine, engine
    ctx.args["use_optim_backward"] = True
    ctx.args["requires_set_gradient_accumulation_boundary"] = True
