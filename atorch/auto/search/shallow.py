"""A plan's probe of a deep model, from two shallow copies.

On meta tensors a probe's forward costs the same per layer however large the tensors: 15 ms a
layer, 1.2 s for a 70B Llama's 80, once per distinct set of methods. A model whose layers are one
``ModuleList`` of identical blocks (the same shapes and the same kind of attention: not Gemma's
sliding and full blocks) is probed with the first block alone and with the first two;
each count (saved bytes, FLOPs, operators, checkpointed blocks) is the one-block count plus
(n - 1) x the second block's. Identical blocks count the same, so the result is the deep probe's
(tests/auto/search/test_shallow.py compares them).
"""

import contextlib

import torch

# what makes blocks of the same shapes compute differently: Gemma2/3, GPT-OSS and Qwen2 with
# max_window_layers alternate sliding-window and full attention (config.layer_types)
_KIND_ATTRIBUTES = ("attention_type", "sliding_window", "is_sliding")


def repeated_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's largest ``ModuleList`` whose entries are all of one class with the same
    parameter shapes and the same kind of attention, or None."""
    best = None
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 3:
            continue
        first = module[0]
        shapes = [tuple(p.shape) for p in first.parameters()]
        if all(type(b) is type(first) and [tuple(p.shape) for p in b.parameters()] == shapes for b in module):
            if _one_kind(model, module) and (best is None or len(module) > len(best)):
                best = module
    return best


def _one_kind(model: torch.nn.Module, blocks: torch.nn.ModuleList) -> bool:
    """Whether every block attends alike: the first two blocks then stand for the rest. A Gemma3
    whose first blocks use sliding windows had its full-attention blocks' FLOPs extrapolated as 0."""
    types = getattr(getattr(model, "config", None), "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == len(blocks) and len(set(types)) > 1:
        return False
    kinds = {tuple((name, attribute, getattr(m, attribute, None)) for name, m in block.named_modules()
                   for attribute in _KIND_ATTRIBUTES) for block in blocks}
    return len(kinds) == 1


@contextlib.contextmanager
def truncated(blocks: torch.nn.ModuleList, keep: int):
    """``blocks`` holds only its first ``keep`` entries inside the block (the model is shared:
    nothing else may use it meanwhile)."""
    kept = dict(blocks._modules)
    blocks._modules = {k: kept[k] for k in list(kept)[:keep]}
    try:
        yield
    finally:
        blocks._modules = kept


def extrapolate(one, two, n: int):
    """The count for ``n`` blocks from those for one and two (numbers, or tuples and lists of them
    position by position; anything else is taken from the two-block probe)."""
    if isinstance(one, bool) or isinstance(two, bool):
        return two
    if isinstance(one, (int, float)) and isinstance(two, (int, float)):
        value = one + (n - 1) * (two - one)
        return type(two)(value) if isinstance(two, int) and isinstance(one, int) else value
    if isinstance(one, (tuple, list)) and isinstance(two, (tuple, list)) and len(one) == len(two) and one != two:
        return type(two)(extrapolate(a, b, n) for a, b in zip(one, two))
    return two
