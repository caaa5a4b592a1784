"""Routed experts in a model, recognized by structure: what a mixture-of-experts block holds.

Two shapes are recognized: the fused experts of Hugging Face's MoE models (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and others in transformers 5: one module with ``num_experts`` and 3-D weights,
one slice per expert) and a ``ModuleList`` named ``experts`` next to a router (``gate`` or
``router``), as older releases and hand-written models hold them. Shared experts (Qwen2-MoE's
``shared_expert``) are not routed and are not counted.
"""

import contextlib

from torch import nn


def routed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The routed experts' modules of ``model`` by name (empty for a dense model)."""
    found = {}
    for name, module in model.named_modules():
        if any(name == seen or name.startswith(seen + ".") for seen in found):
            continue
        if _fused(module) or _listed(name, module, model):
            found[name] = module
    return found


def _fused(module: nn.Module) -> bool:
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return isinstance(experts, int) and experts > 1 and bool(params) and all(
        p.dim() == 3 and p.shape[0] == experts for p in params)


def _listed(name: str, module: nn.Module, model: nn.Module) -> bool:
    if not (isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts" and len(module) > 1):
        return False
    return any(hasattr(block_of(model, name), router) for router in ("gate", "router"))


def expert_count(module: nn.Module) -> int:
    """How many routed experts a module :func:`routed_experts` found holds."""
    return len(module) if isinstance(module, nn.ModuleList) else module.num_experts


def block_of(model: nn.Module, name: str) -> nn.Module:
    """The MoE block that holds the experts named ``name`` (for a ModuleList: the router's owner)."""
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def experts_summary(model: nn.Module) -> tuple[int, float, float] | None:
    """(how many MoE blocks, the routed experts' share of the parameters, the share a token passes
    through: the rest and ``num_experts_per_tok`` of each block's experts), or None when dense.
    Kept while a plan or search costs its candidates (every candidate with tensor_parallel asks)."""
    from atorch.utils.memo import once

    return once(("experts summary", id(model)), lambda: _summary(model))


def _summary(model: nn.Module) -> tuple[int, float] | None:
    found = routed_experts(model)
    if not found:
        return None
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for module in found.values() for p in module.parameters()) / max(total, 1)
    experts = expert_count(next(iter(found.values())))
    return len(found), routed, 1 - routed * (1 - min(expert_choices(model), experts) / experts)


def expert_choices(model: nn.Module) -> int:
    """Experts each token goes to (the config's ``num_experts_per_tok``; 1 when it has none)."""
    config = getattr(model, "config", None)
    return int(getattr(config, "num_experts_per_tok", None) or 1)


class _ExpectedLoad:
    """A fused experts module's forward on the meta device, where tokens cannot be routed (which
    expert a token picks is data): every (token, choice) pair runs through one expert's weights,
    so the FLOPs and the activations are those of evenly spread routing, T x top-k expert MLPs."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        from torch.nn import functional as F

        module = self.module
        tokens, choices = top_k_index.shape
        rows = hidden_states.repeat_interleave(choices, dim=0)
        gate, up = F.linear(rows, module.gate_up_proj[0]).chunk(2, dim=-1)
        out = F.linear(module.act_fn(gate) * up, module.down_proj[0])
        out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
        return out.view(tokens, choices, -1).sum(dim=1).to(hidden_states.dtype)


@contextlib.contextmanager
def expected_load(model: nn.Module):
    """Within the block, ``model``'s fused routed experts compute as :class:`_ExpectedLoad` does
    (the cost model's probe on the meta device); their own forwards come back after it."""
    swapped = []
    for module in routed_experts(model).values():
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and hasattr(module, "act_fn"):
            swapped.append((module, module.__dict__.get("forward")))
            module.forward = _ExpectedLoad(module)
    try:
        yield
    finally:
        for module, own in swapped:
            if own is None:
                del module.forward
            else:
                module.forward = own
