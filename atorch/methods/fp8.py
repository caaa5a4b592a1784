"""fp8: ``nn.Linear`` layers replaced by transformer-engine's ``te.Linear``, run under fp8 autocast.

Config forms: ``"fp8"``, ``{"include": ["layers"], "exclude": ["lm_head"], "fp8_format": "HYBRID",
"amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0, "interval": 1,
"reduce_amax": true, "verbose": false}``. Only layers whose weight dims are multiples of 16 (an
fp8 GEMM requirement) are replaced. Needs transformer-engine and a GPU of compute capability 8.9
or newer (Ada, Hopper, Blackwell); elsewhere the method is dropped with the reason logged.
"""

import importlib.util
import re
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.utils.log import logger

FP8_ALIGNMENT = 16


class Fp8Config(MethodConfig):
    include: list[str] | None = Field(default=None, description="regexes; only Linear layers whose name matches one are replaced")
    exclude: list[str] = Field(default_factory=list, description="regexes of Linear layer names to leave alone")
    verbose: bool = Field(default=False, description="log every replaced and skipped layer")
    margin: int = Field(default=0, ge=0, description="DelayedScaling margin")
    interval: int = Field(default=1, ge=1, description="DelayedScaling interval")
    fp8_format: Literal["HYBRID", "E4M3"] = Field(default="HYBRID", description="HYBRID: E4M3 forward, E5M2 backward")
    amax_history_len: int = Field(default=1024, ge=1, description="DelayedScaling amax history length")
    amax_compute_algo: Literal["max", "most_recent"] = Field(default="max", description="how the scale is computed from the history")
    reduce_amax: bool = Field(default=True, description="reduce amax over the data-parallel ranks")


def fp8_candidates(model: nn.Module, include: list[str] | None, exclude: list[str]) -> tuple[list[str], dict[str, str]]:
    """Names of the Linear layers fp8 replaces, and why each other Linear is skipped."""
    chosen, skipped = [], {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if include is not None and not any(re.search(p, name) for p in include):
            skipped[name] = "not matched by include"
        elif any(re.search(p, name) for p in exclude):
            skipped[name] = "matched by exclude"
        elif module.in_features % FP8_ALIGNMENT or module.out_features % FP8_ALIGNMENT:
            skipped[name] = f"dims {module.in_features}x{module.out_features} are not multiples of {FP8_ALIGNMENT}"
        else:
            chosen.append(name)
    return chosen, skipped


def swap_linears(model: nn.Module, names: list[str], factory: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace each named Linear with ``factory(linear)`` (which must copy the weights)."""
    for name in names:
        model.set_submodule(name, factory(model.get_submodule(name)))


def te_linear_from(linear: nn.Linear) -> nn.Module:
    import transformer_engine.pytorch as te

    new = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    params_dtype=linear.weight.dtype, device=linear.weight.device)
    with torch.no_grad():
        new.weight.copy_(linear.weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


class Fp8Forward:
    """Runs the wrapped forward under ``te.fp8_autocast`` with a DelayedScaling recipe."""

    def __init__(self, forward, config: Fp8Config, amax_group):
        from transformer_engine.common.recipe import DelayedScaling, Format

        self.forward = forward
        self.amax_group = amax_group
        self.recipe = DelayedScaling(
            margin=config.margin, interval=config.interval, fp8_format=getattr(Format, config.fp8_format),
            amax_history_len=config.amax_history_len, amax_compute_algo=config.amax_compute_algo,
            reduce_amax=config.reduce_amax,
        )

    def __call__(self, *args, **kwargs):
        import transformer_engine.pytorch as te

        with te.fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=self.amax_group):
            return self.forward(*args, **kwargs)


def apply(ctx: ModelContext, config: Fp8Config) -> None:
    chosen, skipped = fp8_candidates(ctx.model, config.include, config.exclude)
    swap_linears(ctx.model, chosen, te_linear_from)
    group = ctx.topology.data_parallel_group if config.reduce_amax else None
    ctx.model.forward = Fp8Forward(ctx.model.forward, config, group)
    logger.info("fp8: %d Linear layers on te.Linear, %d left as they are", len(chosen), len(skipped))
    if config.verbose:
        for name in chosen:
            logger.info("fp8: %s -> te.Linear", name)
        for name, reason in skipped.items():
            logger.info("fp8: %s kept: %s", name, reason)


def changes_nothing(model: nn.Module, config: Fp8Config) -> str | None:
    """Why fp8 would replace no layer of ``model`` (then it is dropped before anything runs, at
    WARNING and in the result's notes, instead of wrapping the forward in an fp8 autocast that
    no layer uses)."""
    chosen, skipped = fp8_candidates(model, config.include, config.exclude)
    if chosen:
        return None
    why = "; ".join(sorted(set(skipped.values()))) or "it has none"
    return (f"no nn.Linear of {type(model).__name__} can run in fp8 ({why}); change include/exclude, or "
            f"use dims that are multiples of {FP8_ALIGNMENT}")


def _unsupported(device_ctx, config: Fp8Config) -> str | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer-engine is not installed (pip install 'atorch[transformer-engine]')"
    if device_ctx.device_type != "cuda":
        return f"fp8 needs a CUDA GPU and this job runs on {device_ctx.device_type}"
    if device_ctx.capability is None or device_ctx.capability < (8, 9):
        return f"fp8 needs compute capability 8.9 or newer; this GPU has {device_ctx.capability}"
    return None


register_method(
    MethodSpec(
        name="fp8",
        config_cls=Fp8Config,
        hooks={Stage.REWRITE: apply},
        # fp8 swaps the plain nn.Linear layers of a whole model and runs its root forward under
        # fp8 autocast: split layers are not nn.Linear, and pipeline stages never call the root.
        conflicts={
            "tensor_parallel": "tensor-parallel layers are not transformer-engine layers, so they would stay out of fp8",
            "mixed_parallel": "its tensor-parallel layers would stay out of fp8 and its stages never run fp8 autocast",
            "pipeline_parallel": "pipeline stages never call the root forward that runs fp8 autocast",
            "ds_3d_parallel": "DeepSpeed's pipeline stages never call the root forward that runs fp8 autocast",
            "half": "transformer-engine keeps its own fp8 scaling state in the parameters' dtype; use amp_native bf16",
        },
        description="fp8 matmuls through transformer-engine (sm 8.9+)",
        unsupported=_unsupported,
        changes_nothing=changes_nothing,
        search_space=({},),
        # transformer-engine layers need a GPU: the cost model's activation probe leaves them out
        probed=False,
    )
)
