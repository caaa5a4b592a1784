"""The auto_accelerate front door, strategies and the method registry."""

from atorch.utils.lazy import lazy_exports

# Imported on first use (PEP 562): `atorch.auto.validate` or `atorch.auto.strategy` (what the
# `atorch` command needs) load without the whole auto_accelerate stack.
_LAZY = {
    "AutoAccelerateResult": "atorch.auto.accelerate",
    "apply_strategy": "atorch.auto.accelerate",
    "auto_accelerate": "atorch.auto.accelerate",
    "clip_grad_norm": "atorch.auto.clip",
    "grad_norm": "atorch.auto.clip",
    "ModelContext": "atorch.auto.context",
    "move_to_device": "atorch.auto.context",
    "run_model": "atorch.auto.context",
    "MethodSpec": "atorch.auto.registry",
    "Stage": "atorch.auto.registry",
    "get_method": "atorch.auto.registry",
    "method_names": "atorch.auto.registry",
    "register_method": "atorch.auto.registry",
    "Strategy": "atorch.auto.strategy",
    "register_replace_pair": "atorch.modules.replace",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "AutoAccelerateResult",
    "MethodSpec",
    "ModelContext",
    "Stage",
    "Strategy",
    "apply_strategy",
    "clip_grad_norm",
    "grad_norm",
    "auto_accelerate",
    "get_method",
    "method_names",
    "move_to_device",
    "register_method",
    "register_replace_pair",
    "run_model",
]
