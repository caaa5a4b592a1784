"""AtorchFabricStrategy: an atorch strategy as a Lightning Fabric ``Strategy``.

Fabric keeps the user's loop (``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``,
``fabric.save``/``fabric.load``); atorch applies the strategy in ``fabric.setup`` and builds the
optimizer again, same class, hyperparameters and parameter groups, over the parameters as the
strategy holds them. Checkpoints go through ``atorch.checkpoint``, so a run saved under one
strategy resumes under another. A loss passed to ``fabric.backward`` as the model returned it (or
marked with ``atorch.with_count``) is weighted by the label tokens it counts, so each optimizer
step trains on the global batch's token mean (common.TokenWeights).

Example (``torchrun --nproc_per_node=2``)::

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=AtorchFabricStrategy(["fsdp", "checkpoint"]))
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in micro_batches:                       # accumulation: no_backward_sync on all but the last
        fabric.backward(model(**batch).loss)          # as it is: atorch divides by the step's token count
    fabric.clip_gradients(model, optimizer, max_norm=1.0); optimizer.step(); optimizer.zero_grad()
"""

import inspect
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn.parallel import DistributedDataParallel

import atorch.checkpoint
from atorch.auto import auto_accelerate, clip_grad_norm
from atorch.integrations.common import (
    TrainerStrategyError,
    check_applied,
    check_strategy,
    data_parallel_sampler_kwargs,
    needs_atorch_norm,
    token_weights,
)
from atorch.integrations.lightning import _plain
from atorch.loss.contract import user_loss_func
from atorch.utils.optim import unwrap_optimizer


def _loss_of(batch: Any, output: Any) -> Any:
    return output


class _NoSyncUnderDDP(_BackwardSyncControl):
    """``fabric.no_backward_sync``: DDP skips its all-reduce; sharded strategies sync each backward."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        return module.no_sync() if enabled and isinstance(module, DistributedDataParallel) else nullcontext()


class AtorchFabricStrategy(DDPStrategy):
    """``L.Fabric(strategy=AtorchFabricStrategy(strategy))`` runs the loop under an atorch strategy.

    ``strategy``: a list of method names and ``(name, config)`` pairs, a strategy file path, JSON
    text or a :class:`atorch.auto.Strategy` (the one applied is ``.strategy`` after
    ``fabric.setup``, saved to ``save_strategy_to`` when given). Other keyword arguments go to
    Fabric's ``DDPStrategy``. Set up one model with one optimizer (``fabric.setup(model,
    optimizer)``; the optimizer returned is a new one, same class, over the strategy's parameters)
    and build an LR scheduler over the optimizer ``fabric.setup`` returned. Mixed precision comes from the
    strategy, so keep Fabric's ``precision`` at ``"32-true"``. Strategies that replace the step
    raise :class:`atorch.integrations.common.TrainerStrategyError`.

    ``loss_normalization``: ``"tokens"`` (default) weights each ``fabric.backward(loss)`` by the
    label tokens the loss counts when it is a transformers model's own ``out.loss``, passed as it
    is, or is marked with ``atorch.with_count(loss, count)``; before ``fabric.clip_gradients`` or
    the optimizer step reads the gradients, they are divided by the step's global count, so the
    step trains on the global batch's token mean over every rank and accumulated micro-batch. Pass
    each micro-batch's loss undivided: the count divides, not the accumulation steps. A loss
    divided or changed before ``fabric.backward`` keeps your own weighting (a WARNING once when the
    batch is padded). ``"per_part_mean"``: never weight.
    """

    def __init__(self, strategy: Any, save_strategy_to: str | None = None, loss_normalization: str = "tokens",
                 **kwargs: Any):
        from atorch.loss.contract import MODES

        if loss_normalization not in MODES:
            raise TrainerStrategyError(f"loss_normalization={loss_normalization!r} is not one of {list(MODES)}")
        super().__init__(**kwargs)
        if strategy is None:
            raise TrainerStrategyError(
                "AtorchFabricStrategy applies a named strategy; search for one with atorch.auto_accelerate (or "
                "AtorchTrainer) first and pass the saved file")
        self._requested = check_strategy(strategy, "AtorchFabricStrategy")
        self._save_strategy_to = save_strategy_to
        self._backward_sync_control = _NoSyncUnderDDP()
        self.strategy = None
        self._result = None
        self._loss_normalization = loss_normalization
        self._weights = None  # common.TokenWeights, once the strategy is applied

    def _apply(self, module: torch.nn.Module, optim_func=None, optim_param_func=None):
        if self._result is not None:
            raise TrainerStrategyError("AtorchFabricStrategy applies its strategy to one model: call fabric.setup once")
        precision = type(self.precision).__name__
        if precision != "Precision":
            raise TrainerStrategyError(
                f"AtorchFabricStrategy takes mixed precision from the strategy, not from Fabric ({precision}): "
                "leave precision at '32-true' and add ('amp_native', 'bf16') to the strategy")
        if self._save_strategy_to:
            os.makedirs(os.path.dirname(os.path.abspath(self._save_strategy_to)), exist_ok=True)
        _, result, applied = auto_accelerate(
            module, optim_func, loss_func=_loss_of, optim_param_func=optim_param_func, load_strategy=self._requested,
            find_unused_parameters=bool(self._ddp_kwargs.get("find_unused_parameters", False)),
            save_strategy_to_file=self._save_strategy_to)
        check_applied(result.args, user_loss_func(result.loss_func) is not _loss_of, "AtorchFabricStrategy")
        self._result, self.strategy = result, applied
        self._weights = token_weights(
            module, self._loss_normalization,
            "Pass the model's own out.loss to fabric.backward as it is (not divided by the accumulation steps: "
            "atorch divides each step by its token count), or mark a custom loss with atorch.with_count(loss, count)")
        return result

    # Loss normalization (common.TokenWeights).

    def backward(self, tensor: torch.Tensor, module, *args: Any, **kwargs: Any) -> None:
        weights = self._weights
        if weights is not None and weights.mode == "tokens":
            count = weights.count_of(tensor)
            if count is not None:
                tensor = weights.weigh(tensor, count)
            else:
                weights.unweighted()
        return super().backward(tensor, module, *args, **kwargs)

    def _finish_step(self) -> None:
        """The step's gradients divided by its global token count (once, before they are read)."""
        if self._weights is not None:
            self._weights.finish(self._result.model.parameters())

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self._apply(module).model

    def setup_optimizer(self, optimizer):
        raise TrainerStrategyError(
            "AtorchFabricStrategy builds the optimizer over the parameters as the strategy holds them: pass it "
            "with the model, fabric.setup(model, optimizer)")

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if len(optimizers) != 1 or scheduler is not None:
            raise TrainerStrategyError(
                "AtorchFabricStrategy sets up one model with one optimizer (fabric.setup(model, optimizer)); build "
                "the LR scheduler over the optimizer fabric.setup returns")
        optimizer = optimizers[0]
        names = {id(p): name for name, p in module.named_parameters()}
        groups = [([names[id(p)] for p in group["params"]], {k: v for k, v in group.items() if k != "params"})
                  for group in optimizer.param_groups]

        def param_groups(model: torch.nn.Module) -> list[dict]:
            # The user's groups, by parameter name, over the parameters the strategy made.
            named = dict(model.named_parameters())
            return [{"params": [named[name] for name in group_names], **options} for group_names, options in groups]

        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # AdamW's defaults hold more
        result = self._apply(module, lambda params, **_: type(optimizer)(params, **defaults), param_groups)
        # Fabric gets the torch optimizer under atorch's wrappers (amp's skip of non-finite steps),
        # so an LR scheduler can be built over what fabric.setup returns; optimizer_step below
        # steps through the wrappers.
        return result.model, [unwrap_optimizer(result.optim)], None

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self._finish_step()
        if self._result is not None and optimizer is unwrap_optimizer(self._result.optim):
            optimizer = self._result.optim
        return super().optimizer_step(optimizer, **kwargs)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks of one tensor-parallel group read the same batches."""
        return data_parallel_sampler_kwargs() or super().distributed_sampler_kwargs

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        self._finish_step()
        if self.strategy is None or not needs_atorch_norm(self.strategy):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return clip_grad_norm(self._result.model, float(max_norm))

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        self._finish_step()
        return super().clip_gradients_value(module, optimizer, clip_val)

    # Checkpoints: atorch.checkpoint on every rank, whatever holds the parameters.

    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any = None, filter=None) -> None:
        if filter:
            raise TrainerStrategyError("AtorchFabricStrategy saves whole checkpoints: drop filter= from fabric.save")
        rest = {}
        for key, value in state.items():
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or value is self._result.optim:
                continue  # the model and optimizer: atorch saves them
            rest[key] = _plain(value.state_dict() if hasattr(value, "state_dict") else value)
        atorch.checkpoint.save(path, self._result.model, self._result.optim, extra=rest)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None) -> dict:
        if not isinstance(state, dict):
            raise TrainerStrategyError("AtorchFabricStrategy loads into the state dict given to fabric.save: "
                                       "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        rest = atorch.checkpoint.load(path, self._result.model, self._result.optim) or {}
        for key, value in list(state.items()):
            if key not in rest:
                continue
            if hasattr(value, "load_state_dict") and not isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
                value.load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest
