"""native_dynamo: ``torch.compile`` the model in place.

Config forms: ``"native_dynamo"`` (inductor), ``{"backend": "aot_eager", "mode": None,
"fullgraph": False, "dynamic": None}``. The module is compiled with ``Module.compile``, so its
class and ``state_dict`` keys do not change (no ``_orig_mod.`` prefix).
"""

from typing import Any

import torch
from pydantic import Field, model_validator

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError


class NativeDynamoConfig(MethodConfig):
    backend: str = Field(default="inductor", description="a torch.compile backend name")
    mode: str | None = Field(default=None, description="inductor mode: default, reduce-overhead, max-autotune")
    fullgraph: bool = Field(default=False, description="fail instead of breaking the graph")
    dynamic: bool | None = Field(default=None, description="dynamic shapes: None lets torch decide")

    @model_validator(mode="before")
    @classmethod
    def _from_atorch_form(cls, raw: Any) -> Any:
        return {"backend": raw} if isinstance(raw, str) else raw


def resolve(model: torch.nn.Module, config: NativeDynamoConfig) -> NativeDynamoConfig:
    backends = torch.compiler.list_backends(exclude_tags=())
    if config.backend not in backends:
        raise MethodConfigError(f"native_dynamo: unknown backend {config.backend!r}; available: {backends}")
    return config


def compile_model(ctx: ModelContext, config: NativeDynamoConfig) -> None:
    ctx.model.compile(backend=config.backend, mode=config.mode, fullgraph=config.fullgraph, dynamic=config.dynamic)


register_method(
    MethodSpec(
        name="native_dynamo",
        config_cls=NativeDynamoConfig,
        hooks={Stage.COMPILE: compile_model},
        description="torch.compile of the model",
        resolve=resolve,
    )
)
