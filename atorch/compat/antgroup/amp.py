"""ATorch's amp optimizer surface over atorch's :class:`atorch.amp.optimizer.AmpOptimizer`.

What ATorch's ``amp_native`` returns, and so what this front returns:

- fp16: an optimizer with ``grad_scaler`` (the GradScaler) and ``step_was_skipped``;
- bf16 with ``skip_if_nonfinite=True``: the same, ``grad_scaler`` a :class:`BF16GradScaler`
  (scale 1.0 that never grows or backs off; ``has_overflow()`` says whether the last step was
  skipped for inf/nan gradients);
- bf16 without it: the optimizer ``optim_func`` built, unwrapped (no ``grad_scaler``, no
  ``step_was_skipped``).
"""

import sys

import torch

from atorch.amp.optimizer import AmpOptimizer


class BF16GradScaler(torch.amp.GradScaler):
    """ATorch's BF16GradScaler surface: a scale of 1.0 (``_init_scale``, ``_growth_factor`` and
    ``_backoff_factor`` all 1.0), so ``scale(loss)`` is the loss and ``unscale_``/``update`` change
    nothing; ``step(optimizer)`` skips a step whose gradients hold inf/nan and ``has_overflow()``
    says whether the last step was skipped."""

    def __init__(self, device: str = "cpu"):
        super().__init__(device, enabled=False)  # disabled: identity scaling, as a scale of 1.0 is
        self._init_scale = self._growth_factor = self._backoff_factor = 1.0
        self._growth_interval = sys.maxsize
        self.overflow = False

    def has_overflow(self) -> bool:
        return self.overflow

    def get_scale(self) -> float:
        return 1.0

    def step(self, optimizer, *args, **kwargs):
        if isinstance(optimizer, AmpOptimizerView):
            return optimizer.step(*args, **kwargs)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        return None if self.overflow else optimizer.step(*args, **kwargs)


class AmpOptimizerView:
    """ATorch's ``AmpNativeOptimizer`` surface (``grad_scaler``, ``step_was_skipped``) over
    atorch's AmpOptimizer; everything else is the wrapped optimizer's."""

    def __init__(self, inner: AmpOptimizer):
        self._inner, self._skipped = inner, False
        self._scaler = inner.scaler if inner.scaler is not None else BF16GradScaler(_device(inner))

    @property
    def grad_scaler(self):
        return self._scaler

    @property
    def step_was_skipped(self) -> bool:
        return self._skipped

    def step(self, closure=None):
        before = self._inner.skipped_steps
        result = self._inner.step(closure)
        self._skipped = self._inner.skipped_steps > before
        if isinstance(self._scaler, BF16GradScaler):
            self._scaler.overflow = self._skipped
        return result

    def unscale_(self) -> None:
        self._inner.unscale_()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _device(optimizer) -> str:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device.type
    return "cpu"


def atorch_amp_optimizer(optim: AmpOptimizer):
    """What ATorch's amp_native returns for atorch's AmpOptimizer (see the module)."""
    if optim.scaler is None and not optim.skip_if_nonfinite:
        return optim.optimizer  # bf16 without skipping: ATorch leaves the optimizer unwrapped
    return AmpOptimizerView(optim)
