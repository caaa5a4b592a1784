"""A method's row in the registry (:class:`MethodSpec`), the stages it acts in, and the table
the method files register themselves into.

A leaf: the method files (atorch/methods) import it, and it imports none of atorch's own modules
but the config base class, so the registry (atorch/auto/registry.py), which loads the methods,
and the methods never import each other in a circle.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from atorch.auto.config_types import MethodConfig


class Stage(IntEnum):
    """When a method acts; the engine runs stages in this order."""

    # Build the process mesh first: every later stage reads its groups from it.
    TOPOLOGY = 0
    # Swap, convert or split modules while the model is still plain, with no wrapper to see through.
    REWRITE = 10
    # Activation checkpointing wraps the blocks as they will finally run.
    MEMORY = 20
    # Compile before the sharding/replication wrappers, which add hooks of their own (torchtitan's order).
    COMPILE = 30
    # Shard (FSDP, ZeRO) last among model changes: sharding wraps what will finally run.
    WRAP = 40
    # Replicate (DDP) whatever no sharding method has claimed in WRAP.
    REPLICATE = 45
    # The engine builds the optimizer at the start of this stage; methods then wrap it.
    OPTIMIZER = 50
    # The engine builds the dataloader at the start of this stage.
    DATA = 60
    # Loss scaling and other hooks of the running loop.
    RUNTIME = 70


Hook = Callable[[Any, MethodConfig], None]

# A relation to other methods: their names, names mapped to why (shown in errors and in
# docs/methods/compatibility.md), or a function of this method's config returning either (when
# the relation depends on the backend the config picks, e.g. zero2 absorbs amp_native only on FSDP2).
Relation = tuple[str, ...] | Mapping[str, str] | Callable[[MethodConfig], "tuple[str, ...] | Mapping[str, str]"]


@dataclass(frozen=True)
class LayoutJob:
    """What a layout method's eligibility check reads about the job, besides the model."""

    # The layout's parallel dims and their sizes (the data dim included).
    dims: Mapping[str, int]
    # Samples each data-parallel rank gets per step; None when unknown (planning without data).
    batch_per_data_rank: int | None = None
    model_input_format: str | None = None
    # The batch one data-parallel rank gets at its first step (the dataset's first samples,
    # collated), built when called; None when unknown. A pipeline traces the model with it.
    first_batch: Callable[[], Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class MethodSpec:
    """A method's row in the registry.

    ``unsupported(device_ctx, config)`` returns why this device cannot run the method (or
    ``None``); ``resolve(model, config)`` runs before anything is applied: it raises a user error
    for a config that cannot work on this model, and returns the config with the choices it
    made from the model filled in (so the returned strategy says exactly what ran).
    """

    name: str
    config_cls: type[MethodConfig]
    hooks: Mapping[Stage, Hook]
    description: str
    distributed_only: bool = False
    # Drop this method when any of these is in the strategy (e.g. ``half`` over ``amp_native``).
    overridden_by: tuple[str, ...] = ()
    # Refused at plan time together with this method (see ``Relation``; give the reason).
    conflicts: Relation = ()
    requires: Relation = ()
    # Within every stage they share, this method's hooks run after / before those of these
    # methods when both are in the strategy; with stages, this is the whole applied order.
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    # Parallel dims this method puts to work (the data dims are always used by the dataloader).
    uses_dims: tuple[str, ...] = ()
    # Dropped (with a note) unless the data-parallel size (data x zero dims) is larger than 1.
    needs_data_parallel: bool = False
    # Dropped (with a note) unless each of these parallel dims is larger than 1.
    needs_dims: tuple[str, ...] = ()
    # Methods whose work this one takes over when both are present (fsdp applies amp_native's
    # dtype as FSDP mixed precision); the absorbed method's ``skipped_when_absorbed`` stages do
    # not run, and the absorbing method reads its config from ``ctx.strategy``.
    absorbs: Relation = ()
    skipped_when_absorbed: tuple[Stage, ...] = ()
    # What the cost model's activation probe applies to its copy in place of those stages: how
    # the absorbing method does this one's work (amp_native under fsdp: the whole model computes
    # in amp's dtype, as FSDP's mixed precision does, not under autocast). ``(ctx, config)``.
    absorbed_probe: Callable[[Any, MethodConfig], None] | None = None
    unsupported: Callable[[Any, MethodConfig], str | None] | None = None
    # A method that lays out the process mesh itself (mixed_parallel): ``(config, world_size,
    # dims) -> (config, dims)`` at plan time, so parallel_mode builds the job's one Topology.
    lay_out_dims: Callable[[MethodConfig, int, list], tuple[MethodConfig, list]] | None = None
    resolve: Callable[[Any, MethodConfig], MethodConfig] | None = None
    # ``changes_nothing(model, config)``: why the method would leave this model as it is (then it
    # is dropped before anything runs, with that reason logged), or None.
    changes_nothing: Callable[[Any, MethodConfig], str | None] | None = None
    # ``idle_on_layout(model, config, dims)``: why the method would change nothing on this model
    # with these parallel_mode dims (expert_parallel where the data ranks and the experts share no
    # divisor), or None; dropped as ``changes_nothing`` is.
    idle_on_layout: Callable[[Any, MethodConfig, dict[str, int]], str | None] | None = None
    # ``leaves_whole(model, config)``: what of ``model`` the method runs on but leaves undone (a
    # part it does not split), or None; a WARNING, kept in the result's notes.
    leaves_whole: Callable[[Any, MethodConfig], str | None] | None = None
    # Configs the search tries for this method; empty: the search leaves it out unless the user
    # puts it in `included` (then its default config is tried).
    search_space: tuple[dict, ...] = field(default_factory=tuple)
    # ``(model) -> bool``: whether the search offers the method for ``model`` at all (None: for
    # every model). A method for some models only (expert_parallel: models with routed experts)
    # is then no choice for the others, and their searches are as they were without it.
    applies_to: Callable[[Any], bool] | None = None
    # The search does not cross this method with every candidate: it changes how the pick runs,
    # not what a rank holds (torch.compile, a fused optimizer step), so it is tried on the pick
    # alone, timed side by side with it and kept where it runs faster beyond the tie, or see
    # kept_unless_slower (atorch/auto/search/refine.py).
    tried_on_pick: bool = False
    # With tried_on_pick: the trial is kept unless its turns beside the pick show it slower beyond
    # the tie (the high end of the band of the pick's turn over the trial's below 1 - TIE); the
    # others are kept only where their turns show them faster beyond the tie. For a method that
    # costs nothing where it is as fast (no warm-up, no memory, the same update: fused_optimizer):
    # a real gain near the tie, read on either side of it from one search to the next, was kept in
    # some searches and not in others: the fused step's 1-16% on search_quality.py's held-out
    # scenarios (2026-11-28), kept in 1 of 3 GPT-2 searches and 2 of 3 MLP searches.
    kept_unless_slower: bool = False
    # ``(ctx, config) -> reason | None``: why this job (its optimizer, ...: a ModelContext) cannot
    # use the method, so the search does not try it on the pick (fused_optimizer beside an
    # optimizer with no fused step, as a trainer's wrapped ``configure_optimizers`` is).
    job_unsupported: Callable[[Any, MethodConfig], str | None] | None = None
    # Configs of a method that is otherwise searched as usual, tried on the pick alone the same
    # way (added, or in place of the pick's config of it): module_replace's liger kernels.
    pick_trials: tuple[dict, ...] = ()
    # ``(config, step_seconds, planned_steps, device_type) -> reason | None``: why trying the
    # method on a pick whose step takes ``step_seconds`` cannot pay over the job's planned steps
    # (a compile longer than any saving), so the search does not try it.
    cannot_pay: Callable[[MethodConfig, float, int, str], str | None] | None = None
    # Configs whose relations differ from the default config's (a backend switch): listed one by
    # one in docs/methods/compatibility.md.
    variants: tuple[dict, ...] = ()
    # The method lowers the peak memory (checkpointing, sharding): a search that finds nothing
    # within the budget suggests it when no candidate could use it.
    saves_memory: bool = False
    # The method only trades speed for memory (checkpointing: it never makes a step faster): the
    # search only tries it when the same candidate without it may not fit the memory budget.
    # Sharding saves memory but is not memory_only: it divides the optimizer's step, which the
    # cost model times, so it is judged by its estimated step like any other method.
    memory_only: bool = False
    # The method's term in the cost model's activation probe (atorch/auto/search/cost.py) where
    # the probe cannot show the method's effect (meta tensors, when planning with no hardware):
    # ``(config, saved) -> saved``, ``saved`` mapping each dtype to the bytes one forward saves.
    activation_term: Callable[[MethodConfig, dict], dict] | None = None
    # The method's memory and time terms in the cost model: ``(config, cost)`` updates the
    # candidate's ``atorch.auto.search.cost.StepCost`` (the terms run in applied order, so a
    # sharding method divides what the layout methods before it left on the rank).
    cost_term: Callable[[MethodConfig, Any], None] | None = None
    # The rates the time term hinges on, against the same strategy without this method: "half"
    # (bf16's speedup over fp32), "collectives". Without a calibration only some are measured
    # (speedup.py: "half"); the search does not prune the method as slower on a rate it never
    # measured: its candidates are dry-run instead (prune.py).
    decided_by: tuple[str, ...] = ()
    # False: the cost model's activation probe does not run this method's hooks on its copy of
    # the model (they need the process mesh or a GPU); its ``cost_term`` says what it changes.
    # A probed hook must not call a collective: the ranks share a search's probes out, each
    # running different ones (atorch/auto/search/share.py).
    probed: bool = True
    # ``(model) -> [module names]``: the units whose activations the cost model's probe records
    # one by one (atorch.auto.search.timeline.UnitSpan, in ``StepCost.unit_spans``) for this
    # method's ``cost_term``, e.g. the pieces a pipeline cuts the model into; [] when it has none.
    probe_units: Callable[[Any], list[str]] | None = None
    # A layout method (it splits the model over parallel dims): ``(world_size, model=None) ->
    # [(dims, config), ...]``, the dims it takes (e.g. ``{"tensor": 2}``; data gets the remaining
    # ranks) with the config the search tries on them; ``model`` (when the caller has one) for
    # choices that depend on it (a pipeline's virtual stages up to the layers a stage holds).
    # Keep it short: the search combines each layout with every combination of the other methods.
    layouts: Callable[..., Iterable[tuple[dict[str, int], dict]]] | None = None
    # ``ineligible(model, config, job)``: why this model cannot run the method on the layout of
    # ``job`` (heads the tensor size does not divide, fewer blocks than stages...), or None.
    # The search reports each ineligible layout with this reason and never builds it; for a
    # method that is not a layout method (gradient_accumulation: steps that divide a rank's
    # batch), the search leaves out its combinations with the layouts it cannot run on.
    ineligible: Callable[[Any, MethodConfig, LayoutJob], str | None] | None = None


    def related(self, relation: str, config: MethodConfig | None = None) -> dict[str, str]:
        """``conflicts``, ``requires`` or ``absorbs`` under ``config`` (the default config when
        None), as ``{method: reason}`` (an empty reason where none is declared)."""
        value = getattr(self, relation)
        if callable(value):
            value = value(config if config is not None else self.config_cls())
        return dict(value) if isinstance(value, Mapping) else {name: "" for name in value}


# The reason shared by the sharding methods' conflicts with each other.
ONE_SHARDING = "each shards the model or optimizer over the data-parallel ranks on its own; pick one"
# Why DeepSpeed's ZeRO engines refuse gradient_accumulation (the engine runs its own backward and step).
DS_ACCUMULATES = ("DeepSpeed's engine runs its own backward and step; use zero1/zero2 without use_ds_zero, or "
                  "fsdp, which accumulate")

_REGISTRY: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method; a name that is already taken is an error, not an override."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a method named {spec.name!r} is already registered; pick another name")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_method(name: str) -> None:
    """Remove a method (for tests and plugins that replace one of their own)."""
    _REGISTRY.pop(name, None)
