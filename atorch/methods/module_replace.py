"""module_replace: swap modules for faster equivalents with the same weights and outputs.

Config forms: ``"module_replace"`` (every registered pair that helps on this device, and SDPA
attention for Hugging Face models), ``{"pairs": ["hf_rmsnorm"], "hf_attention": "sdpa"}``,
``{"kernels": "liger"}``. Named pairs are applied on any device. ``atorch.auto.register_replace_pair``
adds pairs.

``kernels="liger"``: liger-kernel's fused Triton kernels (RMSNorm, rotary embedding, SwiGLU) on
the transformers model families it supports (``pip install 'atorch[liger]'``, a CUDA GPU). The
logits and the loss stay transformers' own, so a ``loss_func`` that reads them still works. Liger
patches the family's modeling module for the whole process, not this model alone. Elsewhere (a
CPU, liger-kernel missing) the method is dropped with the reason in ``result.notes``; a model
family liger does not cover is refused by name.
"""

import importlib.util
import inspect
from typing import Literal

import torch
from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.distributed import env
from atorch.errors import MethodConfigError
from atorch.modules.replace import replace_pairs, swap_modules
from atorch.utils.log import logger


class ModuleReplaceConfig(MethodConfig):
    pairs: list[str] | None = Field(default=None, description="replace pairs to apply; None: those that help on this device")
    hf_attention: str | None = Field(
        default="sdpa", description="attention implementation for transformers models (sdpa, flash_attention_2, ...); None leaves it"
    )
    kernels: Literal["liger"] | None = Field(default=None, description="liger: liger-kernel's fused kernels for "
                                             "the transformers model's blocks (CUDA)")


def resolve(model: torch.nn.Module, config: ModuleReplaceConfig) -> ModuleReplaceConfig:
    known = replace_pairs()
    unknown = [name for name in config.pairs or [] if name not in known]
    if unknown:
        raise MethodConfigError(f"module_replace: unknown replace pairs {unknown}; registered: {sorted(known)}")
    if config.kernels == "liger":
        _liger_patch(model)
    return config


def _unsupported(device_ctx, config: ModuleReplaceConfig) -> str | None:
    if config.kernels != "liger":
        return None
    if device_ctx.device.type != "cuda":
        return f"kernels='liger' runs Triton kernels on a CUDA GPU, not on {device_ctx.device.type}; leave kernels out"
    if importlib.util.find_spec("liger_kernel") is None:
        return "kernels='liger' needs liger-kernel: pip install 'atorch[liger]'"
    return None


def _liger_patch(model: torch.nn.Module):
    """liger-kernel's patch for ``model``'s transformers family, or a MethodConfigError naming it."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    hf = _hf_model(model)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise MethodConfigError(f"module_replace: liger-kernel has no kernels for model type {model_type!r} "
                                f"(it covers {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}); leave kernels out")
    return MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]


def _apply_liger(model: torch.nn.Module) -> None:
    patch = _liger_patch(model)
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False, "model": _hf_model(model)}
    accepted = inspect.signature(patch).parameters
    patch(**{key: value for key, value in wanted.items() if key in accepted})
    logger.info("module_replace: liger-kernel's kernels applied (%s)", patch.__name__)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformers model that sets the attention implementation (inside peft's wrapper)."""
    inner = getattr(model, "base_model", model)  # peft wraps the transformers model
    for candidate in (model, inner, getattr(inner, "model", None)):
        if candidate is not None and hasattr(candidate, "set_attn_implementation") and hasattr(candidate, "config"):
            return candidate
    return None


def _attention_to_set(model: torch.nn.Module, config: ModuleReplaceConfig) -> torch.nn.Module | None:
    """The transformers model whose attention this config changes, or None when it changes none."""
    hf = _hf_model(model) if config.hf_attention is not None else None
    if hf is None or getattr(hf.config, "_attn_implementation", None) == config.hf_attention:
        return None
    return hf


def _chosen_pairs(config: ModuleReplaceConfig, device_type: str) -> list:
    pairs = replace_pairs()
    if config.pairs is None:
        return [p for p in pairs.values() if p.default_devices is None or device_type in p.default_devices]
    return [pairs[name] for name in config.pairs]


def changes_nothing(model: torch.nn.Module, config: ModuleReplaceConfig) -> str | None:
    """Why this config would change nothing on ``model`` (it is then dropped at plan time)."""
    if config.kernels is not None or _attention_to_set(model, config) is not None:
        return None
    pairs = _chosen_pairs(config, env.device().type)
    if any(pair.matches(module) for module in model.modules() for pair in pairs):
        return None
    attention = "" if config.hf_attention is None else f"its attention is not transformers' or already {config.hf_attention}, and "
    return f"{attention}no module matches the replace pairs {[p.name for p in pairs]} on {env.device().type}"


def apply(ctx: ModelContext, config: ModuleReplaceConfig) -> None:
    if config.kernels == "liger":
        _apply_liger(ctx.model)
    hf = _attention_to_set(ctx.model, config)
    if hf is not None:
        before = getattr(hf.config, "_attn_implementation", None)
        hf.set_attn_implementation(config.hf_attention)
        logger.info("module_replace: transformers attention %s -> %s", before, config.hf_attention)
    for pair in _chosen_pairs(config, ctx.device.type):
        replaced, skipped = swap_modules(ctx.model, pair)
        if replaced or skipped:
            logger.info("module_replace: %s replaced %d modules (%d left: unsupported dtype)", pair.name, replaced, skipped)


register_method(
    MethodSpec(
        name="module_replace",
        config_cls=ModuleReplaceConfig,
        hooks={Stage.REWRITE: apply},
        # Swap modules while the model is plain, before any split or wrapper hides them.
        before=("tensor_parallel", "pipeline_parallel", "mixed_parallel", "ds_3d_parallel", "fp8", "genomic_bottleneck"),
        description="swap modules for faster equivalents (SDPA attention, fused RMSNorm, user pairs)",
        resolve=resolve,
        unsupported=_unsupported,
        changes_nothing=changes_nothing,
        search_space=({},),
        # on a CUDA GPU with liger-kernel installed (elsewhere ``unsupported``: not tried)
        pick_trials=({"kernels": "liger"},),
    )
)
