"""pipeline_parallel: the model split into stages over the ``pipeline`` dim, microbatches run by a
torch.distributed.pipelining schedule (see docs/pipeline.md for the training loop).

Config forms: ``("pipeline_parallel", {"num_microbatches": 4, "schedule": "1f1b"})`` with
``("parallel_mode", ([("pipeline", 2), ("data", N)], None))``. Splits nn.Sequential models and
Llama-style Hugging Face decoder LMs (atorch/pipeline/layouts.py); data parallelism over the data
dims is done by the pipeline model itself (no DDP wrapper).
"""

from collections.abc import Mapping
from dataclasses import replace

import torch

from atorch.auto.context import ModelContext
from atorch.auto.method_spec import LayoutJob, MethodSpec, Stage, register_method
from atorch.auto.step_cost import Comm
from atorch.errors import AtorchConfigError, NotSupportedError
from atorch.pipeline import pipeline_eligibility
from atorch.pipeline.auto import PipelineFields, check_fields, pipeline_model, with_stage_microbatches
from atorch.pipeline.grad_sync import bucket_layout, packed_bytes, summed_params
from atorch.pipeline.layouts import layout_for
from atorch.pipeline.partition import balanced_ranges, ranges_from_cuts
from atorch.pipeline.schedules import check_schedule
from atorch.utils.memo import once


class PipelineParallelConfig(PipelineFields):
    pass


def resolve(model: torch.nn.Module, config: PipelineParallelConfig) -> PipelineParallelConfig:
    check_fields(config)
    layout_for(model)  # a model it cannot split is an error before anything runs
    return config


def split(ctx: ModelContext, config: PipelineParallelConfig) -> None:
    pipeline_model(ctx, config, "pipeline_parallel")


def divisors(n: int) -> list[int]:
    """The sizes above 1 a parallel dim can take on ``n`` ranks."""
    return [d for d in range(2, n + 1) if n % d == 0]


def layouts(world_size: int, model=None) -> list[tuple[dict[str, int], dict]]:
    """Microbatches: as many as stages (the fewest that fill the pipeline) and twice that (half
    the bubble, smaller matmuls); the 1F1B schedule, and interleaved 1F1B with the virtual stages
    of :func:`virtual_choices` (2 halves the bubble and doubles the sends; a model needs 2 x
    stages layers for it: pipeline_ineligible says so otherwise)."""
    return [({"pipeline": p}, {"num_microbatches": m, **({"virtual_pipeline_size": v} if v > 1 else {})})
            for p in divisors(world_size) for m in (p, 2 * p) for v in virtual_choices(p, model)]


def virtual_choices(stages: int, model=None) -> tuple[int, ...]:
    """Virtual stages a rank the search tries on ``stages``: 1, 2 and 4; and where ``model``'s
    layers divide by the stages into more than 4 a stage, the fewest above 4 that divide them and
    one layer each (an 80-layer Llama on 4 stages: 5, NeMo's Llama 3 70B recipe, and 20)."""
    layers = None if model is None else layer_count(model)
    each = layers // stages if layers and layers % stages == 0 else 0
    more = [v for v in range(5, each + 1) if each % v == 0]
    return (1, 2, 4, *sorted({more[0], more[-1]})) if more else (1, 2, 4)


def layer_count(model: torch.nn.Module) -> int | None:
    """The repeated layers PipelineModel balances over stages, or None where no layout splits the
    model without a trace (a traced model's count needs its batch: the 1, 2 and 4 stay)."""
    def count():
        try:
            layout = layout_for(model)
        except (AtorchConfigError, NotSupportedError):
            return None
        return None if getattr(layout, "traced", False) else len(layout.layer_units)

    return once(("pipeline layer count", id(model)), count)


def stage_ranges(model: torch.nn.Module, config: PipelineFields, stages: int) -> list[list[str]]:
    """The units of each stage as PipelineModel will split them (raises when it cannot)."""
    layout = layout_for(model)
    count = stages * config.virtual_pipeline_size
    if config.pipeline_cuts is not None:
        return ranges_from_cuts(layout.units, list(config.pipeline_cuts), count)
    return balanced_ranges(model, layout.units, layout.layer_units, count)


def pipeline_ineligible(model: torch.nn.Module, config: PipelineFields, job: LayoutJob, stages: int) -> str | None:
    """Why ``model`` cannot run in ``stages`` pipeline stages on ``job``'s layout, or None: the
    model is traced (or its layout checked) with a microbatch of the job's first batch where the
    job has one, so a model that cannot split with the batch it will get is ruled out here,
    without a dry run."""
    where = f"pipeline={stages}"
    if job.model_input_format not in (None, "unpack_dict"):
        return (f"{where}: pipeline stages take the batch's fields as keyword arguments (model_input_format "
                f"'unpack_dict'), not {job.model_input_format!r}")
    try:
        check_fields(config)
    except AtorchConfigError as error:
        return f"{where}: {error}"
    batch = job.batch_per_data_rank
    if batch is not None and batch % config.num_microbatches:
        return (f"{where}: {config.num_microbatches} microbatches do not divide the {batch} samples each "
                "data-parallel rank gets per step")
    example = None if job.first_batch is None else job.first_batch()
    if example is not None and not isinstance(example, Mapping):
        return (f"{where}: pipeline stages take the batch's fields as keyword arguments; this job's batches are "
                f"{type(example).__name__}s: make the dataset's samples dicts named as the forward's arguments")
    if config.pipeline_cuts is None:
        count = stages * config.virtual_pipeline_size
        example = None if example is None else _example_microbatch(example)
        names = None if config.input_names is None else tuple(config.input_names)
        key = ("pipeline eligibility", id(model), count, names, _structure(example))
        why = once(key, lambda: pipeline_eligibility(model, count, example, config.input_names))
        if why is not None:
            return f"{where}: {why}"
    return None


def _example_microbatch(batch: Mapping) -> dict:
    """The batch cut to two samples: what any microbatch traces to (torch.export specializes a
    size of 1, not larger ones), the same for every microbatch count, so one trace serves them."""
    return {k: v[:2] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in batch.items()}


def _structure(example: dict | None) -> tuple | None:
    if example is None:
        return None
    return tuple((k, (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v))
                 for k, v in example.items())


def ineligible(model: torch.nn.Module, config: PipelineParallelConfig, job: LayoutJob) -> str | None:
    return pipeline_ineligible(model, config, job, job.dims.get("pipeline", 1))


def _boundary_width(model: torch.nn.Module, names: list[str]) -> tuple[int, bool]:
    """(features of the hidden state a stage hands the next, whether it is in the weights' dtype
    under autocast): what the stage's last unit that holds weights hands on (:func:`_hands_on`;
    an activation after it keeps its dtype). Counted on gloo ranks:
    tests/methods/test_pipeline_parallel.py, test_mixed_parallel_virtual.py."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden:  # a decoder: its residual stream
        return int(hidden), True
    for name in reversed(names):
        found = _hands_on(model.get_submodule(name))
        if found is not None:
            return found
    return 0, True


def _hands_on(unit: torch.nn.Module) -> tuple[int, bool] | None:
    """A Linear hands on its matmul's output, in the compute dtype; an embedding or a norm its
    weights' dtype; a Sequential what its last such module does; any other module that holds
    layers (a block) its residual stream, to which autocast adds the bf16 branch outputs in fp32.
    None for a unit without weights."""
    if isinstance(unit, torch.nn.Linear):
        return unit.out_features, False
    if isinstance(unit, torch.nn.Embedding):
        return unit.embedding_dim, True
    if isinstance(unit, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and unit.normalized_shape:
        return unit.normalized_shape[-1], True
    if isinstance(unit, torch.nn.Sequential):
        return next((found for child in reversed(unit) if (found := _hands_on(child)) is not None), None)
    for module in reversed(list(unit.modules())[1:]):  # a block: the width of its last layer
        found = _hands_on(module)
        if found is not None:
            return found[0], True
    return None


def probe_units(model: torch.nn.Module) -> list[str]:
    """The units a pipeline cuts ``model`` into that hold parameters (the others, rotary tables and
    masks, every stage recomputes)."""
    layout = layout_for(model)
    return [u for u in layout.units if any(True for _ in model.get_submodule(u).parameters())]


def _in_flight(schedule: str, stage: int, stages: int, m: int) -> int:
    """Microbatches stage ``stage`` has run forward and not yet backward at its worst: all of them
    under GPipe; under 1F1B, one per stage from it to the last (the first stage the most)."""
    return m if schedule == "gpipe" else min(m, stages - stage)


def interleaved_held(rank: int, stages: int, virtual: int, m: int) -> list[tuple[tuple[int, ...], bool]]:
    """Under interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``), the microbatches each of
    ``rank``'s ``virtual`` stages holds (run forward, not yet backward) after each of its
    forwards and backwards from the last warm-up forward on (the holding only shrinks after), and
    whether a backward has run by then (the rank's gradients exist).

    The schedule runs ``(virtual - 1) x r + 2 x (stages - 1 - rank)`` warm-up forwards (r: the
    microbatches of a round, ``m // max(1, m // stages)``), capped at all ``m x virtual``; forward
    k is local stage ``(k // r) % virtual``; then one forward, one backward, the backwards from the
    last local stage down. Rank 0 thus holds ``2 x (stages - 1) + 1`` forwards beyond the first
    ``virtual - 1`` rounds: more than 1F1B's ``stages`` microbatches of its layers."""
    per_round = m // max(1, m // stages)
    warmup = min((virtual - 1) * per_round + 2 * (stages - 1 - rank), m * virtual)
    held, out, backward_ran = [0] * virtual, [], False
    for op in range(m * virtual):
        held[(op // per_round) % virtual] += 1
        if op >= warmup - 1:
            out.append((tuple(held), backward_ran))
        if op >= warmup:  # the steady state: a backward after each forward
            held[virtual - 1 - ((op - warmup) // per_round) % virtual] -= 1
            backward_ran = True
            out.append((tuple(held), True))
    if not backward_ran:  # every forward ran first: the first backward frees one of the last stage's
        held[virtual - 1] -= 1
        out.append((tuple(held), True))
    return out


def _held_after_second_backward(flight: int, m: int) -> int:
    """Microbatches a stage holds at the end of its second and later backwards, the most of them,
    when it holds ``flight`` of ``m`` at once (1F1B; GPipe holds all m): one fewer than in flight
    while forwards still follow each backward (flight < m); with every forward run first, m - 2
    after the second backward."""
    return flight - 1 if flight < m else max(m - 2, 0)


def _stage_moments(spans, ranges: list[list[str]], stages: int, m: int, schedule: str,
                   unit_params: dict[str, int] | None = None) -> tuple | None:
    """The worst moments of any pipeline rank, from the probe's unit spans (None without them), as
    ``StepCost.activation_profile`` takes them: (activations as a share of the whole step's on the
    same batch, share of the rank's gradients alive, share of autocast's weight copies alive: all,
    as the whole schedule runs in one autocast region, which casts each weight once).

    Each (virtual) stage keeps, per microbatch in flight, its units' ``kept`` share of a
    microbatch (the last stage also the model's output: the schedule holds it for the backward,
    where the probe's step had dropped it); and, for the one microbatch it runs, the most its
    units had alive beyond the earlier units' kept (a checkpointed block recomputed, the head's
    logits and loss). The probe
    ran the whole batch; a microbatch is 1/m of it. With more microbatches than a rank holds, it
    runs another forward after each backward: it holds them all while the gradients exist. Else
    its first backward runs before any gradient exists, and the later ones with one fewer held.

    With m > 1 and ``unit_params`` (each unit's parameter count), in the second and later
    backwards of a stage the low-precision gradients of autocast's weight copies pile up: the
    copies are cast once per step, in the first microbatch's forward, so their casts' backward
    nodes are older than every node of a later microbatch's backward, and autograd runs the newest
    ready node first: the casts' last. In a unit's backward the gradients of its copies and of the
    copies of the units after it are alive (a copies share of 1 + their parameters' share), beside
    that unit's activations. On search_quality's pipeline-best Llama, amp + checkpoint on 2 stages
    peaked at the end of the second backward, the bf16 gradients of the stage's weights alive
    (1.53 MiB): estimated 0.92 of the measured peak without these moments. Not followed under the
    interleaved schedule (each virtual stage's copies are cast at its own first forward)."""
    if not spans:
        return None
    order = {span.name: i for i, span in enumerate(spans)}
    if any(not any(name in order for name in names) for names in ranges):
        return None  # a stage none of whose units the probe saw: not the split it measured
    moments = []
    for rank in range(stages):
        chunks, extra, backwards = [], 0.0, []
        for index in range(rank, len(ranges), stages):  # interleaved: stages r, r + p, ...
            own = [spans[order[name]] for name in ranges[index] if name in order]
            first = min(order[span.name] for span in own)
            base = sum(span.kept for span in spans[:first])  # the earlier stages' microbatch
            stage_kept = sum(span.kept + span.output for span in own)
            chunks.append(stage_kept)
            peak = max(max(span.forward_peak, span.backward_peak + span.output) for span in own)
            extra = max(extra, peak - base - stage_kept)
            # each unit's backward beyond the kept, and its parameters, in backward order
            backwards += [(span.backward_peak + span.output - base - stage_kept, (unit_params or {}).get(span.name, 0))
                          for span in reversed(own)]
        if schedule == "interleaved":
            worst: dict[bool, float] = {}
            for held, backward_ran in interleaved_held(rank, stages, len(chunks), m):
                alive = sum(n * k for n, k in zip(held, chunks))
                worst[backward_ran] = max(worst.get(backward_ran, 0.0), alive)
            moments += [((alive + extra) / m, float(grads), 1.0) for grads, alive in sorted(worst.items())]
            continue
        kept = sum(chunks)
        flight = _in_flight(schedule, rank, stages, m)
        if flight < m:
            moments.append(((flight * kept + extra) / m, 1.0, 1.0))
        else:
            moments += [((flight * kept + extra) / m, 0.0, 1.0), (((flight - 1) * kept + extra) / m, 1.0, 1.0)]
        if m > 1 and unit_params:  # a later backward, the copies' low-precision gradients waiting
            held = _held_after_second_backward(flight, m)  # besides the microbatch whose backward runs
            total, after = max(sum(n for _, n in backwards), 1), 0
            for beyond, params in backwards:
                after += params
                # of the running microbatch, what the probe had alive in this unit's backward (the
                # units after it have freed theirs)
                moments.append(((held * kept + max(kept + beyond, 0.0)) / m, 1.0, 1.0 + after / total))
    return tuple(moments)


def _stage_sizes(model, ranges: list[list[str]], stages: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(parameters of each stage, and of each rank's stages the data-parallel sum's collectives and
    packed bucket bytes: atorch.pipeline.grad_sync's buckets, each stage's own)."""
    sizes = [sum(p.numel() for name in names for p in model.get_submodule(name).parameters()) for names in ranges]
    return sizes, [_sync_of(*(_trainable(model, names) for names in ranges[rank::stages])) for rank in range(stages)]


def _sync_of(*stage_params: list) -> tuple[int, int]:
    """(collectives, packed bytes) of the data ranks' sum of stages holding ``stage_params``."""
    buckets = [bucket for params in stage_params for bucket in bucket_layout(params)]
    return len(buckets), packed_bytes(buckets)


def _trainable(model, names: list[str]) -> list:
    """The parameters of units ``names`` the data ranks sum, as PipelineModel picks them."""
    return summed_params(model.get_submodule(name) for name in names)


def sync_window(schedule: str, stages: int, m: int, v: int, hooked: bool = True) -> float:
    """The share of a rank's backward compute its data-parallel sums can run behind
    (atorch.pipeline.grad_sync): after the deepest of its ``v`` stages runs its last microbatch,
    an interleaved schedule still runs backward for ``min(stages, m)`` microbatches of each of the
    others; the last stage's sums start as that last backward reaches each bucket (``hooked``, a
    full backward; a zero-bubble schedule's weight pass fills them all at its end, and torch's
    schedules reduce-scatter FSDP2's gradients after a stage's last backward, not during it)."""
    own_last = 1 if hooked and schedule not in ("zero_bubble", "zbv") else 0
    return min(1.0, ((v - 1) * min(stages, m) + own_last) / (m * v))


def _grad_sync_terms(cost, calls: int, packed: int, window: float) -> None:
    """The data ranks' sums (atorch.pipeline.grad_sync): an all-reduce a bucket, started at each
    stage's last microbatch and hidden only behind the backward that runs after it; the packed
    buckets' buffers, beside the gradients after backward."""
    cost.sync_calls = {"all_reduce": calls}
    if cost.dp_size > 1:  # alive with the whole gradients, from the last microbatch's backward on
        cost.reduce_temp = max(cost.reduce_temp, packed)
    cost.sync_overlap, cost.sync_window = {"all_reduce": ("backward",)}, {"all_reduce": window}


def _uniform_moments(schedule: str, stages: int, m: int, v: int) -> tuple:
    """The first stage's worst moments as (share of a batch's activations on the rank, share of
    its gradients, share of the copies) when every microbatch and stage holds the same: what
    :func:`_stage_moments` finds from measured spans, without them. A planned 7B on 4 stages had
    left the stage's gradients out of its 1F1B peak (6.5 GiB a rank)."""
    if schedule == "interleaved":
        worst: dict[bool, float] = {}
        for held, backward_ran in interleaved_held(0, stages, v, m):
            worst[backward_ran] = max(worst.get(backward_ran, 0.0), sum(held) / v)
        return tuple((alive / m, float(grads), 1.0) for grads, alive in sorted(worst.items()))
    flight = _in_flight(schedule, 0, stages, m)
    if flight < m:  # it runs another forward after each backward: all held while gradients exist
        return ((flight / m, 1.0, 1.0),)
    return ((flight / m, 0.0, 1.0), ((flight - 1) / m, 1.0, 1.0))


def pipeline_terms(cost, config: PipelineFields, stages: int, grad_sync: bool = True) -> None:
    """Memory and time of ``stages`` pipeline stages: a rank keeps its stages' share of the model;
    a schedule keeps some microbatches' activations in flight and idles (p-1)/(m v) of the time;
    stages send each microbatch's hidden state forward and its gradient back. With ``grad_sync``,
    PipelineModel's sum of the gradients over the data ranks (not DeepSpeed's engine's)."""

    cost.grad_buckets = False  # the pipeline model sums the gradients itself: no DDP
    schedule = check_schedule(config.schedule, config.virtual_pipeline_size)
    cuts = None if config.pipeline_cuts is None else tuple(config.pipeline_cuts)
    ranges = once(("stage_ranges", id(cost.model), stages, config.virtual_pipeline_size, cuts),
                  lambda: stage_ranges(cost.model, config, stages))
    sizes, syncs = once(("stage sizes", id(cost.model), stages, config.virtual_pipeline_size, cuts),
                        lambda: _stage_sizes(cost.model, ranges, stages))
    per_rank = [sum(sizes[r::stages]) for r in range(stages)]  # interleaved: rank r runs stages r, r+p, ...
    share = max(per_rank) / max(sum(sizes), 1)
    busiest = per_rank.index(max(per_rank))
    cost.pipeline_stage = (tuple(tuple(units) for units in ranges[busiest::stages]), config.num_microbatches)
    cost.split_model(share)
    cost.stage_share *= share
    m, v = config.num_microbatches, config.virtual_pipeline_size
    # expert_parallel's traffic (charged for every MoE block): the rank's stages' blocks only; its
    # all-to-alls once per microbatch, its copies' average once a step
    cost.comms = [replace(c, elements=c.elements * share,
                          messages=max(1, round(c.messages * share * (m if c.kind == "send_recv" else 1))))
                  if c.method == "expert_parallel" else c for c in cost.comms]
    if grad_sync:
        _grad_sync_terms(cost, *syncs[busiest], sync_window(schedule, stages, m, v))
        # fsdp/zero2 beside it: FSDP2's reduce-scatters run after each stage's last backward
        cost.sync_window["reduce_scatter"] = sync_window(schedule, stages, m, v, hooked=False)
    params = {span.name: sum(p.numel() for p in cost.model.get_submodule(span.name).parameters())
              for span in cost.unit_spans}
    moments = _stage_moments(cost.unit_spans, ranges, stages, m, schedule, params)
    if moments is None:  # no spans (meta tensors, a probe that did not see the units): the first
        # stage's microbatches in flight, each with the rank's share of the activations, and the
        # stage's gradients beside them once a backward has run
        cost.activations *= share
        cost.activation_profile = _uniform_moments(schedule, stages, m, v)
    else:
        cost.activation_profile = moments
    cost.compute_share *= share
    cost.op_share *= share * m  # each microbatch runs the rank's layers: m times their operators
    cost.bubble += (stages - 1) / (m * v)
    cost.microbatches = m
    width, stream = _boundary_width(cost.model, ranges[0])
    # Per microbatch, each of a rank's stages receives its input and sends its output forward, and
    # the gradients back: 4 sends and receives, 2 at the pipeline's first and last stage. The
    # busiest rank: a middle one (4 v), or with 2 ranks either (4 v - 2). Counted on 4 gloo ranks
    # (tests/methods/test_mixed_parallel_virtual.py): 2 v had been charged, 12 against 8 for
    # tensor=2 x pipeline=2 with 2 virtual stages and 2 microbatches, 16 against 8 for a middle
    # rank of pipeline=4 with 4.
    hops = 4 * v - (2 if stages == 2 else 0) if stages > 1 else 0  # one stage (mixed_parallel's): none
    if hops:
        cost.comms.append(Comm("pipeline", hops * cost.tokens * width, hops * m, kind="send_recv",
                               stream=stream))
    # the schedule's host overhead, calibrated per stage-microbatch a rank runs (its forward and
    # backward actions, their sends and the schedule's Python): charged per send, pipeline=4 was
    # estimated at 3x its measured step on search_quality's small Llama
    cost.charge("pipeline_parallel", m * v)


def lay_out_dims(config: PipelineParallelConfig, world_size: int, dims: list) -> tuple[PipelineParallelConfig, list]:
    """At plan time, with the pipeline dim known: the short form takes as many microbatches as
    stages (``["parallel_mode", "pipeline_parallel"]`` on 4 ranks: 4 stages, 4 microbatches)."""
    return with_stage_microbatches(config, dict(dims).get("pipeline", 1)), dims


def cost_term(config: PipelineParallelConfig, cost) -> None:
    pipeline_terms(cost, config, cost.size("pipeline"))


register_method(
    MethodSpec(
        name="pipeline_parallel",
        config_cls=PipelineParallelConfig,
        hooks={Stage.REWRITE: split},
        description="pipeline parallelism: stages over the pipeline dim, microbatch schedules (1F1B, interleaved...)",
        distributed_only=True,
        uses_dims=("pipeline",),
        needs_dims=("pipeline",),
        conflicts={
            # zero1, zero2 and fsdp compose: ZeroRedundancyOptimizer shards the stage's optimizer state
            # over the data ranks of that stage (Megatron's distributed optimizer beside its pipeline);
            # FSDP2 shards each stage (its blocks, then the stage as the root) over them, and the stage
            # reduce-scatters its gradients after the last microbatch (torchtitan's FSDP x PP)
            **dict.fromkeys(("tensor_parallel", "sequence_parallel"), "tensor x pipeline is mixed_parallel; use it"),
        },
        resolve=resolve,
        lay_out_dims=lay_out_dims,
        layouts=layouts,
        ineligible=ineligible,
        cost_term=cost_term,
        probed=False,  # the stages need the process mesh; cost_term divides the model instead
        probe_units=probe_units,
    )
)
