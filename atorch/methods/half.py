"""half: the whole model in fp16 or bf16, floating inputs cast to match.

Config forms: ``"half"`` (fp16), ``("half", "bf16")``, ``("half", torch.bfloat16)``,
``{"dtype": "bfloat16"}``. Parameters and optimizer state are half precision too; use
``amp_native`` when you want fp32 master weights.
"""

from typing import Any

import torch
from pydantic import Field, model_validator

from atorch.auto.config_types import HalfDType, MethodConfig, bf16_unsupported, dtype_shorthand
from atorch.auto.context import ModelContext, map_tensors
from atorch.auto.method_spec import MethodSpec, Stage, register_method


class HalfConfig(MethodConfig):
    dtype: HalfDType = Field(default=torch.float16, description="float16 or bfloat16")

    _from_atorch_form = model_validator(mode="before")(dtype_shorthand)


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors (also inside dicts, lists, tuples) cast to ``dtype``; others unchanged."""
    return map_tensors(data, lambda t: t.to(dtype) if t.is_floating_point() else t)


class _CastingPrepareInput:
    def __init__(self, inner, dtype: torch.dtype):
        self.inner, self.dtype = inner, dtype

    def __call__(self, data: Any, device: torch.device) -> Any:
        return cast_floats(self.inner(data, device), self.dtype)


def to_half(ctx: ModelContext, config: HalfConfig) -> None:
    ctx.model.to(config.dtype)
    ctx.prepare_input = _CastingPrepareInput(ctx.prepare_input, config.dtype)


def _unsupported(device_ctx, config) -> str | None:
    return bf16_unsupported(device_ctx, config.dtype)


def cost_term(config: HalfConfig, cost) -> None:
    # Parameters, gradients and optimizer state in 2 bytes; matmuls at the half rate.
    cost.weight_scale *= 0.5
    cost.split_model(0.5)
    cost.compute_dtype = "half"


register_method(
    MethodSpec(
        name="half",
        config_cls=HalfConfig,
        hooks={Stage.REWRITE: to_half},
        # Cast what finally runs: replaced modules and split layers come out in fp32.
        after=("module_replace", "tensor_parallel", "pipeline_parallel", "mixed_parallel", "ds_3d_parallel"),
        description="model, inputs and optimizer state in fp16 or bf16",
        unsupported=_unsupported,
        cost_term=cost_term,
        decided_by=("half",),
    )
)
