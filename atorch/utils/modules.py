"""Reading a model's structure: which classes are its repeated blocks, which modules match a name."""

import difflib
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


def first_block(model: torch.nn.Module) -> torch.nn.Module:
    """The first of the model's repeated blocks (:func:`find_block_classes`), in module order."""
    classes = tuple(find_block_classes(model))
    return next(m for m in model.modules() if isinstance(m, classes))


def by_block(model: torch.nn.Module, names: Iterable[str]) -> list[list[str]]:
    """``names`` (qualified module names) grouped by the repeated block (:func:`find_block_classes`)
    that holds them, each group in the given order; names outside every block are left out."""
    names = list(names)
    classes = tuple(find_block_classes(model))
    blocks = [name for name, m in model.named_modules() if classes and isinstance(m, classes)]
    return [[name for name in names if name.startswith(block + ".")] for block in blocks]


def modules_of_classes(model: torch.nn.Module, names: Iterable[str]) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every submodule whose class matches one of ``names``."""
    names = list(names)
    return [(qname, m) for qname, m in model.named_modules() if any(class_matches(type(m), n) for n in names)]


def class_names_in(model: torch.nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def unit_summary(model: torch.nn.Module, names: Iterable[str]) -> str:
    """``2 x GPT2Block, 4 x Linear``: how many of the named submodules there are of each class."""
    modules = dict(model.named_modules())
    counts = Counter(type(modules[name]).__name__ for name in names)
    return ", ".join(f"{count} x {cls}" for cls, count in counts.items()) or "none"


def missing_class_error(method: str, field: str, names: list[str], model: torch.nn.Module) -> str:
    """The message for class names of which the model has no module: what to write instead.

    A ready strategy file may name another model's blocks (``LlamaDecoderLayer`` on GPT-2); an
    empty list detects this model's repeated blocks, so the message says so and names them, with
    the model's classes closest to the names given.
    """
    present = class_names_in(model)
    short = [name.rsplit(".", 1)[-1] for name in names]
    close = sorted({match for name in short for match in difflib.get_close_matches(name, present, n=3, cutoff=0.5)})
    blocks = [cls.__name__ for cls in find_block_classes(model)]
    lines = [f"{method}: no module of class {short} in the model."]
    if blocks:
        lines.append(f'Fix: write "{field}": [] to use the model\'s repeated blocks, found by structure (here '
                     f"{blocks}), or name classes the model has.")
    else:
        lines.append(f'Fix: name classes the model has in "{field}" (it has no repeated blocks to detect).')
    if close:
        lines.append(f"Closest class names in the model: {close}.")
    lines.append(f"Classes in the model: {present}")
    return " ".join(lines)
