"""The auto_accelerate front door, strategies and the method registry."""

import importlib

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


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
