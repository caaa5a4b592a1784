"""zero1: optimizer state sharded over the data-parallel ranks (ZeRO stage 1).

Config forms: ``"zero1"`` (PyTorch's ``ZeroRedundancyOptimizer`` under DDP), ``{"use_ds_zero":
true}`` (DeepSpeed ZeRO-1; then ``result.optim.backward(loss)`` replaces ``loss.backward()``).
Each rank keeps the optimizer state of about 1/N of the parameters and broadcasts its updated
parameters after every step; gradients are all-reduced by DDP as usual.
"""

from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import DS_ACCUMULATES, ONE_SHARDING, MethodSpec, Stage, register_method
from atorch.methods.parallel_mode import DDP_BUCKET_BYTES
from atorch.sharding.deepspeed import deepspeed_unavailable, wrap_deepspeed, zero_memory_terms
from atorch.sharding.deepspeed_config import TRUSTED_DESCRIPTION, StrategyDsConfig, TrustedField, merged
from atorch.utils.memo import once


class Zero1Config(MethodConfig):
    use_ds_zero: bool = Field(default=False, description="use DeepSpeed ZeRO-1 instead of ZeroRedundancyOptimizer")
    ds_config: StrategyDsConfig = Field(
        default=None, description="extra DeepSpeed config merged over atorch's (e.g. gradient_clipping); keys that "
        "write files or start services are refused (atorch/sharding/deepspeed_config.py)")
    trusted_ds_config: TrustedField = Field(default=None, exclude=True, description=TRUSTED_DESCRIPTION)


def _one_dtype_per_device(params) -> bool:
    flat = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return len({(p.device, p.dtype) for p in flat if p.requires_grad}) == len({p.device for p in flat if p.requires_grad})


def _zero_optimizer(ctx: ModelContext):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from atorch.sharding.local_step import step_on_local_shards
    from atorch.sharding.zero_beside_slices import ZeroBesideSlices, is_slice

    # Groups' parameter iterables listed once: the dtype check below must not use them up.
    params = [dict(item, params=list(item["params"])) if isinstance(item, dict) else item
              for item in ctx.optim_params()]
    flat = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    # expert_parallel's slices differ from rank to rank: each rank steps its own (zero_beside_slices.py)
    zero = ZeroBesideSlices if any(is_slice(p) for p in flat) else ZeroRedundancyOptimizer
    optim = zero(
        params,
        optimizer_class=ctx.optim_func,
        process_group=ctx.topology.data_parallel_group,
        # Each rank's parameters as views of one flat bucket: after the step, one broadcast per
        # rank instead of one per parameter (86 -> 67 ms a step on benchmarks/peers.py's model,
        # DeepSpeed ZeRO-1 82 ms). ZeRO builds a bucket in its first parameter's dtype, so
        # mixed dtypes keep the per-parameter broadcasts.
        parameters_as_bucket_view=_one_dtype_per_device(params),
        **ctx.optim_args,
    )
    # The owned parameters are plain tensors: foreach kernels where the user left it unset.
    step_on_local_shards(optim.optim)
    return optim


def claim(ctx: ModelContext, config: Zero1Config) -> None:
    if config.use_ds_zero:
        ctx.wrapped_by = "zero1"  # DeepSpeed's engine replaces DDP (wrapped in RUNTIME)
    else:
        ctx.optim_factory = _zero_optimizer  # DDP stays; only the optimizer changes


def deepspeed_wrap(ctx: ModelContext, config: Zero1Config) -> None:
    if config.use_ds_zero:
        wrap_deepspeed(ctx, stage=1, user_config=merged(config))


def _unsupported(device_ctx, config: Zero1Config) -> str | None:
    return deepspeed_unavailable() if config.use_ds_zero else None


def _conflicts(config: Zero1Config) -> dict[str, str]:
    out = {"zero2": ONE_SHARDING, "fsdp": ONE_SHARDING}
    if config.use_ds_zero:
        out["gradient_accumulation"] = DS_ACCUMULATES
        out["expert_parallel"] = ("expert_parallel's slices differ from rank to rank; DeepSpeed's ZeRO-1 would "
                                  "partition and broadcast them as shared weights; zero1 without use_ds_zero "
                                  "leaves each rank its own slices")
        # deepspeed.initialize takes the pipeline model as one module and its ZeRO step found no
        # gradients it had reduced (KeyError in scaled_global_norm, pipeline 2 x data 2)
        out.update(dict.fromkeys(("pipeline_parallel", "mixed_parallel"), PIPELINE_DS_ZERO))
    return out


PIPELINE_DS_ZERO = ("DeepSpeed's ZeRO engine runs its own backward and gradient reduction, where a pipeline schedule "
                    "runs backward inside the model call and averages the stages' gradients itself; use zero1 "
                    "without use_ds_zero (ZeroRedundancyOptimizer over each stage's data ranks)")


def cost_term(config: Zero1Config, cost) -> None:
    cost.shard_over_data(params=False, grads=False, optim=True)
    if cost.dp_size > 1:  # the sharded optimizer's per-step host overhead (its broadcasts), calibrated
        cost.charge("zero1")
    # a pipeline model averages its stages' gradients itself (pipeline_terms), with no DDP
    pipelined = bool({"pipeline_parallel", "mixed_parallel"} & set(cost.methods))
    cost.grad_buckets = not config.use_ds_zero and not pipelined  # DeepSpeed's engine replaces DDP
    if not config.use_ds_zero:
        # ZeroRedundancyOptimizer hands out whole tensors: some rank holds the largest one (often
        # the embedding), however many ranks there are.
        largest = once(("largest trainable bytes", id(cost.model), cost.held_apart > 0),
                       lambda: _largest_shared(cost.model, cost.held_apart > 0))
        largest *= cost.weight_scale * cost.split
        # beside expert_parallel every rank also steps its own slices (zero_beside_slices.py)
        apart = cost.param_bytes(True) * cost.weight_scale * cost.split * cost.stage_share * cost.held_apart
        cost.optim_state = max(cost.optim_state, (largest + apart) * cost.state_factor)
        cost.stepped = max(cost.stepped, largest + apart)
        cost.step_temp = cost.stepped  # foreach kernels over the shard's parameters (local_step.py)
    else:
        zero_memory_terms(cost, merged(config))
    # all-reduce gradients, broadcast updated parameters
    cost.data_sync, cost.grad_reduce = {"grads": 1, "params": 1}, "all_reduce"
    if pipelined:  # the pipeline's blocking all-reduce a parameter stays; the broadcasts follow the step
        cost.sync_calls = {**cost.sync_calls, "all_gather": cost.dp_size}
        return
    # DDP's gradient buckets, then one broadcast per rank (each rank's bucket of updated parameters)
    cost.sync_calls = {"bucket_bytes": DDP_BUCKET_BYTES, "all_gather": cost.dp_size}
    # the all-reduce runs in DDP's buckets during backward; the broadcast waits for the step
    cost.sync_overlap = {"all_reduce": ("backward",)}


def _largest_shared(model, apart: bool) -> int:
    """The bytes of the largest trainable weight ZeRO hands out (without expert_parallel's slices,
    which stay with their own ranks, when ``apart``)."""
    skip = set()
    if apart:
        from atorch.parallel_layers.experts import routed_experts

        skip = {id(p) for m in routed_experts(model).values() for p in m.parameters()}
    return max((p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in skip),
               default=0)


register_method(
    MethodSpec(
        name="zero1",
        config_cls=Zero1Config,
        hooks={Stage.WRAP: claim, Stage.RUNTIME: deepspeed_wrap},
        description="ZeRO-1: optimizer state sharded over data-parallel ranks",
        distributed_only=True,
        needs_data_parallel=True,
        conflicts=_conflicts,
        variants=({"use_ds_zero": True},),
        unsupported=_unsupported,
        search_space=({},),
        saves_memory=True,
        cost_term=cost_term,
        decided_by=("collectives",),
    )
)
