"""Mixed-precision building blocks used by the amp_native method."""

from atorch.amp.autocast import AutocastForward
from atorch.amp.optimizer import AmpOptimizer, ScaledLossFunc

__all__ = ["AmpOptimizer", "AutocastForward", "ScaledLossFunc"]
