"""amp_native: automatic mixed precision with ``torch.autocast``, fp32 master weights.

Config forms: ``"amp_native"`` (fp16), ``("amp_native", {"dtype": torch.bfloat16})``,
``("amp_native", "bf16")``. fp16 scales the loss with a GradScaler and skips steps whose
gradients overflow; bf16 needs no scaling, and ``skip_if_nonfinite=True`` skips steps with
inf/nan gradients. The training loop keeps calling ``loss.backward()`` and ``optim.step()``.
"""


import torch
from pydantic import Field, model_validator

from atorch.amp.autocast import autocast_module
from atorch.amp.optimizer import AmpOptimizer, ScaledLossFunc
from atorch.auto.config_types import HalfDType, MethodConfig, bf16_unsupported, dtype_shorthand
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method


class AmpNativeConfig(MethodConfig):
    dtype: HalfDType = Field(default=torch.float16, description="autocast dtype: float16 or bfloat16")
    skip_if_nonfinite: bool = Field(default=False, description="bf16: skip optimizer steps whose gradients hold inf/nan")
    init_scale: float = Field(default=2.0**16, gt=0, description="fp16: initial loss scale")
    growth_interval: int = Field(default=2000, ge=1, description="fp16: good steps before the scale doubles")

    _from_atorch_form = model_validator(mode="before")(dtype_shorthand)


def wrap_forward(ctx: ModelContext, config: AmpNativeConfig) -> None:
    if any(p.is_meta for p in ctx.model.parameters()):  # a plan's probe: autocast's casts emulated
        from atorch.amp.meta_autocast import MetaAutocastForward

        ctx.model.forward = MetaAutocastForward(ctx.model.forward, config.dtype)
        return
    autocast_module(ctx.model, ctx.device.type, config.dtype)


def probe_in_dtype(ctx: ModelContext, config: AmpNativeConfig) -> None:
    """The cost model's probe under a sharding method that absorbs amp (FSDP2's mixed precision):
    parameters and floating-point inputs in amp's dtype, no autocast. Under autocast some ops
    keep fp32 (norms, softmax, the loss), so its activations are larger: estimates 1.13-1.28 of
    measured on the cost-model benchmark's Llamas before."""

    def cast(_module, args, kwargs):
        def low(value):
            return value.to(config.dtype) if torch.is_tensor(value) and value.is_floating_point() else value

        return torch.utils._pytree.tree_map(low, (args, kwargs))

    ctx.model.to(config.dtype)
    ctx.model.register_forward_pre_hook(cast, with_kwargs=True)


def wrap_optimizer(ctx: ModelContext, config: AmpNativeConfig) -> None:
    scaler = None
    if config.dtype == torch.float16:
        scaler = torch.amp.GradScaler(ctx.device.type, init_scale=config.init_scale, growth_interval=config.growth_interval)
    # With several data-parallel ranks, sharded gradients can overflow on one rank only: all
    # ranks agree on skipping through this group.
    group = ctx.topology.data_parallel_group if ctx.topology.data_parallel_size > 1 else None
    if ctx.optim is not None:
        ctx.optim = AmpOptimizer(ctx.optim, scaler, config.skip_if_nonfinite, sync_group=group)
    if scaler is not None and ctx.loss_func is not None:
        ctx.loss_func = ScaledLossFunc(ctx.loss_func, scaler)


# What a plan on the meta device says of amp_native's activations (atorch plan, plan --search).
META_ACTIVATIONS_NOTE = ("  amp_native       activations in autocast's dtypes, its casts emulated on the meta device "
                         "(CUDA autocast's\n                   op lists, atorch/amp/meta_autocast.py): fp32 where the "
                         "model keeps fp32 (a Hugging Face\n                   Llama's residual stream, norms and "
                         "loss); a 1.1B Llama's bf16 peak on an H200 read 0.98 of measured")


def cost_term(config: AmpNativeConfig, cost) -> None:
    cost.compute_dtype = "half"
    # autocast's host overhead, calibrated per forward operator it dispatches (its casts)
    cost.charge("amp_native", cost.forward_ops * cost.op_share, per_micro_batch=True)
    if "amp_native" not in cost.absorbed:
        # autocast keeps a low-precision copy of each weight it casts during forward (a sharding
        # method that absorbs amp gathers its weights in that dtype instead)
        cost.copies += cost.param_numel() * config.dtype.itemsize * cost.split * cost.stage_share


def _unsupported(device_ctx, config) -> str | None:
    return bf16_unsupported(device_ctx, config.dtype)


register_method(
    MethodSpec(
        name="amp_native",
        config_cls=AmpNativeConfig,
        hooks={Stage.REWRITE: wrap_forward, Stage.OPTIMIZER: wrap_optimizer},
        # Under fsdp/zero2 the sharding method computes in amp's dtype; loss scaling stays.
        skipped_when_absorbed=(Stage.REWRITE,),
        absorbed_probe=probe_in_dtype,
        # Autocast wraps the forward that finally runs: after the model is rewritten or split
        # (wrapping the root first would leave pipeline stages, which never call it, in fp32).
        after=("module_replace", "tensor_parallel", "pipeline_parallel", "mixed_parallel", "ds_3d_parallel", "fp8",
               "genomic_bottleneck"),
        description="torch.autocast mixed precision (fp16 with loss scaling, or bf16)",
        overridden_by=("half",),
        unsupported=_unsupported,
        search_space=({"dtype": "bfloat16"},),
        cost_term=cost_term,
        decided_by=("half",),
    )
)
