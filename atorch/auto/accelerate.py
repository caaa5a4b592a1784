"""auto_accelerate: the front door."""

import collections
from collections.abc import Callable
from typing import Any

import torch

from atorch.auto import loop
from atorch.auto.context import ModelContext, check_input_format, move_to_device
from atorch.auto.environment import DeviceContext
from atorch.auto.fit_dims import FitJob
from atorch.auto.inputs import check_arguments
from atorch.auto.order import applied_order
from atorch.auto.plan import log_notes, plan_strategy, resolve_strategy
from atorch.auto.registry import Stage, absorbed_methods, get_method
from atorch.auto.strategy import Strategy, parse_strategy
from atorch.distributed import env
from atorch.errors import AtorchConfigError, MethodConfigError
from atorch.loss.contract import counted_loss
from atorch.loss.step import StepTokens
from atorch.utils.log import logger


class AutoAccelerateResult(collections.namedtuple(
        "AutoAccelerateResult", ["model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args"])):
    """What the training loop needs; ``backward(loss)`` and ``step()`` run one step the way the
    strategy needs it (pipeline, DeepSpeed...), so the loop is the same under every strategy.

    ``notes`` (not one of the seven fields, so ``model, optim, ... = result`` still unpacks):
    each change the planner made to the requested strategy, with its reason: a method dropped
    (e.g. ``fsdp`` with one data-parallel rank), a dim chosen for a method that was named without
    it (``tensor_parallel`` -> ``tensor=2``), the data dim rescaled. The ones that make the job
    run otherwise than written were also logged at WARNING.
    """

    # No __slots__: ``notes`` and ``loss_tokens`` live in the instance's __dict__, beside the tuple.
    notes: tuple[str, ...] = ()
    loss_tokens: StepTokens | None = None  # each part's weighting (atorch/loss/step.py); None: the per-part mean

    def _replace(self, **fields):
        """namedtuple's ``_replace``, keeping ``notes`` and ``loss_tokens`` (not tuple fields)."""
        out = super()._replace(**fields)
        out.notes, out.loss_tokens = self.notes, self.loss_tokens
        return out

    def backward(self, loss) -> None:
        """``loss.backward()``, or what replaces it under this strategy (atorch/auto/loop.py).

        With ``gradient_accumulation_steps=n`` the loss is divided by ``n`` and gradients are
        reduced over the data-parallel ranks only on every ``n``-th call.
        """
        loop.backward(self.args, self.optim, loss, self.model, self.loss_tokens)

    def step(self) -> None:
        """``optim.step()`` then ``optim.zero_grad()``, or what replaces them under this strategy;
        under gradient accumulation, only once the ``n``-th backward has run."""
        loop.step(self.args, self.optim, self.loss_tokens)

    @property
    def last_step(self):
        """The last optimizer step's :class:`~atorch.loss.StepLoss` (the global batch's mean loss
        over its counted tokens, the tokens, the samples), the same on every rank; None before the
        first step completes. Read it after the ``backward`` that completes a step."""
        return self.loss_tokens.last if self.loss_tokens is not None else None

    @property
    def sync_gradients(self) -> bool:
        """Whether the gradients are complete (the last backward ended an accumulation): clip
        or log gradient norms only then."""
        return loop.sync_gradients(self.args)

_KNOWN_KWARGS = {
    "verbose", "find_unused_parameters", "sampler_seed", "ignore_dryrun_on_load_strategy",
    # the search (docs/search.md)
    "memory_budget", "time_limit", "report_file", "max_dryruns", "dryrun_warmup_steps", "dryrun_steps",
    "dryrun_timeout", "planned_steps", "use_search_cache", "search_cache_dir", "search_only",
    "gradient_accumulation_steps", "loss_normalization",
}


def auto_accelerate(
    model: torch.nn.Module,
    optim_func: Callable | None = None,
    dataset: Any = None,
    loss_func: Callable | None = None,
    prepare_input: Callable | None = None,
    model_input_format: str | None = None,
    optim_args: dict | None = None,
    optim_param_func: Callable | None = None,
    dataloader_args: dict | None = None,
    distributed_sampler_cls: type | None = None,
    excluded: list[str] | None = None,
    included: list[str] | None = None,
    load_strategy: Any = None,
    lr_scheduler_cls: type | None = None,
    lr_scheduler_args: dict | None = None,
    finetune_strategy: bool = False,
    save_strategy_to_file: str | None = None,
    **kwargs: Any,
) -> tuple[bool, AutoAccelerateResult | None, Strategy | None]:
    """Apply a strategy to a plain training job and return what the training loop needs.

    Returns ``(status, result, best_strategy)``: ``result`` is an :class:`AutoAccelerateResult`
    ``(model, optim, dataloader, loss_func, prepare_input, lr_scheduler, args)`` with ``notes``
    (each change the planner made, and why) and ``last_step``; ``best_strategy`` is the strategy
    as applied. A method named without the parallel dim it needs gets the largest size the world
    and the model allow (logged at WARNING), or a :class:`~atorch.errors.WorldSizeError` names the fix.

    - ``optim_func(params, **optim_args)``; ``optim_param_func(model)`` returns parameter groups.
    - ``dataloader_args["batch_size"]`` is the global batch; each data-parallel rank gets its share.
    - ``loss_func(input, output)`` returns the loss (or a sequence whose first item is the loss);
      ``prepare_input(data, device)`` defaults to moving tensors to this rank's device.
    - ``load_strategy``: a :class:`Strategy`, names and ``(name, config)`` pairs, JSON text or a
      JSON/YAML file; without it the best strategy is searched for (docs/search.md lists the
      search's kwargs: ``memory_budget``, ``time_limit``, ``max_dryruns``, ``report_file``, ...).
      ``finetune_strategy=True`` re-tunes a loaded strategy; ``ignore_dryrun_on_load_strategy=False``
      dry-runs it first; ``search_only`` returns ``(status, None, strategy)`` and leaves ``model`` as is.
    - ``gradient_accumulation_steps`` (default 1): ``result.backward``/``result.step`` accumulate
      that many micro-batches per optimizer step; ``loss_normalization``: ``"tokens"`` (default)
      weighs every part of a split batch by what its loss counts, ``"per_part_mean"`` each part as
      one (docs/loss_normalization.md). Also ``verbose``, ``find_unused_parameters``, ``sampler_seed``. Example::

        status, result, strategy = atorch.auto_accelerate(
            model, torch.optim.AdamW, dataset, loss_func=lambda batch, out: out.loss,
            optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8, "shuffle": True},
            model_input_format="unpack_dict", load_strategy=["parallel_mode", ("amp_native", {"dtype": "bf16"})])
        for batch in result.dataloader:
            batch = result.prepare_input(batch, atorch.device())
            result.backward(result.loss_func(batch, result.model(**batch)))  # loss.backward(), or what the strategy needs
            result.step()  # optim.step() and optim.zero_grad(), likewise
    """
    accumulation = _checked(model, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args,
                            optim_param_func, dataloader_args, distributed_sampler_cls, excluded, included,
                            lr_scheduler_cls, lr_scheduler_args, finetune_strategy, save_strategy_to_file, kwargs)
    device_ctx = DeviceContext.detect()
    job = _job(model, optim_func, optim_args, optim_param_func, dataset, loss_func, prepare_input, model_input_format,
               dataloader_args, distributed_sampler_cls, lr_scheduler_cls, lr_scheduler_args, kwargs)

    def make_context(module: torch.nn.Module) -> ModelContext:
        return ModelContext(model=module, device_ctx=device_ctx, **job)

    batch_size = job["dataloader_args"].get("batch_size")
    fit_job = FitJob(model, batch_size if isinstance(batch_size, int) else None, model_input_format)
    found = _requested(model, device_ctx, make_context, fit_job, load_strategy, finetune_strategy, excluded,
                       included, optim_func, dataset, loss_func, kwargs)
    if found is None:
        return False, None, None
    requested, loaded_notes, searched = found
    chosen = (None, None) if searched else (excluded, included)  # a search has honoured them already
    strategy, notes = plan_strategy(requested, device_ctx, *chosen, job=fit_job)
    strategy = resolve_strategy(model, strategy, notes)
    log_notes(notes)
    check_included(model, strategy, list(included or []), device_ctx, fit_job, notes)
    if kwargs.get("search_only"):
        return True, None, strategy
    result = _applied(make_context(model), strategy, accumulation, bool(kwargs.get("verbose", False)),
                      save_strategy_to_file)
    result.notes = tuple(loaded_notes + notes)
    return True, result, strategy


def check_included(model, strategy: Strategy, included: list[str], device_ctx, fit_job, planned_notes=()) -> None:
    """Every method named in ``included`` is in the strategy that runs, or the call is refused
    with why: named means applied or refused, never dropped in silence (a method that cannot run
    on this job, changes nothing on this model, or conflicts with the pick)."""
    missing = [name for name in included if name not in strategy]
    if not missing:
        return
    reasons = []
    for name in missing:
        dropped = next((n for n in planned_notes if n.startswith(f"{name}:") and "dropped" in n), None)
        if dropped is not None:  # planning this job dropped it, with why (its config as given)
            reasons.append(dropped)
            continue
        notes: list = []
        try:
            planned, notes = plan_strategy(strategy.with_method(name), device_ctx, job=fit_job)
            resolve_strategy(model, planned, notes)
        except AtorchConfigError as error:
            notes.append(f"{name}: {error}")
        reasons.append(next((n for n in notes if n.startswith(f"{name}:")),
                            f"{name}: no candidate with it runs here (see the search report)"))
    raise MethodConfigError(f"included {missing} cannot be applied to this job: {'; '.join(reasons)}; remove "
                            f"{'them' if len(missing) > 1 else 'it'} from `included`, or change what the reason names")


def _checked(model, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args, optim_param_func,
             dataloader_args, distributed_sampler_cls, excluded, included, lr_scheduler_cls, lr_scheduler_args,
             finetune_strategy, save_strategy_to_file, kwargs) -> int:
    """Every argument checked before anything is built (a clear error naming the fix); returns the
    micro-batches a step accumulates."""
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        raise TypeError(f"auto_accelerate got unknown keyword arguments {unknown}; known: {sorted(_KNOWN_KWARGS)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    accumulation = loop.accumulation_steps(kwargs.get("gradient_accumulation_steps", 1))
    check_arguments(model, optim_func, dataset, loss_func, prepare_input, optim_args, optim_param_func, dataloader_args,
                    distributed_sampler_cls, excluded, included, lr_scheduler_cls, lr_scheduler_args,
                    finetune_strategy, save_strategy_to_file, kwargs)
    check_input_format(model_input_format)
    return accumulation


def _job(model, optim_func, optim_args, optim_param_func, dataset, loss_func, prepare_input, model_input_format,
         dataloader_args, distributed_sampler_cls, lr_scheduler_cls, lr_scheduler_args, kwargs) -> dict:
    """The training job every context is built from (ModelContext's fields but the model's)."""
    return dict(
        optim_func=optim_func,
        optim_args=dict(optim_args or {}),
        optim_param_func=optim_param_func,
        dataset=dataset,
        loss_func=counted_loss(model, loss_func, kwargs.get("loss_normalization", "tokens")),
        prepare_input=prepare_input or move_to_device,
        model_input_format=model_input_format,
        dataloader_args=dict(dataloader_args or {}),
        distributed_sampler_cls=distributed_sampler_cls,
        sampler_seed=int(kwargs.get("sampler_seed", 0)),
        lr_scheduler_cls=lr_scheduler_cls,
        lr_scheduler_args=dict(lr_scheduler_args or {}),
        find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
    )


def _requested(model, device_ctx, make_context, fit_job, load_strategy, finetune_strategy, excluded, included,
               optim_func, dataset, loss_func, kwargs) -> tuple[Strategy, list, bool] | None:
    """The strategy asked for: loaded as given, or searched (around a loaded one when it is to be
    tuned or dry-run first). ``(strategy, notes of the loaded one, searched)``; None when the
    search found nothing that runs."""
    dry_run_loaded = not kwargs.get("ignore_dryrun_on_load_strategy", True)
    if not (load_strategy is None or finetune_strategy or dry_run_loaded):
        return parse_strategy(load_strategy), [], False
    from atorch.auto.search.run import check_searchable, run_search

    check_searchable(optim_func, dataset, loss_func)
    base, loaded_notes = None, []
    if load_strategy is not None:  # its drops and fitted dims are the user's to read, not the search's
        base, loaded_notes = plan_strategy(parse_strategy(load_strategy), device_ctx, job=fit_job)
        base = resolve_strategy(model, base, loaded_notes)
        log_notes(loaded_notes)
    requested = run_search(model, device_ctx, make_context, apply_strategy, kwargs, excluded, included, base,
                           only_base=dry_run_loaded and not finetune_strategy and base is not None)
    return None if requested is None else (requested, loaded_notes, True)


def _applied(ctx: ModelContext, strategy: Strategy, accumulation: int, verbose: bool,
             save_strategy_to_file: str | None) -> AutoAccelerateResult:
    """``strategy`` applied to the job's context: the result the training loop uses."""
    apply_strategy(ctx, strategy)
    if verbose:
        logger.info("applied %s", strategy)
    if save_strategy_to_file is not None and env.rank() == 0:
        strategy.save(save_strategy_to_file)
    loop.setup_accumulation(ctx.args, ctx.model, accumulation)
    result = AutoAccelerateResult(
        ctx.model, ctx.optim, ctx.dataloader, ctx.loss_func, ctx.prepare_input, ctx.lr_scheduler, ctx.args
    )
    result.loss_tokens = ctx.loss_tokens
    return result


def apply_strategy(ctx: ModelContext, strategy: Strategy, stage_barrier: Callable[[bool], bool] | None = None) -> None:
    """Run every method's stage hooks in stage order, and within a stage in the registry's
    applied order (atorch/auto/order.py), whatever order the strategy lists them in.

    ``stage_barrier(ok)`` (used by dry runs) is called after each stage on every rank and returns
    whether every rank succeeded, so a failure on one rank stops all of them at the same stage
    boundary instead of leaving the others waiting in the next stage's collectives.
    """
    ctx.strategy = strategy
    absorbed = absorbed_methods(strategy)
    position = {name: index for index, name in enumerate(applied_order(strategy.opt_names))}
    hooks = sorted(
        ((stage, position[name], name, hook, config)
         for name, config in strategy.items()
         for stage, hook in get_method(name).hooks.items()
         if not (name in absorbed and stage in get_method(name).skipped_when_absorbed)),
        key=lambda item: (item[0], item[1]),
    )
    if not any(p.is_meta for p in ctx.model.parameters()):
        ctx.model.to(ctx.device)
    for stage in Stage:
        error = None
        try:
            if stage == Stage.OPTIMIZER:
                ctx.build_optimizer()
            if stage == Stage.DATA and ctx.dataset is not None:
                ctx.build_dataloader()
            for hook_stage, _, name, hook, config in hooks:
                if hook_stage == stage:
                    hook(ctx, config)
            if stage == Stage.OPTIMIZER:
                ctx.build_lr_scheduler()
        except Exception as exc:
            if stage_barrier is None:
                raise
            error = exc
        if stage_barrier is not None and not stage_barrier(error is None):
            if error is not None:
                raise error
            raise RuntimeError(f"another rank failed while applying stage {stage.name}")
    ctx.loss_tokens = StepTokens(ctx.topology.data_parallel_group, ctx.topology.data_parallel_size)
