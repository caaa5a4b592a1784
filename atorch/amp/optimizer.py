"""Loss scaling that keeps the user's loop unchanged: ``loss.backward(); optim.step()``.

With fp16, gradients are scaled by a ``GradScaler`` through the loss function, and the optimizer
wrapper unscales, skips steps whose gradients hold inf/nan, and updates the scale. The loss value
the user sees stays the true (unscaled) loss.
"""

from typing import Any

import torch
import torch.distributed as dist

from atorch.utils.log import logger
from atorch.utils.optim import OptimizerWrapper


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.save_for_backward(scale)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.dtype), None


def _grad_scaled(loss: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
    # The value stays the true loss (printing and logging show it exactly), while the gradient
    # that flows back through it is multiplied by the scaler's current scale.
    from atorch.loss.contract import carry_marks

    scale = scaler.scale(torch.ones((), device=loss.device, dtype=torch.float32))
    return carry_marks(loss, _ScaleGrad.apply(loss, scale))


class ScaledLossFunc:
    """Wraps ``loss_func(input, output)`` so ``backward`` on its result produces scaled gradients."""

    def __init__(self, loss_func, scaler: torch.amp.GradScaler):
        self.loss_func, self.scaler = loss_func, scaler

    def __call__(self, *args, **kwargs) -> Any:
        out = self.loss_func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return _grad_scaled(out, self.scaler)
        if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
            return type(out)([_grad_scaled(out[0], self.scaler), *out[1:]])
        raise TypeError(
            f"loss_func returned {type(out).__name__}; it must return a loss tensor or a sequence whose "
            "first item is the loss"
        )


class AmpOptimizer(OptimizerWrapper):
    """An optimizer that steps through a GradScaler (fp16) or skips non-finite steps (bf16).

    Everything else (``param_groups``, ``zero_grad``, ``state``, ...) is the wrapped optimizer's
    (:class:`atorch.utils.optim.OptimizerWrapper`).
    To clip gradients with fp16, call :meth:`unscale_` first, as with a plain GradScaler.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        skip_if_nonfinite: bool,
        sync_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(optimizer)
        self.scaler = scaler
        self.skip_if_nonfinite = skip_if_nonfinite
        # Ranks whose gradients may differ (shards): they must agree on skipping a step.
        self.sync_group = sync_group
        self.skipped_steps = 0

    def step(self, closure=None):
        """One step; ``closure`` (as torch optimizers take it, and Lightning passes it) runs the
        forward and backward first, and its loss is returned."""
        loss = None
        if closure is not None:
            # Run here, not by the inner optimizer: a GradScaler refuses a closure, and the
            # gradients must exist before they are checked for inf/nan.
            with torch.enable_grad():
                loss = closure()
        if self.scaler is not None:
            result = self._scaled_step()
        elif self.skip_if_nonfinite and not self._grads_finite():
            result = self._skip()
        else:
            result = self.optimizer.step()
        return loss if closure is not None else result

    def _scaled_step(self):
        scale_before = self.scaler.get_scale()
        if self.sync_group is not None:
            self.scaler.unscale_(self.optimizer)
            if not self._grads_finite():
                # update(new_scale) lowers the scale and clears this step's record, like a skip.
                self.scaler.update(scale_before * self.scaler.get_backoff_factor())
                return self._skip()
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale_before:
            return self._skip()
        return result

    def _skip(self) -> None:
        self.skipped_steps += 1
        logger.debug("optimizer step skipped: gradients hold inf or nan")
        return None

    def _grads_finite(self) -> bool:
        """True when every gradient on every rank of ``sync_group`` is finite."""
        # Here, not at the top: torch.distributed.tensor imports torch._dynamo (0.4 s), which
        # `atorch validate` (the method registry) does not need.
        from torch.distributed.tensor import DTensor

        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        finite = torch.stack([torch.isfinite(g).all() for g in local]).all() if local else torch.tensor(True)
        if self.sync_group is not None:
            flag = finite.to(torch.float32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.sync_group)
            return bool(flag.item() == 1)
        return bool(finite)

    def unscale_(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.optimizer!r}, fp16_scaler={self.scaler is not None})"
