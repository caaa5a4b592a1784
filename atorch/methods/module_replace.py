"""module_replace: swap modules for faster equivalents with the same weights and outputs.

Config forms: ``"module_replace"`` (every registered pair that helps on this device, and SDPA
attention for Hugging Face models), ``{"pairs": ["hf_rmsnorm"], "hf_attention": "sdpa"}``.
Named pairs are applied on any device. ``atorch.auto.register_replace_pair`` adds pairs.
"""

import torch
from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.registry import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError
from atorch.modules.replace import replace_pairs, swap_modules
from atorch.utils.log import logger


class ModuleReplaceConfig(MethodConfig):
    pairs: list[str] | None = Field(default=None, description="replace pairs to apply; None: those that help on this device")
    hf_attention: str | None = Field(
        default="sdpa", description="attention implementation for transformers models (sdpa, flash_attention_2, ...); None leaves it"
    )


def resolve(model: torch.nn.Module, config: ModuleReplaceConfig) -> ModuleReplaceConfig:
    known = replace_pairs()
    unknown = [name for name in config.pairs or [] if name not in known]
    if unknown:
        raise MethodConfigError(f"module_replace: unknown replace pairs {unknown}; registered: {sorted(known)}")
    return config


def _set_hf_attention(model: torch.nn.Module, implementation: str) -> bool:
    inner = getattr(model, "base_model", model)  # peft wraps the transformers model
    for candidate in (model, inner, getattr(inner, "model", None)):
        if candidate is not None and hasattr(candidate, "set_attn_implementation") and hasattr(candidate, "config"):
            candidate.set_attn_implementation(implementation)
            return True
    return False


def apply(ctx: ModelContext, config: ModuleReplaceConfig) -> None:
    if config.hf_attention is not None and _set_hf_attention(ctx.model, config.hf_attention):
        logger.info("module_replace: transformers attention set to %s", config.hf_attention)
    pairs = replace_pairs()
    if config.pairs is None:
        chosen = [p for p in pairs.values() if p.default_devices is None or ctx.device.type in p.default_devices]
    else:
        chosen = [pairs[name] for name in config.pairs]
    for pair in chosen:
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
        search_space=({},),
    )
)
