"""mixed_parallel: tensor x pipeline x data parallelism (3D) in one method.

Config forms: ``"mixed_parallel"`` (sizes chosen from the world size: pipeline 2 when the world
is even, then tensor 2 when what is left is even, the rest data) or
``("mixed_parallel", {"tensor_size": 2, "pipeline_size": 2, "num_microbatches": 4})``. The model
is split into pipeline stages (as pipeline_parallel does) and each local stage is sharded over
the tensor group with the tensor_parallel layers; gradients are averaged over the data ranks.
``virtual_pipeline_size`` > 1 runs interleaved 1F1B (Megatron's virtual stages: rank r holds
stages r, r + p, ...), each of a rank's stages sharded over its tensor group; with ``zero1``
each stage's optimizer state (of its tensor slices) is sharded over the data ranks holding the
same slices. Supports the models both halves support: Llama-style Hugging Face decoder LMs, and
``nn.Sequential`` chains of tensor-parallel-recognized blocks.
"""

from dataclasses import replace

import torch
from pydantic import Field

from atorch.auto.context import ModelContext
from atorch.auto.method_spec import LayoutJob, MethodSpec, Stage, register_method
from atorch.distributed import env
from atorch.distributed.topology import DATA_PARALLEL_DIMS
from atorch.errors import MethodConfigError, WorldSizeError
from atorch.methods.pipeline_parallel import divisors, pipeline_ineligible, pipeline_terms, probe_units
from atorch.methods.pipeline_parallel import layouts as pipeline_layouts
from atorch.methods.tensor_parallel import tensor_activations, tensor_ineligible, tensor_terms
from atorch.parallel_layers.auto_shard import ShardingError, shard_model
from atorch.pipeline.auto import PipelineFields, check_fields, pipeline_model, with_stage_microbatches
from atorch.pipeline.layouts import layout_for


class MixedParallelConfig(PipelineFields):
    tensor_size: int | None = Field(default=None, ge=1, description="tensor-parallel ranks; None: chosen")
    pipeline_size: int | None = Field(default=None, ge=1, description="pipeline stages' ranks; None: chosen")


def choose_sizes(world: int, tensor: int | None, pipeline: int | None) -> tuple[int, int]:
    """(tensor, pipeline) for ``world`` ranks: given sizes are kept, missing ones chosen (pipeline
    2 if it divides, then tensor 2 if it divides the rest); the data dim takes what remains."""
    if pipeline is None:
        pipeline = 2 if world % ((tensor or 1) * 2) == 0 else 1
    if tensor is None:
        tensor = 2 if world % (pipeline * 2) == 0 else 1
    if world % (tensor * pipeline):
        raise WorldSizeError(f"mixed_parallel: tensor_size {tensor} x pipeline_size {pipeline} does not divide the "
                             f"world size {world}; pick sizes whose product divides it")
    return tensor, pipeline


def resolve(model: torch.nn.Module, config: MixedParallelConfig) -> MixedParallelConfig:
    check_fields(config)
    layout_for(model)
    if config.tensor_size and config.pipeline_size:
        return config  # planning laid them out for the job's world size (lay_out_dims)
    tensor, pipeline = choose_sizes(env.world_size(), config.tensor_size, config.pipeline_size)
    return config.model_copy(update={"tensor_size": tensor, "pipeline_size": pipeline})


def lay_out_dims(config: MixedParallelConfig, world_size: int, dims: list) -> tuple[MixedParallelConfig, list]:
    """parallel_mode's dims for this job: tensor x pipeline x data (one Topology, built by parallel_mode)."""
    given = dict(dims)
    extra = sorted(name for name, size in given.items() if size > 1 and name not in ("tensor", "pipeline", "data"))
    if extra:
        raise MethodConfigError(f"mixed_parallel lays out tensor, pipeline and data dims itself; parallel_mode also "
                                f"has {extra}: drop them")
    tensor, pipeline = choose_sizes(world_size, config.tensor_size, config.pipeline_size)
    for name, size in (("tensor", tensor), ("pipeline", pipeline)):
        if given.get(name, 1) > 1 and given[name] != size:
            raise MethodConfigError(f"parallel_mode's {name} dim is {given[name]} but mixed_parallel's {name}_size is "
                                    f"{size}; give the sizes in mixed_parallel only (parallel_mode data-only)")
    config = with_stage_microbatches(config.model_copy(update={"tensor_size": tensor, "pipeline_size": pipeline}),
                                     pipeline)
    return config, [("tensor", tensor), ("pipeline", pipeline), ("data", world_size // (tensor * pipeline))]


def split_and_shard(ctx: ModelContext, config: MixedParallelConfig) -> None:
    tensor = ctx.topology.size("tensor")
    group = ctx.topology.group("tensor")

    def shard(stage_module):
        try:
            shard_model(stage_module, group, tensor)
        except ShardingError as error:
            raise MethodConfigError(f"mixed_parallel: {error}") from None

    pipeline_model(ctx, config, "mixed_parallel", stage_transform=shard if tensor > 1 else None)


def layouts(world_size: int, model=None) -> list[tuple[dict[str, int], dict]]:
    # tensor x pipeline, both above 1 (one of them alone is tensor_parallel or pipeline_parallel);
    # microbatches and virtual stages (interleaved 1F1B) as for pipeline_parallel.
    return [({"tensor": t, **dims}, {"tensor_size": t, "pipeline_size": dims["pipeline"], **config})
            for t in divisors(world_size) for dims, config in pipeline_layouts(world_size // t, model)]


def ineligible(model: torch.nn.Module, config: MixedParallelConfig, job: LayoutJob) -> str | None:
    why = (tensor_ineligible(model, job.dims.get("tensor", 1))
           or pipeline_ineligible(model, config, job, job.dims.get("pipeline", 1)))
    if why is None and getattr(layout_for(model), "traced", False):
        why = (f"tensor={job.dims.get('tensor', 1)} x pipeline={job.dims.get('pipeline', 1)}: mixed_parallel shards "
               f"stages built from a layout, and no layout knows {type(model).__name__} (only a trace of its "
               "forward splits it: pipeline_parallel)")
    return why


def cost_term(config: MixedParallelConfig, cost) -> None:
    # A tensor rank's unit spans first, from which the stages build their moments; then the stages,
    # as the tensor term's communication counts only the rank's own stage's layers.
    tensor_activations(cost, cost.size("tensor"))
    pipeline_terms(cost, config, cost.size("pipeline"))
    first = len(cost.comms)
    tensor_terms(cost, cost.size("tensor"), activations=False)
    if cost.size("pipeline") > 1:
        _per_microbatch(cost, first, config.num_microbatches)


def _per_microbatch(cost, first: int, microbatches: int) -> None:
    """The tensor collectives ``tensor_terms`` charged (``cost.comms[first:]``) as a pipeline
    runs them: each microbatch runs its stages' layers, and their collectives, once (the bytes
    were the whole batch's already); the head's logit gather (its all-gather) runs whole on the
    last stage, not a stage's share of it. On tensor=2 x pipeline=2 with 2 microbatches (4 gloo
    ranks) the code made 30 all-reduces and 2 gathers of 48 KiB a rank where 15 and 1 of 24 KiB
    were charged, with 1 or 2 virtual stages alike."""
    for index in range(first, len(cost.comms)):
        comm = cost.comms[index]
        if comm.dim != "tensor":
            continue
        whole = comm.kind == "all_gather" and cost.stage_share > 0
        cost.comms[index] = replace(comm, messages=comm.messages * microbatches,
                                    elements=comm.elements / cost.stage_share if whole else comm.elements)


register_method(
    MethodSpec(
        name="mixed_parallel",
        config_cls=MixedParallelConfig,
        hooks={Stage.REWRITE: split_and_shard},
        lay_out_dims=lay_out_dims,
        description="3D parallelism: pipeline stages, each sharded over tensor ranks, replicated over data ranks",
        distributed_only=True,
        uses_dims=("tensor", "pipeline", *DATA_PARALLEL_DIMS),
        conflicts={
            # zero1 composes: ZeroRedundancyOptimizer shards each stage's tensor slices' optimizer state
            # over the data ranks holding the same slices (as with pipeline_parallel)
            **dict.fromkeys(("fsdp", "zero2"), "its pipeline stages average gradients over the data ranks themselves; "
                            "the sharding wrappers expect the whole model on every rank (zero1 composes)"),
            **dict.fromkeys(("tensor_parallel", "sequence_parallel", "pipeline_parallel"),
                            "mixed_parallel already splits the model over tensor and pipeline ranks"),
        },
        resolve=resolve,
        layouts=layouts,
        ineligible=ineligible,
        cost_term=cost_term,
        probed=False,  # the stages need the process mesh; cost_term divides the model instead
        probe_units=probe_units,
    )
)
