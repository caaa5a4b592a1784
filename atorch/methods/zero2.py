"""zero2: gradients and optimizer state sharded over the data-parallel ranks (ZeRO stage 2).

Config forms: ``"zero2"`` (FSDP2 over the model's blocks, parameters kept gathered from forward
to backward), ``{"not_use_fsdp": true}`` (fairscale OSS + ShardedDDP), ``{"use_ds_zero": true}``
(DeepSpeed ZeRO-2). With ``amp_native`` in the strategy, the FSDP2 path computes in its dtype.
"""

import importlib.util

from pydantic import Field, model_validator

from atorch.auto.config_types import MethodConfig, class_name
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import DS_ACCUMULATES, ONE_SHARDING, MethodSpec, Stage, register_method
from atorch.methods.fsdp import accumulation_terms, compute_dtype_share, mixed_precision_from, pipeline_sync
from atorch.sharding import fsdp2
from atorch.sharding.deepspeed import deepspeed_unavailable, wrap_deepspeed, zero_memory_terms
from atorch.sharding.deepspeed_config import TRUSTED_DESCRIPTION, StrategyDsConfig, TrustedField, merged
from atorch.utils.memo import once
from atorch.utils.modules import find_block_classes


class Zero2Config(MethodConfig):
    use_ds_zero: bool = Field(default=False, description="DeepSpeed ZeRO-2")
    not_use_fsdp: bool = Field(default=False, description="fairscale OSS + ShardedDDP instead of FSDP2")
    ds_config: StrategyDsConfig = Field(
        default=None, description="extra DeepSpeed config merged over atorch's (e.g. gradient_clipping); keys that "
        "write files or start services are refused (atorch/sharding/deepspeed_config.py)")
    trusted_ds_config: TrustedField = Field(default=None, exclude=True, description=TRUSTED_DESCRIPTION)
    bucket_params: int = Field(
        default=500_000_000, ge=0,
        description="FSDP2 path: consecutive blocks share one FSDP unit (one all-gather, one reduce-scatter) "
                    "until it holds this many parameters; blocks short of a bucket join the root's unit; "
                    "0 = one unit per block. The default is DeepSpeed's reduce_bucket_size.",
    )

    @model_validator(mode="after")
    def _one_backend(self):
        if self.use_ds_zero and self.not_use_fsdp:
            raise ValueError("use_ds_zero and not_use_fsdp pick different backends; set at most one")
        return self


def _fairscale_optimizer(ctx: ModelContext):
    from fairscale.optim.oss import OSS

    return OSS(ctx.optim_params(), optim=ctx.optim_func, group=ctx.topology.data_parallel_group, **ctx.optim_args)


def shard(ctx: ModelContext, config: Zero2Config) -> None:
    ctx.wrapped_by = "zero2"
    if config.use_ds_zero:
        return  # DeepSpeed wraps in RUNTIME, once the optimizer exists
    if config.not_use_fsdp:
        ctx.optim_factory = _fairscale_optimizer
        return
    fsdp2.broadcast_module_states(ctx.model, ctx.topology.data_parallel_group)
    blocks = fsdp2.choose_units(ctx.model, [class_name(c) for c in find_block_classes(ctx.model)])
    # One unit per block cost a synchronous gather and a reduce-scatter (an all-reduce on gloo) per
    # block on CPU, 1.12x DeepSpeed's single bucket (docs/zero_profile.md); group blocks into buckets.
    units = fsdp2.group_units(ctx.model, blocks, config.bucket_params)
    fsdp2.shard_model(
        ctx.model, ctx.topology.data_parallel_mesh, units,
        reshard_after_forward=False, mp_policy=mixed_precision_from(ctx),
    )


def wrap_optimizer(ctx: ModelContext, config: Zero2Config) -> None:
    if not config.not_use_fsdp and not config.use_ds_zero:
        # A step over DTensors was 25 ms of DTensor dispatch against DeepSpeed's 1 ms flat step.
        fsdp2.local_shard_step(ctx, "zero2")
    if config.not_use_fsdp:
        from fairscale.nn.data_parallel import ShardedDataParallel

        # No gradient buckets: bucketed gradients are views that only model.zero_grad() clears,
        # and the training loop calls optim.zero_grad().
        model = ShardedDataParallel(
            ctx.model, ctx.base_optim, process_group=ctx.topology.data_parallel_group, reduce_buffer_size=0
        )
        # fairscale 0.4.13 (its last release) keeps a reduced gradient only where the owner's
        # rank *in the group* equals this process's *global* rank: on a data group other than
        # the world (tensor x data layouts) owners dropped their gradients and skipped updates.
        # Its only use of _global_rank is that comparison, so the group rank makes it right.
        model._global_rank = model._rank
        ctx.model = model


def wrap_ds(ctx: ModelContext, config: Zero2Config) -> None:
    if config.use_ds_zero:
        wrap_deepspeed(ctx, stage=2, user_config=merged(config))


def _conflicts(config: Zero2Config) -> dict[str, str]:
    out = {"zero1": ONE_SHARDING, "fsdp": ONE_SHARDING}
    if config.use_ds_zero or config.not_use_fsdp:
        out["expert_parallel"] = ("expert_parallel's slices differ from rank to rank; zero2 on FSDP2 (the default "
                                  "backend) leaves them out of its sharding, DeepSpeed's and fairscale's would not")
        out["pipeline_parallel"] = ("a pipeline's stages are sharded by zero2 on FSDP2 (the default backend); "
                                    f"{'DeepSpeed' if config.use_ds_zero else 'fairscale'} wraps the whole model")
    if config.use_ds_zero:
        out["gradient_accumulation"] = DS_ACCUMULATES
    elif config.not_use_fsdp:
        out["gradient_accumulation"] = ("fairscale's ShardedDataParallel reduces on every backward; zero2 on FSDP2 "
                                        "(the default) accumulates")
    return out


def _absorbs(config: Zero2Config) -> dict[str, str]:
    # FSDP2 computes in amp's dtype (mixed precision policy) and DeepSpeed in its bf16/fp16 mode;
    # fairscale's ShardedDDP does neither, so there amp_native's autocast stays on.
    if config.not_use_fsdp:
        return {}
    backend = "DeepSpeed's bf16/fp16 mode" if config.use_ds_zero else "FSDP2's mixed-precision policy"
    return {"amp_native": f"computes in amp_native's dtype through {backend}"}


def _unsupported(device_ctx, config: Zero2Config) -> str | None:
    if config.use_ds_zero:
        return deepspeed_unavailable()
    if config.not_use_fsdp and importlib.util.find_spec("fairscale") is None:
        return "not_use_fsdp needs fairscale, which is not installed (pip install 'atorch[fairscale]')"
    return None


def cost_term(config: Zero2Config, cost) -> None:
    cost.shard_over_data(params=False, grads=True, optim=True)
    cost.grad_buckets = False  # it replaces DDP
    # reduce-scatter gradients, all-gather updated parameters
    cost.data_sync, cost.grad_reduce = {"grads": 1, "params": 1}, "reduce_scatter"
    # every backend reduces gradients as backward makes them; the updated parameters are gathered
    # after the step (DeepSpeed, fairscale) or unit by unit ahead of its forward (FSDP2)
    cost.sync_overlap = {"reduce_scatter": ("backward",)}
    if config.use_ds_zero:
        zero_memory_terms(cost, merged(config))
    if not config.use_ds_zero and not config.not_use_fsdp:
        _fsdp2_terms(config, cost)
        # one gather (in forward: kept whole through backward) and one reduce-scatter per unit
        groups, _ = once(("zero2 units", id(cost.model), config.bucket_params, cost.held_apart > 0),
                         lambda: _unit_bytes(cost.model, config.bucket_params, cost.held_apart > 0))
        units = max(1.0, (len(groups) + 1) * cost.stage_share)
        cost.sync_calls = {"all_gather": units, "reduce_scatter": units}
        cost.sync_overlap = {"reduce_scatter": ("backward",), "all_gather": ("forward",)}
        cost.sync_in_hooks = True  # FSDP2 issues each of them
        if cost.pipeline_stage is not None:
            pipeline_sync(cost, once(("zero2 unit names", id(cost.model), config.bucket_params),
                                     lambda: _unit_names(cost.model, config.bucket_params)), False)
        accumulation_terms(cost, 1.0)  # reduced in fp32, the model's dtype
    # it replaces DDP: its own host overhead, calibrated, per collective its hooks issue
    cost.overheads.pop("parallel_mode", None)
    if cost.dp_size > 1:
        cost.charge("zero2", sum(cost.sync_calls.get(k, 1.0) for k in ("all_gather", "reduce_scatter")))


def _unit_names(model, bucket_params: int) -> list[tuple[str, ...]]:
    """The groups of blocks :func:`shard` makes units of (a pipeline's stages cut those that cross
    from one stage to the next: fsdp2.within_roots, not counted here)."""
    blocks = fsdp2.choose_units(model, [class_name(c) for c in find_block_classes(model)])
    return fsdp2.group_units(model, blocks, bucket_params)


def _unit_bytes(model, bucket_params: int, apart: bool = False) -> tuple[list[int], int]:
    """Parameter bytes of the units :func:`shard` makes: the groups of consecutive blocks
    (``fsdp2.group_units``), each past ``bucket_params`` by up to a block, and the root, which
    holds what no group does (the leftover blocks, the embedding, the head). The term had taken
    ``bucket_params`` itself for the largest. With ``apart``, without the routed experts, which
    expert_parallel holds apart from the units."""
    from atorch.parallel_layers.experts import routed_experts

    skip = {id(p) for m in routed_experts(model).values() for p in m.parameters()} if apart else set()
    return fsdp2.unit_sizes(model, _unit_names(model, bucket_params), skip)


def _fsdp2_terms(config: Zero2Config, cost) -> None:
    """FSDP2 keeps each parameter's shard and, from a unit's forward until after its backward,
    the unit's whole parameters in the compute dtype: every unit is whole at the end of forward.
    In backward a unit's gradients are whole (in the compute dtype) until its reduce-scatter.
    Measured on the cost-model benchmark's Llamas (2 ranks), fp32: without these terms the
    estimate was 0.72-0.88 of the measured peak, with them 0.85-1.03."""

    whole = cost.param_bytes() * cost.weight_scale * cost.split * cost.stage_share
    low = compute_dtype_share(cost)  # FSDP2 gathers in amp's 2-byte dtype
    # expert_parallel's slices, held apart: whole on the rank, or sharded over their copies and
    # gathered like the other weights (StepCost.apart_copies)
    apart = whole * cost.held_apart
    whole -= apart
    cost.params = whole / cost.dp_size + whole * low + apart / cost.apart_copies
    if cost.apart_copies > 1:
        cost.params += apart * low
    cost.step_temp = cost.stepped  # the local step runs foreach kernels over the shards (local_step.py)
    trainable = cost.param_bytes(trainable_only=True) * cost.weight_scale * cost.split * cost.stage_share
    trainable *= 1 - cost.held_apart
    groups, root = once(("zero2 units", id(cost.model), config.bucket_params, cost.held_apart > 0),
                        lambda: _unit_bytes(cost.model, config.bucket_params, cost.held_apart > 0))
    scale = cost.weight_scale * cost.split
    if cost.held_apart:  # the units' bytes without the slices held apart: the rank's piece less those
        scale *= (1 - cost.held_apart) * cost.param_bytes() / max(sum(groups) + root, 1)
    # beside a pipeline each stage module is a root, holding its stage's share of what no group
    # holds (on search_quality's small Llama, pipeline=2 x data=2: the whole model's root had
    # estimated 1.31x the measured peak, the stage's 1.0x)
    root *= cost.stage_share
    units = sorted((size * scale for size in [*groups, root]), reverse=True)
    unit, pair = units[0], sum(units[:2])  # the largest; the two largest (the running one, the one reducing)
    # the all-gather buffer kept at forward's end: a group's (measured on the wide-vocabulary Llama
    # of tests/auto/search/test_cost_memory.py, whose root's buffer was not alive there)
    buffer = max(groups, default=root) * scale
    # The all-gather's output is kept through forward beside the unsharded parameters, and freed
    # at its end; in backward the unit's gradients are whole until its reduce-scatter. On the
    # cost-model benchmark's Llama (2 ranks, one unit) checkpoint + zero2 peaks late in backward
    # with neither the buffer nor a shard of the gradients: 1.14 of its measured peak while the
    # buffer counted there and the gradients as shards, 1.00 now; plain zero2 peaks at the loss.
    cost.sync_share = {"all_gather": low}  # gathered in amp's dtype, reduced in fp32
    cost.forward_gathered += buffer * low
    cost.unit_grads += pair * low
    cost.whole_grads = trainable * low
    if low < 1.0:
        # Under amp a unit's gradients come in amp's dtype and are cast to fp32 for the
        # reduce-scatter (MixedPrecisionPolicy's reduce_dtype): both at once at the end of the
        # unit's backward. On search_quality's small Llama the one unit is the whole model, and
        # amp + zero2 measured the same peak with and without checkpointing (10.08 MiB; estimated
        # 9.45 and 7.37 without this term).
        cost.reduce_temp = unit * low + unit


register_method(
    MethodSpec(
        name="zero2",
        config_cls=Zero2Config,
        hooks={Stage.WRAP: shard, Stage.OPTIMIZER: wrap_optimizer, Stage.RUNTIME: wrap_ds},
        description="ZeRO-2: gradients and optimizer state sharded over data-parallel ranks",
        distributed_only=True,
        needs_data_parallel=True,
        conflicts=_conflicts,
        ineligible=fsdp2.pipeline_ineligible,
        absorbs=_absorbs,
        variants=({"not_use_fsdp": True}, {"use_ds_zero": True}),
        unsupported=_unsupported,
        search_space=({},),
        saves_memory=True,
        cost_term=cost_term,
        decided_by=("collectives",),
    )
)
