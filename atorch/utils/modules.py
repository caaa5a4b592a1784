"""Reading a model's structure: which classes are its repeated blocks, which modules match a name."""

from collections import Counter
from collections.abc import Iterable

import torch

from atorch.auto.config_types import class_matches


def find_block_classes(model: torch.nn.Module) -> list[type]:
    """The classes of a model's repeated blocks: the types that fill a ``ModuleList`` (2+ entries).

    This finds transformer layers of any model family by structure rather than by a list of
    known names (``LlamaDecoderLayer``, ``GPT2Block``, ``BertLayer``, ...).
    """
    found: list[type] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2:
            cls, count = Counter(type(child) for child in module).most_common(1)[0]
            if count >= 2 and cls not in found:
                found.append(cls)
    return found


def modules_of_classes(model: torch.nn.Module, names: Iterable[str]) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every submodule whose class matches one of ``names``."""
    names = list(names)
    return [(qname, m) for qname, m in model.named_modules() if any(class_matches(type(m), n) for n in names)]


def class_names_in(model: torch.nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})
