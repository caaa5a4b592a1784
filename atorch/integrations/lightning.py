"""AtorchStrategy: an atorch strategy as a Lightning ``Strategy``.

Lightning keeps its loop (training_step, backward, optimizer and scheduler steps, gradient
accumulation and clipping, logging); atorch applies the strategy to the LightningModule
(``auto_accelerate``) before ``configure_optimizers`` builds the optimizer, so the optimizer holds
the parameters as the strategy holds them (FSDP2 shards, tensor-parallel pieces). The data are
sharded over the data-parallel ranks, and checkpoints go through ``atorch.checkpoint``, so a run
saved under one strategy resumes under another. On padded batches the loss ``training_step``
returns is weighted by the label tokens it counts (common.TokenWeights), so each optimizer step
trains on the global batch's token mean.

Example (``torchrun --nproc_per_node=2 examples/lightning_train.py``)::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AtorchStrategy(["fsdp", "checkpoint"]))
    trainer.fit(module, dataloader)
"""

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

import atorch.checkpoint
from atorch.auto import auto_accelerate, clip_grad_norm
from atorch.integrations.common import (
    SEARCH_EXCLUDED,
    TrainerStrategyError,
    check_applied,
    check_strategy,
    data_parallel_sampler_kwargs,
    needs_atorch_norm,
    token_weights,
)
from atorch.loss.contract import user_loss_func

# What a Lightning checkpoint holds beside the model and optimizer states (atorch saves those).
_MODEL_KEYS = ("state_dict", "optimizer_states")
REPORT_FILE = "atorch_search_report.json"  # in the Trainer's default_root_dir


def _loss_of(batch: Any, output: Any) -> Any:
    return output


def _plain(value: Any) -> Any:
    """Lightning's checkpoint entries as plain data (atorch.checkpoint stores nothing else)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


class _TrainingStep(torch.nn.Module):
    """The LightningModule's ``training_step`` as a model, for the search's dry runs."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch):
        out = self.module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out


def search_from_lightning(module, world_size: int, options: dict):
    """The strategy the search picks for ``module``'s training step on its training data.

    Candidates are dry-run on copies of the module (``training_step`` as the forward, the
    optimizer class and hyperparameters from ``configure_optimizers``, the batches of the
    training dataloader ``fit`` was given); the module itself is left as it was, and its report is
    written to the Trainer's ``default_root_dir``. The copies have no Trainer: ``self.log`` in
    ``training_step`` does nothing there, and a ``training_step`` that reads ``self.trainer``
    fails every candidate (pass a strategy instead). The search's global batch is the loader's
    ``batch_size`` times the world size, also for tensor-parallel candidates, whose ranks read one
    batch in training: their dry runs see a larger batch than training will."""
    trainer = module.trainer
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        raise TrainerStrategyError("AtorchStrategy(strategy=None) searches on the training data: pass a train "
                                   "dataloader to fit (or define train_dataloader)")
    loader = source.dataloader()
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.batch_size is None:
        raise TrainerStrategyError("AtorchStrategy(strategy=None) searches on one torch DataLoader with a "
                                   f"batch_size; fit got {type(loader).__name__}: pass a strategy instead")
    optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    if len(optimizers) != 1:
        raise TrainerStrategyError(f"AtorchStrategy runs one optimizer; configure_optimizers returned {len(optimizers)}")
    optim_cls = type(optimizers[0])
    accepted = inspect.signature(optim_cls).parameters
    defaults = {k: v for k, v in optimizers[0].defaults.items() if k in accepted}
    options = {"report_file": os.path.join(trainer.default_root_dir, REPORT_FILE), **options}
    os.makedirs(trainer.default_root_dir, exist_ok=True)
    # Detached while the search copies the module (a copy must not copy the Trainer); self.log
    # in training_step then does nothing.
    held, module._trainer = module._trainer, None
    try:
        status, _, found = auto_accelerate(
            _TrainingStep(module), lambda params, **_: optim_cls(params, **defaults), loader.dataset,
            lambda batch, loss: loss, dataloader_args={"batch_size": loader.batch_size * world_size,
                                                       "collate_fn": loader.collate_fn, "drop_last": True},
            excluded=sorted({*SEARCH_EXCLUDED, *options.pop("excluded", ())}), search_only=True, **options)
    finally:
        module._trainer = held
    if not status:
        raise RuntimeError(f"the strategy search found no strategy that runs; see {options['report_file']}")
    return found


class _AtorchPrecision(Precision):
    """fp32 on Lightning's side (mixed precision is the strategy's method); clipping by the true
    global norm where torch's clip_grad_norm_ would measure sharded pieces wrong; the step's
    gradients divided by its token count before anything reads them."""

    def __init__(self):
        super().__init__()
        self.atorch_strategy: "AtorchStrategy | None" = None

    def _after_closure(self, model, optimizer) -> None:
        if self.atorch_strategy is not None:
            self.atorch_strategy.finish_step()
        super()._after_closure(model, optimizer)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        if self.atorch_strategy is not None:  # manual optimization clips before optimizer.step()
            self.atorch_strategy.finish_step()
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        owner = self.atorch_strategy
        if owner is None or owner.strategy is None or not needs_atorch_norm(owner.strategy):
            return super().clip_grad_by_norm(optimizer, clip_val)
        clip_grad_norm(owner.model, float(clip_val))


class AtorchStrategy(DDPStrategy):
    """``L.Trainer(strategy=AtorchStrategy(strategy))`` trains under an atorch strategy.

    ``strategy``: a list of method names and ``(name, config)`` pairs, a strategy file path, JSON
    text or a :class:`atorch.auto.Strategy`; ``None`` searches for the fastest strategy that fits
    ``memory_budget`` within ``time_limit`` seconds (``search_args``: more search options,
    docs/search.md) on the training data ``fit`` gets, its report in the Trainer's
    ``default_root_dir``. The strategy applied is ``.strategy`` after ``fit``, and is saved to
    ``save_strategy_to`` when given. Other keyword arguments go to Lightning's
    ``DDPStrategy`` (process group backend, timeout, cluster environment). Mixed precision comes
    from the strategy (``("amp_native", "bf16")``), so keep the Trainer's ``precision`` at
    ``"32-true"``. ``configure_optimizers`` must return one optimizer (with schedulers if any).
    Strategies that replace the step (pipelines, DeepSpeed engines, fp16 loss scaling) raise
    :class:`atorch.integrations.common.TrainerStrategyError`.

    ``loss_normalization``: ``"tokens"`` (default) weights the loss ``training_step`` returns by
    the label tokens it counts when it is a transformers model's own ``out.loss`` or is marked
    with ``atorch.with_count(loss, count)``, so each optimizer step's gradient is that of the
    global batch's token mean over every rank and accumulated batch; ``"per_part_mean"`` keeps
    Lightning's mean of the ranks' and batches' means. What ``self.log`` logs is unchanged.
    """

    strategy_name = "atorch"

    def __init__(self, strategy: Any = None, save_strategy_to: str | None = None, *, memory_budget: Any = None,
                 time_limit: float | None = None, search_args: dict | None = None, loss_normalization: str = "tokens",
                 **kwargs: Any):
        from atorch.loss.contract import MODES

        if loss_normalization not in MODES:
            raise TrainerStrategyError(f"loss_normalization={loss_normalization!r} is not one of {list(MODES)}")
        if not hasattr(Precision, "_after_closure"):  # where the step's gradients are divided by its count
            from atorch.errors import NotSupportedError

            raise NotSupportedError("this Lightning has no Precision._after_closure, which AtorchStrategy replaces: "
                                    "pip install 'atorch[lightning]'")
        precision = _AtorchPrecision()
        super().__init__(precision_plugin=precision, **kwargs)
        precision.atorch_strategy = self
        self._requested = None if strategy is None else check_strategy(strategy, "AtorchStrategy")
        self._search_options = {**({} if memory_budget is None else {"memory_budget": memory_budget}),
                                **({} if time_limit is None else {"time_limit": time_limit}), **(search_args or {})}
        self._save_strategy_to = save_strategy_to
        self.strategy = None
        self._result = None
        self._lr_scheduler_configs: list = []
        self._loss_normalization = loss_normalization
        self._weights = None  # common.TokenWeights, once the strategy is applied
        self._pending: tuple | None = None  # (count or None, batch) of training_step's loss

    def configure_ddp(self) -> None:
        """Apply the strategy instead of wrapping the module in Lightning's DDP."""
        flag = self.lightning_module.trainer._accelerator_connector._precision_flag
        if flag not in (None, "32-true", "32", 32):
            raise TrainerStrategyError(
                f"AtorchStrategy takes mixed precision from the strategy, not from the Trainer (precision={flag!r}): "
                "leave precision at '32-true' and add ('amp_native', 'bf16') to the strategy")
        module = self.lightning_module
        if self._requested is None:
            self._requested = search_from_lightning(module, self.world_size, self._search_options)
        schedulers: dict = {}

        def optim_func(params, **_):
            # configure_optimizers runs once the strategy holds the parameters (sharded, split).
            optimizers, schedulers["configs"] = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1:
                raise TrainerStrategyError(f"AtorchStrategy runs one optimizer; configure_optimizers returned "
                                           f"{len(optimizers)}")
            return optimizers[0]

        if self._save_strategy_to:
            os.makedirs(os.path.dirname(os.path.abspath(self._save_strategy_to)), exist_ok=True)
        status, result, applied = auto_accelerate(
            self.model, optim_func, loss_func=_loss_of, load_strategy=self._requested,
            find_unused_parameters=bool(self._ddp_kwargs.get("find_unused_parameters", False)),
            save_strategy_to_file=self._save_strategy_to)
        check_applied(result.args, user_loss_func(result.loss_func) is not _loss_of, "AtorchStrategy")
        self.model, self._result, self.strategy = result.model, result, applied
        self._lr_scheduler_configs = schedulers.get("configs", [])
        self._weights = token_weights(
            module, self._loss_normalization,
            "Return the model's own out.loss from training_step, or atorch.with_count(loss, count) for a custom loss")

    # Loss normalization (common.TokenWeights): training_step's loss weighted by its count.

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if self._weights is not None and self.lightning_module.automatic_optimization:
            loss = out.get("loss") if isinstance(out, Mapping) else out
            batch = args[0] if args else kwargs.get("batch")
            self._pending = (self._weights.count_of(loss), batch)
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        weights, pending, self._pending = self._weights, self._pending, None
        if weights is not None and weights.mode == "tokens":
            count = weights.count_of(closure_loss)  # manual optimization: the loss itself
            if count is not None:
                closure_loss = weights.weigh(closure_loss, count)
            elif pending is not None and pending[0] is not None:
                # Lightning divided training_step's loss by the accumulated batches; the count divides instead.
                accumulation = self.lightning_module.trainer.accumulate_grad_batches
                closure_loss = weights.weigh(closure_loss, pending[0], accumulation)
            else:
                weights.unweighted(pending[1] if pending is not None else None)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def finish_step(self) -> None:
        """The step's gradients divided by its global token count (once, before they are read)."""
        if self._weights is not None:
            self._weights.finish(self.model.parameters())

    def setup_optimizers(self, trainer) -> None:
        # Built by configure_ddp, over the parameters as the strategy holds them.
        self.optimizers, self.lr_scheduler_configs = [self._result.optim], self._lr_scheduler_configs

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks of one tensor-parallel group read the same batches."""
        return data_parallel_sampler_kwargs() or super().distributed_sampler_kwargs

    # Checkpoints: atorch.checkpoint on every rank, whatever holds the parameters.

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model and optimizer must be as the strategy holds them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored it, resharded for this strategy

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer) -> dict[str, torch.Tensor]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        rest = {key: _plain(value) for key, value in checkpoint.items() if key not in _MODEL_KEYS}
        atorch.checkpoint.save(filepath, self.model, self._result.optim, extra=rest)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        return atorch.checkpoint.load(checkpoint_path, self.model, self._result.optim)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # loaded by load_checkpoint
