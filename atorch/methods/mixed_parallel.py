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

``sequence_parallel=True`` (Llama-style models, tensor_size > 1) runs Megatron's sequence
parallelism inside every stage, as ``sequence_parallel`` does beside ``tensor_parallel``: the
norms, residual adds and the activations between the split layers stay on each tensor rank's
chunk of the sequence, from the model's first block to its head, and the stages hand each other
those chunks (a tensor rank's share of the hidden states, not the whole).
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
from atorch.methods.tensor_parallel import shard_plan, tensor_activations, tensor_ineligible, tensor_terms
from atorch.parallel_layers.auto_shard import ShardingError, shard_model
from atorch.pipeline.auto import PipelineFields, check_fields, pipeline_model, with_stage_microbatches
from atorch.pipeline.layouts import is_decoder_lm, layout_for
from atorch.utils.memo import once
from atorch.utils.modules import first_block


class MixedParallelConfig(PipelineFields):
    tensor_size: int | None = Field(default=None, ge=1, description="tensor-parallel ranks; None: chosen")
    pipeline_size: int | None = Field(default=None, ge=1, description="pipeline stages' ranks; None: chosen")
    sequence_parallel: bool = Field(
        default=False, description="sequence parallelism inside each stage: norms and residual adds on the tensor "
        "ranks' chunks of the sequence (Llama-style models, tensor_size > 1)")


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
    if not (config.tensor_size and config.pipeline_size):  # else planning laid them out (lay_out_dims)
        tensor, pipeline = choose_sizes(env.world_size(), config.tensor_size, config.pipeline_size)
        config = config.model_copy(update={"tensor_size": tensor, "pipeline_size": pipeline})
    if config.sequence_parallel:
        why = sequence_problem(model, config.tensor_size)
        if why is not None:
            raise MethodConfigError(f"mixed_parallel: sequence_parallel=True: {why}; leave sequence_parallel out")
    return config


def sequence_problem(model: torch.nn.Module, tensor: int) -> str | None:
    """Why mixed_parallel cannot run sequence parallelism on ``model`` over ``tensor`` ranks: no
    tensor ranks, a model without a decoder layout (its stages are not cut between whole blocks of a
    Llama-style model), or one sequence_parallel does not support. Once per model and size while
    a search or plan costs its candidates (atorch.utils.memo)."""
    if tensor <= 1:
        return "sequence parallelism needs tensor ranks (tensor_size > 1)"
    return once(("mixed sequence problem", id(model), tensor), lambda: _sequence_problem(model, tensor))


def _sequence_problem(model: torch.nn.Module, tensor: int) -> str | None:
    from atorch.parallel_layers.auto_shard import sequence_parallel_problem

    if not is_decoder_lm(model):
        return (f"{type(model).__name__} is not a Llama-style decoder LM (embed_tokens, layers, norm, lm_head), the "
                "only stages sequence parallelism runs in")
    return tensor_ineligible(model, tensor) or sequence_parallel_problem(model, shard_plan(model, tensor))


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
    sequence = config.sequence_parallel and tensor > 1
    first = first_block(ctx.model) if sequence else None

    def shard(stage_module):
        # under sequence parallelism the stage holding the model's first block splits the
        # sequence there; every later stage receives its tensor rank's chunk
        holds_first = first is not None and any(m is first for m in stage_module.modules())
        try:
            shard_model(stage_module, group, tensor, sequence_parallel=sequence,
                        sequence_entry=first if holds_first else None)
        except ShardingError as error:
            raise MethodConfigError(f"mixed_parallel: {error}") from None
        if sequence and not holds_first:
            stage_module.sequence_parts = tensor

    pipeline_model(ctx, config, "mixed_parallel", stage_transform=shard if tensor > 1 else None)


def layouts(world_size: int, model=None) -> list[tuple[dict[str, int], dict]]:
    # tensor x pipeline, both above 1 (one of them alone is tensor_parallel or pipeline_parallel);
    # microbatches and virtual stages (interleaved 1F1B) as for pipeline_parallel; each with and
    # without sequence parallelism on a Llama-style decoder (the only one it runs on)
    sequence = [False, True] if model is not None and is_decoder_lm(model) else [False]
    return [({"tensor": t, **dims}, {"tensor_size": t, "pipeline_size": dims["pipeline"], **config,
                                     **({"sequence_parallel": True} if sp else {})})
            for t in divisors(world_size) for dims, config in pipeline_layouts(world_size // t, model)
            for sp in sequence]


def ineligible(model: torch.nn.Module, config: MixedParallelConfig, job: LayoutJob) -> str | None:
    why = (tensor_ineligible(model, job.dims.get("tensor", 1))
           or pipeline_ineligible(model, config, job, job.dims.get("pipeline", 1)))
    if why is None and config.sequence_parallel and model is not None:
        why = sequence_problem(model, job.dims.get("tensor", 1))
    if why is None and getattr(layout_for(model), "traced", False):
        why = (f"tensor={job.dims.get('tensor', 1)} x pipeline={job.dims.get('pipeline', 1)}: mixed_parallel shards "
               f"stages built from a layout, and no layout knows {type(model).__name__} (only a trace of its "
               "forward splits it: pipeline_parallel)")
    return why


def cost_term(config: MixedParallelConfig, cost) -> None:
    # A tensor rank's unit spans first, from which the stages build their moments; then the stages,
    # as the tensor term's communication counts only the rank's own stage's layers.
    tensor = cost.size("tensor")
    sequence = config.sequence_parallel and tensor > 1
    tensor_activations(cost, tensor, sequence)
    pipeline_terms(cost, config, cost.size("pipeline"))
    if sequence:  # the stages hand each other a tensor rank's chunk of the sequence
        cost.comms = [replace(c, elements=c.elements / tensor) if c.dim == "pipeline" and c.kind == "send_recv"
                      else c for c in cost.comms]
    first = len(cost.comms)
    tensor_terms(cost, tensor, sequence_parallel=sequence, activations=False)
    if cost.size("pipeline") > 1 or config.num_microbatches > 1:  # one stage runs its microbatches too
        _per_microbatch(cost, first, config.num_microbatches, sequence)


def _per_microbatch(cost, first: int, microbatches: int, sequence: bool = False) -> None:
    """The tensor collectives ``tensor_terms`` charged (``cost.comms[first:]``) as a pipeline
    runs them: each microbatch runs its stages' layers, and their collectives, once (the bytes
    were the whole batch's already, except those of a collective each micro-batch makes alike,
    such as a norm weight's gradient under sequence parallelism); the head's logit gather (the
    all-gather without sequence parallelism, a Comm of its own with it) runs whole on the last
    stage, not a stage's share of it. On tensor=2 x pipeline=2 with 2 microbatches (4 gloo ranks)
    the code made 30 all-reduces and 2 gathers of 48 KiB a rank where 15 and 1 of 24 KiB were
    charged, with 1 or 2 virtual stages alike."""
    for index in range(first, len(cost.comms)):
        comm = cost.comms[index]
        if comm.dim != "tensor":
            continue
        elements = comm.elements * (microbatches if comm.each_micro_batch else 1)
        if not sequence and comm.kind == "all_gather" and cost.stage_share > 0:
            elements /= cost.stage_share
        cost.comms[index] = replace(comm, messages=comm.messages * microbatches, elements=elements,
                                    each_micro_batch=False)


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
