"""half: the whole model in fp16 or bf16, floating inputs cast to match.

Config forms: ``"half"`` (fp16), ``("half", "bf16")``, ``("half", torch.bfloat16)``,
``{"dtype": "bfloat16"}``. Parameters and optimizer state are half precision too; use
``amp_native`` when you want fp32 master weights.
"""

from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from atorch.auto.config_types import DType, MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.registry import MethodSpec, Stage, register_method


class HalfConfig(MethodConfig):
    dtype: DType = Field(default=torch.float16, description="float16 or bfloat16")

    @model_validator(mode="before")
    @classmethod
    def _from_atorch_form(cls, raw: Any) -> Any:
        return {"dtype": raw} if isinstance(raw, (str, torch.dtype)) else raw

    @field_validator("dtype")
    @classmethod
    def _half_only(cls, dtype: torch.dtype) -> torch.dtype:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"half needs float16 or bfloat16, not {dtype}")
        return dtype


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors (also inside dicts, lists, tuples) cast to ``dtype``; others unchanged."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, dict):
        return type(data)((key, cast_floats(value, dtype)) for key, value in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(cast_floats(value, dtype) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floats(value, dtype) for value in data)
    return data


class _CastingPrepareInput:
    def __init__(self, inner, dtype: torch.dtype):
        self.inner, self.dtype = inner, dtype

    def __call__(self, data: Any, device: torch.device) -> Any:
        return cast_floats(self.inner(data, device), self.dtype)


def to_half(ctx: ModelContext, config: HalfConfig) -> None:
    ctx.model.to(config.dtype)
    ctx.prepare_input = _CastingPrepareInput(ctx.prepare_input, config.dtype)


def _unsupported(device_ctx, config: HalfConfig) -> str | None:
    if device_ctx.device_type == "cuda" and config.dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return "this GPU has no bfloat16 support"
    return None


register_method(
    MethodSpec(
        name="half",
        config_cls=HalfConfig,
        hooks={Stage.REWRITE: to_half},
        description="model, inputs and optimizer state in fp16 or bf16",
        unsupported=_unsupported,
    )
)
