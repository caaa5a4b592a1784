"""parallel_mode: the process mesh, and plain data parallelism (DDP) over its data dims.

Config forms: ``"parallel_mode"`` (data parallel over every process),
``("parallel_mode", ([("tensor", 2), ("data", 2)], None))`` (dims innermost first, then an
optional rank order), or ``{"dims": [["data", 4]], "rank_order": null}``. The original ATorch's dim
names are read as atorch's: ``"model"`` is the tensor dim, ``"pipe"`` the pipeline dim (the
returned strategy names them ``tensor`` and ``pipeline``).

DDP wraps the model only when no sharding method (fsdp, zero2, ...) has wrapped it already.
"""

from typing import Any

from pydantic import Field, field_validator, model_validator
from torch.nn.parallel import DistributedDataParallel

from atorch import parallel_state
from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.distributed.topology import Topology

# The original ATorch's names for atorch's dims (its strategies and create_parallel_group use them).
DIM_ALIASES = {"model": "tensor", "pipe": "pipeline"}


class ParallelModeConfig(MethodConfig):
    dims: list[tuple[str, int]] | None = Field(
        default=None, description="(name, size) pairs, innermost first; None: data parallel over all ranks"
    )
    rank_order: list[int] | None = Field(
        default=None, description="a permutation of the world's ranks laid onto the mesh; None: 0..N-1"
    )

    @model_validator(mode="before")
    @classmethod
    def _from_atorch_form(cls, raw: Any) -> Any:
        if isinstance(raw, (tuple, list)) and len(raw) == 2 and (raw[0] is None or isinstance(raw[0], (list, tuple))):
            if raw[0] is None or all(isinstance(d, (list, tuple)) for d in raw[0]):
                return {"dims": None if raw[0] is None else [tuple(d) for d in raw[0]], "rank_order": raw[1]}
        if isinstance(raw, (tuple, list)) and all(isinstance(d, (list, tuple)) and len(d) == 2 for d in raw):
            return {"dims": [tuple(d) for d in raw]}
        return raw

    @field_validator("dims")
    @classmethod
    def _atorch_dim_names(cls, dims):
        if dims is None:
            return None
        bad = [(name, size) for name, size in dims if size < 1]
        if bad:  # a size 0 divided the world by zero while the dims were fitted
            raise ValueError(f"every dim's size must be at least 1, got {bad}; leave a dim out (or give it 1) "
                             "to not split over it")
        return [(DIM_ALIASES.get(name, name), size) for name, size in dims]


def build_topology(ctx: ModelContext, config: ParallelModeConfig) -> None:
    # plan_strategy has already fitted the dims to the world size.
    ctx.topology = Topology.build(config.dims, config.rank_order, ctx.device.type)
    # The user-facing parallel_state getters read this topology; atorch's internals use ctx.topology.
    parallel_state.set_topology(ctx.topology)


def wrap_ddp(ctx: ModelContext, config: ParallelModeConfig) -> None:
    if ctx.wrapped_by is not None or ctx.topology.data_parallel_size == 1:
        return
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ctx.model = DistributedDataParallel(
        ctx.model,
        device_ids=device_ids,
        process_group=ctx.topology.data_parallel_group,
        find_unused_parameters=ctx.find_unused_parameters,
    )
    ctx.wrapped_by = "parallel_mode"


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


def cost_term(config: ParallelModeConfig, cost) -> None:
    # DDP all-reduces the gradients over the data ranks, one bucket (bucket_cap_mb, 25 MiB) per
    # collective; a sharding method replaces this sync.
    cost.data_sync, cost.grad_reduce = {"grads": 1}, "all_reduce"
    cost.sync_calls = {"bucket_bytes": DDP_BUCKET_BYTES}
    cost.sync_overlap = {"all_reduce": ("backward",)}  # a bucket's all-reduce starts when backward fills it
    # DDP reduces the gradients through buckets of its own, allocated with it: a copy of the
    # gradients alive all the time (a method that syncs the gradients itself turns this off)
    cost.grad_buckets = True
    # DDP's per-step host overhead (its reducer's hooks, the buckets' launches), calibrated on this
    # machine; a pipeline averages its stages' gradients itself, a sharding method replaces DDP
    # (each drops this charge)
    if cost.dp_size > 1 and not {"pipeline_parallel", "mixed_parallel"} & set(cost.methods):
        cost.charge("parallel_mode")


register_method(
    MethodSpec(
        name="parallel_mode",
        config_cls=ParallelModeConfig,
        hooks={Stage.TOPOLOGY: build_topology, Stage.REPLICATE: wrap_ddp},
        description="named process mesh (data, zero, tensor, pipeline) and DDP over the data dims",
        distributed_only=True,
        cost_term=cost_term,
    )
)
