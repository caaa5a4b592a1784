"""Replacement pairs: which modules module_replace swaps, and for what.

A pair names what it matches (a class, a class name, or a predicate on the module), the class
that replaces it (built with ``from_original(module)``), the parameter dtypes it supports and
the device types where it is worth applying by default.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from atorch.auto.config_types import class_matches
from atorch.modules.norms import FusedRMSNorm, is_hf_style_rmsnorm


@dataclass(frozen=True)
class ReplacePair:
    name: str
    original: type | str | Callable[[nn.Module], bool]
    replacement: type
    supported_dtypes: frozenset[torch.dtype]
    # Device types where the replacement is faster; elsewhere it only runs when named explicitly.
    default_devices: frozenset[str] | None = None

    def matches(self, module: nn.Module) -> bool:
        if isinstance(self.original, type):
            return type(module) is self.original
        if isinstance(self.original, str):
            return class_matches(type(module), self.original)
        return bool(self.original(module))

    def build(self, module: nn.Module) -> nn.Module:
        return self.replacement.from_original(module)


_PAIRS: dict[str, ReplacePair] = {}


def register_replace_pair(
    name: str,
    pair_cls: tuple,
    supported_dtypes: Iterable[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
    default_devices: Iterable[str] | None = None,
) -> ReplacePair:
    """Teach module_replace a new swap.

    ``pair_cls`` is ``(original, replacement)``: ``original`` a class, class name or predicate;
    ``replacement`` a module class with a ``from_original(module)`` classmethod that copies the
    weights. Modules whose parameters are in a dtype outside ``supported_dtypes`` are left alone.

    Example::

        class MyFastMLP(nn.Module):
            @classmethod
            def from_original(cls, mlp): ...

        register_replace_pair("fast_mlp", (MyMLP, MyFastMLP), [torch.bfloat16])
        load_strategy=[("module_replace", {"pairs": ["fast_mlp"]})]
    """
    if name in _PAIRS:
        raise ValueError(f"a replace pair named {name!r} is already registered; pick another name")
    if not (isinstance(pair_cls, (tuple, list)) and len(pair_cls) == 2):
        raise ValueError("pair_cls must be (original, replacement)")
    original, replacement = pair_cls
    if not hasattr(replacement, "from_original"):
        raise ValueError(f"{replacement.__name__} needs a classmethod from_original(module) that builds it from the original")
    pair = ReplacePair(name, original, replacement, frozenset(supported_dtypes),
                       None if default_devices is None else frozenset(default_devices))
    _PAIRS[name] = pair
    return pair


def unregister_replace_pair(name: str) -> None:
    _PAIRS.pop(name, None)


def replace_pairs() -> dict[str, ReplacePair]:
    return dict(_PAIRS)


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    param = next(module.parameters(), None)
    return None if param is None else param.dtype


def swap_modules(model: nn.Module, pair: ReplacePair) -> tuple[int, int]:
    """Replace every match of ``pair`` in ``model``; return (replaced, skipped for dtype)."""
    replaced = skipped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not pair.matches(child):
                continue
            if _param_dtype(child) not in pair.supported_dtypes:
                skipped += 1
                continue
            setattr(parent, child_name, pair.build(child))
            replaced += 1
    return replaced, skipped


# The fused RMSNorm kernel exists on CUDA; on other devices the swap gains nothing by default.
register_replace_pair("hf_rmsnorm", (is_hf_style_rmsnorm, FusedRMSNorm), default_devices=["cuda"])
