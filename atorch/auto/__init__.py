"""The auto_accelerate front door, strategies and the method registry."""

from atorch.auto.accelerate import AutoAccelerateResult, apply_strategy, auto_accelerate
from atorch.auto.clip import clip_grad_norm, grad_norm
from atorch.auto.context import ModelContext, move_to_device, run_model
from atorch.auto.registry import MethodSpec, Stage, get_method, method_names, register_method
from atorch.auto.strategy import Strategy
from atorch.modules.replace import register_replace_pair

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
