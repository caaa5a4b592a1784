"""AtorchTrainer: a ``transformers.Trainer`` whose model, optimizer and checkpoints are atorch's.

The Trainer keeps its loop, evaluation, logging, LR schedule, gradient accumulation and clipping;
atorch applies the strategy to the model and builds the optimizer over it (``auto_accelerate``),
shards the data over the data-parallel ranks, clips by the true global norm and checkpoints
through ``atorch.checkpoint``, so a run saved under one strategy resumes under another. The model's
own loss is weighted by the label tokens it counts, so each optimizer step trains on the global
batch's token mean over every rank and micro-batch (docs/integrations.md, "Loss normalization").

Example (``torchrun --nproc_per_node=2 examples/hf_trainer.py``)::

    trainer = AtorchTrainer(model=model, args=TrainingArguments("out", use_cpu=True),
                            train_dataset=dataset, strategy=["fsdp", "checkpoint"])
    trainer.train()            # out/atorch_strategy.json holds the strategy as applied
"""

import os
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

import atorch.checkpoint
from atorch import parallel_state
from atorch.auto import auto_accelerate, clip_grad_norm
from atorch.auto import grad_norm as global_grad_norm
from atorch.auto.context import unwrap
from atorch.errors import CheckpointError, NotSupportedError
from atorch.integrations.common import (
    SEARCH_EXCLUDED,
    TrainerStrategyError,
    check_applied,
    check_strategy,
    needs_atorch_norm,
)
from atorch.loss.contract import user_loss_func
from atorch.loss.counting import padded, rule_for
from atorch.utils.log import logger
from atorch.utils.optim import unwrap_optimizer

STRATEGY_FILE = "atorch_strategy.json"
REPORT_FILE = "atorch_search_report.json"
# Inside each checkpoint-N folder of the Trainer.
CHECKPOINT_DIR = "atorch"


class _Held(torch.nn.Module):
    """A model atorch sharded in place (fsdp, zero2, tensor parallel without DDP), held in a
    module of its own: the Trainer then sees a wrapped model and does not wrap it in DDP again."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _get_name(self):  # the Trainer reads the model's class name (label smoothing of causal LMs)
        return self.module._get_name()


# The Trainer methods AtorchTrainer replaces: a Trainer without one of them would silently skip
# what the strategy needs there (global-norm clipping, atorch checkpoints, no second DDP wrap).
_HOOKS = ("_wrap_model", "_clip_grad_norm", "_get_grad_norm", "get_tp_size", "create_scheduler",
          "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_load_from_checkpoint",
          "_load_best_model", "_set_signature_columns_if_needed", "_prepare_inputs")


def _check_transformers() -> None:
    missing = [name for name in _HOOKS if not hasattr(Trainer, name)]
    if missing:
        import transformers

        raise NotSupportedError(f"transformers {transformers.__version__} has no Trainer.{', '.join(missing)}, which "
                                "AtorchTrainer replaces: pip install 'atorch[transformers]' (transformers>=5)")


def _loss_of(batch: Any, output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output[0]


class AtorchTrainer(Trainer):
    """``transformers.Trainer`` under an atorch strategy.

    ``strategy``: a list of method names and ``(name, config)`` pairs, a strategy file path, JSON
    text or a :class:`atorch.auto.Strategy`; ``None`` searches for the fastest strategy that fits
    ``memory_budget`` within ``time_limit`` seconds (``search_args``: more search options,
    docs/search.md). The strategy as applied is saved to ``<output_dir>/atorch_strategy.json``
    and, after a search, its report to ``<output_dir>/atorch_search_report.json``; it is also
    ``trainer.strategy``.

    The strategy is applied when the trainer is built. The Trainer's optimizer arguments
    (``optim``, ``learning_rate``, ``weight_decay``, ...) make the optimizer, built by atorch over
    the sharded model. Mixed precision comes from the strategy (``("amp_native", "bf16")``), not
    from ``TrainingArguments(bf16=True)``. Strategies that replace the training step (pipelines,
    DeepSpeed engines, fp16 loss scaling) raise :class:`TrainerStrategyError`.

    Loss normalization: on batches whose ``labels`` hold -100, each optimizer step's gradient is
    that of the global batch's mean over its label tokens (every data rank, every accumulation
    micro-batch). The Trainer counts the step's tokens (``num_items_in_batch``, summed over the ranks
    with ``average_tokens_across_devices=True``, its default); AtorchTrainer weights the model's
    own loss on each micro-batch by the tokens it counts over that count, whether or not the
    model's head reads ``num_items_in_batch``. ``average_tokens_across_devices=False`` asks for
    each rank's own token mean instead (ranks weigh the same); a ``compute_loss_func`` or label
    smoothing keeps the Trainer's own normalization.
    """

    def __init__(self, model=None, args=None, *, strategy: Any = None, memory_budget: Any = None,
                 time_limit: float | None = None, search_args: dict | None = None, **kwargs: Any):
        _check_transformers()
        if kwargs.get("model_init") is not None:
            raise TrainerStrategyError("AtorchTrainer applies its strategy to one model: pass model=, not model_init=")
        optimizers = kwargs.get("optimizers") or (None, None)
        if optimizers[0] is not None or optimizers[1] is not None:
            raise TrainerStrategyError(
                "AtorchTrainer builds the optimizer over the model as the strategy holds it (sharded parameters "
                "exist only after the strategy is applied): choose it with TrainingArguments(optim=...) or "
                "optimizer_cls_and_kwargs=(cls, kwargs), not optimizers=")
        super().__init__(model=model, args=args, **kwargs)
        self._refuse_trainer_options()
        self._weigh_tokens_of_model()
        self.strategy = None
        self._apply(strategy, memory_budget, time_limit, dict(search_args or {}))

    def _refuse_trainer_options(self) -> None:
        args = self.args
        if args.fp16 or args.bf16:
            raise TrainerStrategyError(
                "AtorchTrainer takes mixed precision from the strategy: drop fp16/bf16 from TrainingArguments and "
                "add ('amp_native', 'bf16') to the strategy")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or args.fsdp or args.deepspeed:
            raise TrainerStrategyError(
                "AtorchTrainer shards the model itself: drop fsdp/deepspeed from TrainingArguments and name "
                "'fsdp' or 'zero2' in the strategy")
        if args.auto_find_batch_size:
            raise TrainerStrategyError("AtorchTrainer applies the strategy once: auto_find_batch_size is not supported")

    def _weigh_tokens_of_model(self) -> None:
        """Whether compute_loss weights the model's own loss by its label tokens (see the class
        docstring). The Trainer then counts each step's tokens with the same rule, and leaves the
        division by the accumulation steps to compute_loss, for every model atorch can read: also
        heads that take ``**kwargs`` but drop ``num_items_in_batch`` (BERT's masked LM, T5), which
        the Trainer alone would train on a loss inflated by the accumulation steps and the ranks."""
        self._label_rule = rule_for(self.model)
        self._weighs_tokens = (self._label_rule is not None and self.compute_loss_func is None
                               and self.label_smoother is None and self.args.n_gpu <= 1
                               and hasattr(self, "_loss_shifts_labels"))
        self._warned_unweighted = False
        self._step_items: torch.Tensor | None = None  # the running step's global count (compute_loss)
        self._empty_steps = 0
        if self._weighs_tokens:
            self.model_accepts_loss_kwargs = True  # the Trainer counts the step's tokens, compute_loss divides
            self._loss_shifts_labels = self._label_rule.shift  # counted as compute_loss counts each micro-batch

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The model's own loss on this micro-batch (a mean over its label tokens), times its
        tokens over the step's (``num_items_in_batch``), times the data-parallel ranks (their
        gradient reduction averages): the step's gradient is the global batch's token mean."""
        count = self._label_rule.count(inputs) if self._weighs_tokens and num_items_in_batch is not None else None
        if count is None:
            self._warn_unweighted(inputs)
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # Without num_items_in_batch: the model's own mean over this micro-batch, not scaled by the Trainer.
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        if self.args.average_tokens_across_devices:  # num_items_in_batch counts over every data rank
            count = count * (self.accelerator.num_processes // self.get_tp_size())
        else:
            self._warn_unweighted(inputs)
        total = torch.as_tensor(num_items_in_batch, device=loss.device, dtype=torch.float64)
        weight = count.to(loss.device, torch.float64) / total.clamp(min=1)
        # A micro-batch with no label token adds nothing (its mean is 0/0).
        loss = torch.where(count > 0, loss * weight.to(loss.dtype), torch.zeros((), dtype=loss.dtype,
                                                                                device=loss.device))
        if model.training:
            self._step_items = total
        return (loss, outputs) if return_outputs else loss

    def _drop_empty_step(self) -> None:
        """A step whose global batch counts no label token (every label -100): its gradients are
        dropped, so the optimizer leaves the weights as they are (a zero gradient would still move
        them through AdamW's momentum and weight decay); the LR schedule still advances."""
        total, self._step_items = self._step_items, None
        if total is None or not self.args.average_tokens_across_devices or float(total) > 0:
            return
        for param in self._result.model.parameters():
            param.grad = None
        self._empty_steps += 1
        logger.warning("AtorchTrainer skipped an optimizer step: its global batch has no counted label (every label "
                       "is -100); %d such step(s) so far", self._empty_steps)

    def _warn_unweighted(self, inputs) -> None:
        if self._warned_unweighted or not self.model.training or "labels" not in inputs:
            return
        self._warned_unweighted = True  # checked once: a check reads the labels back from the device
        if not padded(inputs):
            return
        if self._weighs_tokens:
            why = ("average_tokens_across_devices=False: each data rank's share of the global batch weighs the same, "
                   "whatever its label tokens; leave it at True (the default) for the global batch's token mean")
        elif self._label_rule is None:
            why = ("AtorchTrainer cannot tell what this model's loss counts (not a transformers model), so it keeps "
                   "the Trainer's own normalization; pass compute_loss_func(outputs, labels, num_items_in_batch) "
                   "returning sum / num_items_in_batch for the global batch's token mean")
        else:
            return  # compute_loss_func or label smoothing: the Trainer normalizes by num_items_in_batch
        logger.warning("AtorchTrainer: the batch is padded (labels -100) and %s (docs/integrations.md, "
                       "\"Loss normalization\")", why)

    def _apply(self, strategy: Any, memory_budget: Any, time_limit: float | None, search_args: dict) -> None:
        args = self.args
        requested = None if strategy is None else check_strategy(strategy, "AtorchTrainer")
        optim_cls, optim_kwargs = (self.optimizer_cls_and_kwargs
                                   or self.get_optimizer_cls_and_kwargs(args, self.model))
        optim_kwargs = dict(optim_kwargs)
        if {"params", "model", "optimizer_dict"} & set(optim_kwargs):
            raise TrainerStrategyError(f"AtorchTrainer cannot build optimizer {args.optim!r}: it needs the model "
                                       "itself, not parameter groups")
        os.makedirs(args.output_dir, exist_ok=True)
        # The columns the model takes, read from its forward before a method (amp) wraps it.
        self._set_signature_columns_if_needed()
        options: dict[str, Any] = {}
        if requested is None:
            options = self._search_options(memory_budget, time_limit, search_args)
        status, result, applied = auto_accelerate(
            self.model, optim_cls, loss_func=_loss_of, optim_args=optim_kwargs, optim_param_func=self._param_groups,
            model_input_format="unpack_dict", load_strategy=requested,
            save_strategy_to_file=os.path.join(args.output_dir, STRATEGY_FILE), **options)
        if not status:
            raise RuntimeError(f"the strategy search found no strategy that runs; see {options['report_file']}")
        check_applied(result.args, user_loss_func(result.loss_func) is not _loss_of, "AtorchTrainer")
        self.strategy, self._result = applied, result
        inner = unwrap(result.model)
        self.model = inner
        self.model_wrapped = result.model if result.model is not inner else _Held(inner)
        self.optimizer = result.optim
        self._shard_data_over_data_parallel()
        self._keep_optimizer_placement()

    def _search_options(self, memory_budget: Any, time_limit: float | None, search_args: dict) -> dict:
        if self.train_dataset is None:
            raise TrainerStrategyError("strategy=None searches by dry-running the training data: pass train_dataset")
        dataset, collate = self.train_dataset, self.data_collator
        try:
            import datasets

            hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            hf_dataset = False
        if hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        batch = self.args.per_device_train_batch_size * self.args.world_size
        options = dict(dataset=dataset, dataloader_args={"batch_size": batch, "collate_fn": collate, "drop_last": True},
                       excluded=SEARCH_EXCLUDED, report_file=os.path.join(self.args.output_dir, REPORT_FILE))
        if memory_budget is not None:
            options["memory_budget"] = memory_budget
        if time_limit is not None:
            options["time_limit"] = time_limit
        return {**options, **search_args}

    def _param_groups(self, module: torch.nn.Module) -> list[dict]:
        """The Trainer's two groups: weight decay on all but biases and norms."""
        decay = set(self.get_decay_parameter_names(module))
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        return [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]

    def _keep_optimizer_placement(self) -> None:
        """atorch built the optimizer over the parameters where the strategy placed them, so
        Accelerate need not move its state: that round trip (state_dict, load_state_dict) fails on
        a ZeroRedundancyOptimizer (zero1), whose state_dict needs a consolidation first."""
        accelerator = self.accelerator
        prepare_optimizer = accelerator.prepare_optimizer

        def prepare_in_place(optimizer, device_placement=None):
            return prepare_optimizer(optimizer, device_placement=False)

        accelerator.prepare_optimizer = prepare_in_place

    def _shard_data_over_data_parallel(self) -> None:
        """Accelerate shards batches over every process; under tensor parallelism the ranks of one
        tensor group must read the same batch, so shard over the data-parallel ranks instead."""
        if parallel_state.current_topology() is None:  # one process, or no parallel_mode: nothing to change
            return
        size, rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
        accelerator = self.accelerator
        if size == accelerator.num_processes:
            return
        from accelerate.data_loader import prepare_data_loader

        def prepare_over_data_ranks(data_loader, device_placement=None, slice_fn_for_dispatch=None):
            if getattr(data_loader, "_is_accelerate_prepared", False):
                return data_loader
            prepared = prepare_data_loader(
                data_loader, accelerator.device, num_processes=size, process_index=rank,
                split_batches=accelerator.split_batches,
                put_on_device=accelerator.device_placement if device_placement is None else device_placement,
                rng_types=accelerator.rng_types.copy(), dispatch_batches=accelerator.dispatch_batches,
                even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
                use_seedable_sampler=accelerator.use_seedable_sampler,
                data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
                use_stateful_dataloader=accelerator.use_stateful_dataloader)
            accelerator._dataloaders.append(prepared)
            return prepared

        accelerator.prepare_data_loader = prepare_over_data_ranks

    # The Trainer's hooks, each replaced by what the strategy needs.

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.model_wrapped

    def get_tp_size(self) -> int:
        """Ranks that read the same batch (the Trainer divides its token count by this)."""
        return parallel_state.get_tensor_model_parallel_size() if parallel_state.current_topology() else 1

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # On the torch optimizer under atorch's wrappers (AmpOptimizer is not a torch Optimizer).
        inner = unwrap_optimizer(self._result.optim) if optimizer is None else optimizer
        return super().create_scheduler(num_training_steps, inner)

    def _prepare_inputs(self, inputs):
        inputs = super()._prepare_inputs(inputs)
        return self._result.prepare_input(inputs, self.args.device)  # e.g. half casts float inputs

    def _clip_grad_norm(self, model):
        if not needs_atorch_norm(self.strategy):
            return super()._clip_grad_norm(model)
        return clip_grad_norm(self._result.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        # Called after the step's last backward and clipping, before the optimizer step.
        if grad_norm is not None or not needs_atorch_norm(self.strategy):
            grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        else:
            grad_norm = global_grad_norm(self._result.model)
        self._drop_empty_step()
        return grad_norm

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The serial model's weights (``from_pretrained`` loads them), gathered from any strategy;
        call it on every rank, as ``Trainer.save_model``."""
        output_dir = output_dir or self.args.output_dir
        atorch.checkpoint.export(output_dir, self._result.model)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        atorch.checkpoint.save(os.path.join(output_dir, CHECKPOINT_DIR), self._result.model, self._result.optim,
                               self.lr_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Called before the scheduler exists: the model is loaded with the optimizer and scheduler
        # in _load_optimizer_and_scheduler. Only check here, before anything starts.
        if not atorch.checkpoint.exists(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            raise CheckpointError(
                f"{resume_from_checkpoint} holds no atorch checkpoint ({CHECKPOINT_DIR}/): AtorchTrainer resumes "
                "from checkpoints it saved itself, with save_only_model=False")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        atorch.checkpoint.load(os.path.join(checkpoint, CHECKPOINT_DIR), self._result.model, self._result.optim,
                               self.lr_scheduler)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        atorch.checkpoint.load(os.path.join(best, CHECKPOINT_DIR), self._result.model)
