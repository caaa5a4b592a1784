"""fsdp: fully sharded data parallel with FSDP2 (``fully_shard``): parameters, gradients and
optimizer state split over the data-parallel ranks.

Config forms: ``"fsdp"`` (the model's repeated blocks become units, found by structure),
``("fsdp", {"atorch_wrap_cls": (LlamaDecoderLayer,), "param_dtype": "bf16"})``. With
``amp_native`` in the same strategy, its dtype becomes FSDP's compute dtype (gradients reduced in
fp32) instead of autocast.
"""

import torch
from pydantic import Field, model_validator

from atorch.auto.config_types import ClassRef, DType, MethodConfig, as_list, class_name
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import ONE_SHARDING, MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError
from atorch.sharding import fsdp2
from atorch.utils.log import logger
from atorch.utils.memo import once
from atorch.utils.modules import find_block_classes, missing_class_error, unit_summary


class FsdpConfig(MethodConfig):
    atorch_wrap_cls: list[ClassRef] = Field(default_factory=list, description="classes that become FSDP units; empty: the repeated blocks")
    atorch_size_based_min_num_params: int | None = Field(default=None, ge=1, description="also make a unit of any module with this many uncovered parameters")
    atorch_ignored_cls: list[ClassRef] = Field(default_factory=list, description="classes whose parameters stay unsharded (gradients still averaged)")
    wrap_trainable_outmost: bool = Field(default=False, description="make the outermost all-trainable modules (LoRA adapters) their own units")
    reshard_after_forward: bool = Field(default=True, description="free gathered parameters after forward (ZeRO-3); False keeps them for backward")
    param_dtype: DType | None = Field(default=None, description="compute dtype of gathered parameters")
    reduce_dtype: DType | None = Field(default=None, description="dtype of the gradient reduce-scatter")
    output_dtype: DType | None = Field(default=None, description="cast the root's floating outputs to this dtype")
    cpu_offload: bool = Field(default=False, description="keep sharded parameters and optimizer state in CPU memory")
    forward_prefetch: bool = Field(default=False, description="start gathering the next unit's parameters during this unit's forward")
    sync_module_states: bool = Field(default=True, description="start every rank from the first rank's weights")
    reduce_every_micro_batch: bool = Field(
        default=False, description="under gradient accumulation, reduce-scatter the gradients after every "
                                   "micro-batch (sharded gradients accumulate: less memory, more traffic)",
        json_schema_extra={"omitted_at_default": True})

    @model_validator(mode="before")
    @classmethod
    def _classes_as_names(cls, raw):
        if isinstance(raw, dict):
            raw = dict(raw)
            for key in ("atorch_wrap_cls", "atorch_ignored_cls"):
                if key in raw:
                    raw[key] = [class_name(c) for c in as_list(raw[key])]
        return raw


def resolve(model: torch.nn.Module, config: FsdpConfig) -> FsdpConfig:
    """Fill in the unit classes: the model's repeated blocks unless classes or a size are given.

    ``wrap_trainable_outmost`` adds the adapters to the units; it does not replace the blocks
    (before, it did: a LoRA model was sharded as its adapters plus one root holding every block).
    """
    if config.atorch_wrap_cls:
        if not fsdp2.choose_units(model, config.atorch_wrap_cls):
            raise MethodConfigError(missing_class_error("fsdp", "atorch_wrap_cls", config.atorch_wrap_cls, model))
        return config
    if config.atorch_size_based_min_num_params:
        return config
    return config.model_copy(update={"atorch_wrap_cls": [class_name(c) for c in find_block_classes(model)]})


def mixed_precision_from(ctx: ModelContext, param_dtype=None, reduce_dtype=None, output_dtype=None):
    """FSDP's mixed-precision policy; an absorbed amp_native supplies the compute dtype."""
    amp = ctx.strategy.get("amp_native") if ctx.strategy is not None else None
    if amp is not None and param_dtype is None:
        # Compute in amp's dtype, reduce gradients in fp32 for accuracy.
        param_dtype, reduce_dtype = amp.dtype, reduce_dtype or torch.float32
    return fsdp2.mixed_precision(param_dtype, reduce_dtype, output_dtype)


def _check_adapters(model: torch.nn.Module, config: FsdpConfig) -> None:
    """``wrap_trainable_outmost`` needs frozen parameters beside the trainable ones: on a model
    that trains every parameter (no adapters applied) it would silently run a full fine-tune.
    Checked when the method is applied, not in ``resolve``: ``atorch validate`` checks a file
    against a config's model, to which the user's code adds the adapters later."""
    params = list(model.parameters())
    if config.wrap_trainable_outmost and params and all(p.requires_grad for p in params):
        raise MethodConfigError(
            f"fsdp wrap_trainable_outmost=True (a LoRA strategy, e.g. strategies/lora_fsdp_bf16.json) but every "
            f"parameter of {type(model).__name__} is trainable: no adapters are applied, so this would be a full "
            "fine-tune. Apply the adapters first (peft.get_peft_model(model, LoraConfig(...)), which freezes the "
            "base weights), or for a full fine-tune use strategies/fsdp_bf16_checkpoint.json (or drop "
            "wrap_trainable_outmost)")


def shard(ctx: ModelContext, config: FsdpConfig) -> None:
    _check_adapters(ctx.model, config)
    units = fsdp2.choose_units(
        ctx.model, config.atorch_wrap_cls, config.atorch_size_based_min_num_params,
        config.atorch_ignored_cls, config.wrap_trainable_outmost,
    )
    summary = unit_summary(ctx.model, units)  # before sharding renames the classes (FSDPLinear)
    if config.sync_module_states:
        fsdp2.broadcast_module_states(ctx.model, ctx.topology.data_parallel_group)
    cpu_offload = config.cpu_offload
    if cpu_offload and ctx.device.type == "cpu":
        logger.info("fsdp: cpu_offload has no effect, the model already lives in CPU memory")
        cpu_offload = False
    fsdp2.shard_model(
        ctx.model,
        ctx.topology.data_parallel_mesh,
        units,
        reshard_after_forward=config.reshard_after_forward,
        mp_policy=mixed_precision_from(ctx, config.param_dtype, config.reduce_dtype, config.output_dtype),
        cpu_offload=cpu_offload,
        ignored=fsdp2.ignored_parameters(ctx.model, config.atorch_ignored_cls),
        forward_prefetch=config.forward_prefetch,
    )
    if config.reduce_every_micro_batch:
        for module in ctx.model.modules():  # atorch/auto/loop.py's set_gradient_sync leaves these on
            module._atorch_reduce_every_micro_batch = True
    ctx.wrapped_by = "fsdp"
    logger.info("fsdp: %d units (%s) + root sharded over %d ranks", len(units), summary,
                ctx.topology.data_parallel_size)


def step_locally(ctx: ModelContext, config: FsdpConfig) -> None:
    fsdp2.local_shard_step(ctx, "fsdp")


def compute_dtype_share(cost, dtype: torch.dtype | None = None) -> float:
    """Bytes per element of FSDP2's unsharded parameters and gradients over the model's own:
    ``dtype``'s (a policy's param_dtype), amp's 2 bytes under amp_native (which FSDP2 absorbs
    through its mixed-precision policy), else 1."""
    itemsize = dtype.itemsize if dtype is not None else 2 if "amp_native" in cost.methods else None
    if itemsize is None:
        return 1.0
    return min(1.0, itemsize / cost.element_bytes())


def unit_bytes(model: torch.nn.Module, config: FsdpConfig, apart: bool = False) -> tuple[list[int], int]:
    """Parameter bytes of each unit :func:`shard` makes (without the units nested in it), and of
    the root's own: whatever no unit holds (a Llama's embedding, final norm and head). With
    ``apart``, without the routed experts, which expert_parallel holds apart from the units."""
    from atorch.parallel_layers.experts import routed_experts

    names = fsdp2.choose_units(model, config.atorch_wrap_cls, config.atorch_size_based_min_num_params,
                               config.atorch_ignored_cls, config.wrap_trainable_outmost)
    skip = {id(p) for m in routed_experts(model).values() for p in m.parameters()} if apart else set()
    # innermost first, as choose_units lists them
    return fsdp2.unit_sizes(model, [(name,) for name in names], skip)


def cost_term(config: FsdpConfig, cost) -> None:
    synced_grads = cost.grads * (1 - cost.held_apart)  # the rank's piece, less the slices held apart
    cost.shard_over_data(params=True, grads=True, optim=True)
    cost.grad_buckets = False  # it replaces DDP
    cost.step_temp = cost.stepped  # the local step runs foreach kernels over the shards (local_step.py)
    low = compute_dtype_share(cost, config.param_dtype)  # gathered parameters and their gradients
    # the reduce-scatter's dtype: the policy's reduce_dtype (fp32 under amp), else param_dtype
    reduce = config.reduce_dtype or (config.param_dtype if "amp_native" not in cost.methods else torch.float32)
    apart = cost.held_apart > 0
    units, root = once(("fsdp units", id(cost.model), config.model_dump_json(), apart),
                       lambda: unit_bytes(cost.model, config, apart))
    scale = cost.weight_scale * cost.split
    if apart:  # the units' bytes without the slices held apart: the rank's piece less those
        scale *= (1 - cost.held_apart) * cost.param_bytes() / max(sum(units) + root, 1)
    unit, root = max(units, default=0) * scale * low, root * scale * low
    # The root is gathered from the first forward to the end of forward, and again through all
    # of backward, where its gradients (the head's come first) stay whole until its
    # reduce-scatter, the last. Besides it, the unit running and the one prefetched are whole;
    # with reshard_after_forward=False every unit stays whole from its forward to its backward.
    # In backward, so are the gradients of the unit running and of the one being reduced (on
    # search_quality's small Llama, 4 ranks, checkpoint + fsdp peaks in backward with both:
    # estimated 0.82 of its measured peak without them).
    # (beside a pipeline, the units of the rank's stages: their share of the model's)
    kept = sum(units) * cost.stage_share * scale * low if not config.reshard_after_forward else 2 * unit
    cost.gathered += root + kept
    cost.unit_grads += root + 2 * unit
    cost.whole_grads = synced_grads * low
    # A unit's reduce-scatter copies its whole gradients into a flat buffer in the reduce dtype:
    # both exist at once at the end of its backward (the root's, the last, is often the largest:
    # a Llama's embedding and head), with the activations mostly gone.
    share = compute_dtype_share(cost, reduce)
    cost.reduce_temp = max(root, unit) * (1 + share / low)
    # all-gather in forward and again in backward (once when kept whole), reduce-scatter
    cost.data_sync = {"params": 2 if config.reshard_after_forward else 1, "grads": 1}
    cost.grad_reduce = "reduce_scatter"
    # gathered in the policy's param_dtype (amp's dtype under amp), reduced in its reduce_dtype
    # (fp32 under amp; param_dtype when only that is set)
    cost.sync_share = {"all_gather": low, "reduce_scatter": share}
    # unit by unit (the root is one too), on this rank's pipeline stages
    calls = max(1.0, (len(units) + 1) * cost.stage_share)
    # (the root too: atorch passes reshard_after_forward to every unit, so FSDP2 does not keep the
    # root whole as it does when the value is left to it)
    cost.sync_calls = {"all_gather": calls * (2 if config.reshard_after_forward else 1), "reduce_scatter": calls}
    cost.sync_in_hooks = True  # FSDP2 issues each of them
    if cost.pipeline_stage is not None:
        names = once(("fsdp unit names", id(cost.model), config.model_dump_json()),
                     lambda: fsdp2.choose_units(cost.model, config.atorch_wrap_cls, config.atorch_size_based_min_num_params,
                                                config.atorch_ignored_cls, config.wrap_trainable_outmost))
        pipeline_sync(cost, names, config.reshard_after_forward)
    # the next unit is gathered while this one computes; gradients reduced as backward makes them
    cost.sync_overlap = {"all_gather": ("forward", "backward"), "reduce_scatter": ("backward",)}
    accumulation_terms(cost, share, config.reduce_every_micro_batch)
    # it replaces DDP: its own host overhead, calibrated, per collective its hooks issue in a step
    # (every micro-batch's: charged before the accumulation's, a step of 4 had 15 of its 45)
    cost.overheads.pop("parallel_mode", None)
    if cost.dp_size > 1:
        cost.charge("fsdp", sum(cost.sync_calls.values()))
    if config.cpu_offload and cost.device_type == "cuda":
        offload_terms(cost, config.reduce_every_micro_batch)


def pipeline_sync(cost, units: list, reshard_after_forward: bool) -> None:
    """fsdp's and zero2's collectives beside a pipeline (``cost.pipeline_stage``, the busiest rank):
    each of the rank's stage modules is a root and each of ``units`` (module names, or tuples of
    them) in its stages a unit. torch's PipelineStage defers every unit's reduce-scatter to after
    the last microbatch's backward and keeps it whole after each backward; resharded after each
    forward, a unit is gathered again by the next action after a forward, and by the first: once
    per microbatch and once more (counted on 4 gloo ranks, pipeline=2 x data=2:
    tests/auto/search/test_cost_traffic_pipeline_fsdp.py). Kept whole, once a step. (A pipeline
    takes no gradient accumulation: its microbatches are its accumulation, and gradient_accumulation
    conflicts with it, so no step here repeats the schedule.)"""
    if cost.pipeline_stage is None:
        return
    stages, microbatches = cost.pipeline_stage

    def stage_of(name: str) -> int | None:
        return next((i for i, units in enumerate(stages) for u in units if name == u or name.startswith(u + ".")), None)

    # a group of blocks that crosses from one stage to the next is cut there (fsdp2.within_roots)
    pieces = {(index, stage_of(name)) for index, unit in enumerate(units)
              for name in (unit if isinstance(unit, tuple) else (unit,))}
    modules = sum(1 for _, stage in pieces if stage is not None) + len(stages)
    gathers = microbatches + 1 if reshard_after_forward else 1
    cost.data_sync["params"] = gathers
    cost.sync_calls = {"all_gather": modules * gathers, "reduce_scatter": modules}


def offload_terms(cost, every_micro_batch: bool) -> None:
    """FSDP2's CPUOffloadPolicy (``cpu_offload``) on a GPU: the rank's shards of the parameters, of
    their gradients and of the optimizer state live in host memory, and torch's AdamW steps them
    there (``StepCost.optim_impl`` "host": the profile's host optimizer rate). Each all-gather
    copies the unit's shard in first, each reduce-scatter copies the gradient shard out
    (``StepCost.host_transfer``, at the profile's host link, not overlapped). What the device
    holds is what a step gathers, computes and reduces. On a CPU the model already lives in host
    memory: ``shard`` turns the option off, and this term is not applied."""
    reduces = cost.accumulation if every_micro_batch else 1
    cost.host_transfer += cost.params * cost.data_sync.get("params", 0) + cost.grads * reduces
    cost.params = cost.grads = cost.optim_state = 0.0
    cost.step_temp = 0.0
    cost.optim_impl = "host"


def accumulation_terms(cost, reduce_share: float, every_micro_batch: bool = False) -> None:
    """FSDP2 under gradient accumulation, as atorch runs it (atorch/auto/loop.py turns its gradient
    sync off until the last micro-batch): every micro-batch gathers the units again, and the
    unsharded gradients accumulate whole, in the reduce dtype, until the one reduce-scatter: the
    rank's whole piece of them alive through the step. (Megatron and Composer reduce-scatter every
    micro-batch instead, trading traffic for this memory: ``every_micro_batch``, fsdp's
    ``reduce_every_micro_batch``, does so: the reduce-scatters run every micro-batch and only the
    rank's shard of the gradients accumulates.)"""
    steps = cost.accumulation
    if steps <= 1:
        return
    cost.data_sync["params"] = cost.data_sync.get("params", 0) * steps
    cost.sync_calls["all_gather"] = cost.sync_calls.get("all_gather", 1) * steps
    if every_micro_batch:
        cost.data_sync["grads"] = cost.data_sync.get("grads", 0) * steps
        cost.sync_calls["reduce_scatter"] = cost.sync_calls.get("reduce_scatter", 1) * steps
        # each micro-batch's reduce-scatters run behind its own backward: the whole backward's window
        cost.sync_window = {k: v for k, v in cost.sync_window.items() if k != "reduce_scatter"}
        return
    whole = cost.param_bytes(trainable_only=True) * cost.weight_scale * cost.split * cost.stage_share
    whole *= 1 - cost.held_apart  # the slices held apart accumulate in their .grad (counted in grads)
    # the accumulated gradients, whole, at every moment of the step, beside those of the units
    # backward is making (StepCost.accumulated_grads)
    cost.accumulated_grads = whole * reduce_share


register_method(
    MethodSpec(
        name="fsdp",
        config_cls=FsdpConfig,
        hooks={Stage.WRAP: shard, Stage.OPTIMIZER: step_locally},
        description="FSDP2 full sharding of parameters, gradients and optimizer state",
        distributed_only=True,
        needs_data_parallel=True,
        conflicts={"zero1": ONE_SHARDING, "zero2": ONE_SHARDING},
        absorbs=("amp_native",),
        resolve=resolve,
        ineligible=fsdp2.pipeline_ineligible,
        search_space=({},),
        saves_memory=True,
        cost_term=cost_term,
        decided_by=("collectives",),
    )
)
