"""native_dynamo: ``torch.compile`` the model in place.

Config forms: ``"native_dynamo"`` (inductor), ``{"backend": "aot_eager", "mode": None,
"fullgraph": False, "dynamic": None}``. The module is compiled with ``Module.compile``, so its
class and ``state_dict`` keys do not change (no ``_orig_mod.`` prefix).

The search tries it on its pick (atorch/auto/search/refine.py): timed side by side with the pick,
its compile (the warm-up's extra seconds) spread over the job's ``planned_steps``. It is not tried
where even halving the step could not pay for a compile over those steps (:func:`cannot_pay`).
"""

import os
import shutil
from typing import Any

import torch
from pydantic import Field, model_validator

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError, NotSupportedError


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


# The least a cold compile takes, and the most of a step it saves. Measured on this project's CPU
# (AMD EPYC, 2 cores, torch 2.13, 2026-11-28, tests/helpers/hf's 2-layer models, forward and
# backward with inductor's C++ backend): 8.8 s (Llama) and 22 s (GPT-2) to compile, steps 0.64x
# and 0.81x of eager's. A GPU compiles a larger graph through Triton; 10 s is a floor there, not a
# measurement. torchtitan's Llama 3.1 8B on H100s: 1.16x from compile (0.86 of the step).
MIN_COMPILE_SECONDS = {"cpu": 8.0, "cuda": 10.0}
MAX_SAVING = 0.5
# A compile tried on the pick is paid twice: in the search's trial and in the job. With the floor
# at 5 s and paid once, the held-out BERT and GPT-2 searches of search_quality.py (steps of tens of
# ms, 1000 planned steps) compiled in every search, kept it in none, and took 1.5-2.8x as long.
COMPILES_PAID = 2


def cannot_pay(config: NativeDynamoConfig, step_seconds: float, planned_steps: int, device_type: str) -> str | None:
    """Why compiling cannot pay over ``planned_steps`` steps of ``step_seconds`` (the search does
    not try it), or None."""
    if config.backend != "inductor":
        return None
    floor = MIN_COMPILE_SECONDS.get(device_type, MIN_COMPILE_SECONDS["cuda"]) * COMPILES_PAID
    most = step_seconds * MAX_SAVING * planned_steps
    if most >= floor:
        return None
    return (f"not tried: over {planned_steps} planned steps of {step_seconds * 1e3:.1f} ms, saving {MAX_SAVING:.0%} of "
            f"each would save {most:.1f}s, less than compiling in the trial and in the job takes here (at least "
            f"{floor:g}s); pass planned_steps to auto_accelerate when the job is longer")


def _unsupported(device_ctx, config: NativeDynamoConfig) -> str | None:
    """Inductor compiles C++ on a CPU: it needs a compiler (the ones inductor looks for; importing
    torch._inductor to ask it takes seconds, which every search would pay)."""
    if config.backend == "inductor" and device_ctx.device.type == "cpu":
        if not any(shutil.which(name) for name in (os.environ.get("CXX"), "g++", "c++", "clang++") if name):
            return "inductor needs a C++ compiler on a CPU (none found on PATH); install g++, or use backend aot_eager"
    return None


# A pipeline split by tracing builds its stages at its first call: compiled, that call runs inside
# dynamo, whose trace of the pipeline's own torch.export trace fails (seen on BERT: "'Tensor'
# object has no attribute 'output'", under a message that blamed the model).
TRACED_PIPELINE = ("native_dynamo cannot compile a pipeline split by tracing: its stages are built from a trace at "
                   "the first call, which would then run inside torch.compile. Register a layout for the model "
                   "(atorch.pipeline.register_layout: its stages are built at once, and compile), or leave "
                   "native_dynamo out")


def compiled_parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What is compiled: a pipeline's stage modules, whose forward is all of its compute (the
    schedule around them stays eager; traced by dynamo, its per-microbatch bookkeeping recompiled
    once per microbatch up to dynamo's limit), or else the model."""
    stages = getattr(model, "stage_modules", None)
    return list(stages) if stages is not None and len(stages) else [model]


def compile_model(ctx: ModelContext, config: NativeDynamoConfig) -> None:
    if getattr(ctx.model, "traced", False):
        raise NotSupportedError(TRACED_PIPELINE)
    for part in compiled_parts(ctx.model):
        part.compile(backend=config.backend, mode=config.mode, fullgraph=config.fullgraph, dynamic=config.dynamic)


register_method(
    MethodSpec(
        name="native_dynamo",
        config_cls=NativeDynamoConfig,
        hooks={Stage.COMPILE: compile_model},
        description="torch.compile of the model",
        resolve=resolve,
        unsupported=_unsupported,
        search_space=({},),
        tried_on_pick=True,
        cannot_pay=cannot_pay,
        # its speed is measured on the pick, never estimated: not pruned as slower on an estimate
        decided_by=("compile",),
        # compiling the probe's copy would cost a compile per estimate and show no fusion on meta
        probed=False,
    )
)
