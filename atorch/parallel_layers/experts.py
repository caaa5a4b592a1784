"""Routed experts in a model, recognized by structure: what a mixture-of-experts block holds.

Two shapes are recognized: the fused experts of Hugging Face's MoE models (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and others in transformers 5: one module with ``num_experts`` and 3-D weights,
one slice per expert) and a ``ModuleList`` named ``experts`` next to a router (``gate`` or
``router``), as older releases and hand-written models hold them. Shared experts (Qwen2-MoE's
``shared_expert``) are not routed and are not counted.
"""

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
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return any(hasattr(parent, router) for router in ("gate", "router"))


def experts_summary(model: nn.Module) -> tuple[int, float] | None:
    """(how many MoE blocks, the routed experts' share of the parameters), or None when dense."""
    found = routed_experts(model)
    if not found:
        return None
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for module in found.values() for p in module.parameters())
    return len(found), routed / max(total, 1)
