"""expert_parallel: the routed experts of a mixture-of-experts model spread over the data ranks.

``("expert_parallel", None)`` splits each MoE block's routed experts over as many data-parallel
ranks as divide both the ranks and the experts; ``{"size": n}`` over groups of n of them (the
experts' slices then repeat over data / n groups, whose gradients are averaged). Tokens reach
their experts and come back by all-to-all (atorch/parallel_layers/expert_dispatch.py); the
router, the shared experts and every other weight stay data-parallel, replicated under DDP or
sharded under ``fsdp`` (the experts' slices stay out of its units: atorch/sharding/fsdp2.py
``held_per_rank``). No token is dropped unless ``capacity_factor`` is set: the result equals
the serial model's.

Two shapes of experts: the fused experts of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE: ``gate_up_proj`` / ``down_proj`` of shape ``[experts, ...]``), and a ModuleList of expert
MLPs beside a router, whose block is computed as it computes itself (checked on a probe:
atorch/parallel_layers/expert_list.py). The methods that shard or split weights otherwise are
refused with the reason, and so is a model without such experts. Beside tensor_parallel the
experts split over the data ranks of each tensor rank; in a pipeline (pipeline_parallel,
mixed_parallel) over the data ranks of each stage.
"""

import math

import torch
import torch.distributed as dist
from pydantic import Field

from atorch.auto.config_types import MethodConfig
from atorch.auto.context import ModelContext
from atorch.auto.method_spec import MethodSpec, Stage, register_method
from atorch.errors import MethodConfigError, WorldSizeError
from atorch.utils.log import logger

NOT_YET = ("expert_parallel splits the experts over data ranks under DDP, fsdp, zero1 or zero2, beside tensor "
           "and pipeline stages, in this version; {0} shards or splits the weights another way; remove one of "
           "them (fsdp, zero1 or zero2 shard the other weights, tensor_parallel splits attention)")
# zero1 and zero2 on DeepSpeed or fairscale declare their own conflict with expert_parallel
_CONFLICTS = {name: NOT_YET.format(name) for name in (
    "sequence_parallel",
    "ds_3d_parallel", "genomic_bottleneck")}


SHARDERS = ("fsdp", "zero2")  # FSDP2 sharding methods the experts' slices compose with


class ExpertParallelConfig(MethodConfig):
    size: int | None = Field(default=None, ge=2, description="ranks in each expert group; None: as many data "
                                                            "ranks as divide the experts")
    capacity_factor: float | None = Field(
        default=None, gt=0, description="each expert takes at most ceil(factor x pairs / experts) (token, choice) "
                                        "pairs from each rank, the rest dropped (then not equal to serial); None: "
                                        "no pair dropped", json_schema_extra={"omitted_at_default": True})


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The routed experts by name, checked by structure: fused experts this dispatch computes, or a
    ModuleList beside a router (whose routing is checked against the block's own forward when
    it is sharded: :func:`atorch.parallel_layers.expert_list.match_block`)."""
    from atorch.parallel_layers.expert_dispatch import fused_shape
    from atorch.parallel_layers.experts import expert_count, routed_experts

    found = routed_experts(model)
    if not found:
        raise MethodConfigError(f"expert_parallel: {type(model).__name__} has no routed experts (a mixture-of-"
                                "experts block: fused expert weights, or an experts ModuleList beside a router)")
    for name, module in found.items():
        why = None if isinstance(module, torch.nn.ModuleList) else fused_shape(module)
        if why is not None:
            raise MethodConfigError(f"expert_parallel: {name}: {why}")
    counts = {expert_count(module) for module in found.values()}
    if len(counts) != 1:
        raise MethodConfigError(f"expert_parallel: the MoE blocks hold different numbers of experts {sorted(counts)}")
    return found


def _count(found: dict[str, torch.nn.Module]) -> int:
    """How many experts each MoE block holds (``_experts`` checked they agree)."""
    from atorch.parallel_layers.experts import expert_count

    return expert_count(next(iter(found.values())))


def _hidden(model: torch.nn.Module, found: dict[str, torch.nn.Module]) -> int:
    """The width of the hidden states the experts take."""
    from atorch.parallel_layers.expert_list import in_features

    module = next(iter(found.values()))
    if not isinstance(module, torch.nn.ModuleList):
        return module.gate_up_proj.shape[-1]
    return getattr(getattr(model, "config", None), "hidden_size", None) or in_features(module[0]) or 0


def resolve(model: torch.nn.Module, config: ExpertParallelConfig) -> ExpertParallelConfig:
    experts = _count(_experts(model))
    if config.size is not None and experts % config.size:
        raise MethodConfigError(f"expert_parallel: size {config.size} does not divide the {experts} experts; pick "
                                f"a size that divides {experts}")
    return config


def group_size(data: int, experts: int, size: int | None) -> int:
    """The ranks of one expert group among ``data`` data-parallel ranks."""
    if size is None:
        return math.gcd(data, experts)
    if data % size:
        raise WorldSizeError(f"expert_parallel: size {size} does not divide the {data} data-parallel ranks; pick a "
                             f"size that divides {data}")
    return size


def _groups(size: int):
    """(this rank's expert group, its replicas group), inside each data-parallel group (one per
    tensor rank under tensor_parallel): consecutive data ranks hold the experts' slices; every
    rank takes part in creating every group, as torch requires."""
    from atorch.parallel_state import get_data_parallel_group

    rank, mine, replicas = dist.get_rank(), None, None
    for ranks in get_data_parallel_group(as_list=True):
        for first in range(0, len(ranks), size):
            group = dist.new_group(ranks[first:first + size])
            mine = group if rank in ranks[first:first + size] else mine
        for offset in range(size):
            group = dist.new_group(ranks[offset::size])
            replicas = group if rank in ranks[offset::size] else replicas
    return mine, replicas


def shard(ctx: ModelContext, config: ExpertParallelConfig) -> None:
    from torch.nn.parallel import DistributedDataParallel

    topology = ctx.topology
    data = topology.data_parallel_size
    if dist.get_world_size() != data * topology.size("tensor") * topology.size("pipeline"):
        raise MethodConfigError("expert_parallel runs over data-parallel ranks, beside tensor and pipeline ones, in "
                                "this version; parallel_mode has other dims: give it data, tensor and pipeline "
                                "ranks only")
    found = _experts(ctx.model)
    experts = _count(found)
    size = group_size(data, experts, config.size)
    if size < 2:
        logger.warning("expert_parallel: %d data ranks and %d experts share no divisor above 1: experts stay whole",
                       data, experts)
        return
    routed = _routed_blocks(ctx.model, found)  # checked on every block before any is changed
    _start_from_the_first_rank(found, topology.data_parallel_group)
    group, replicas = _groups(size)
    # under fsdp or zero2 (FSDP2), slices held by several ranks are sharded over those copies (EP x FSDP)
    sharded = ctx.strategy is not None and any(ctx.strategy.get(name) is not None for name in SHARDERS)
    copies_of = data if sharded and size < data else None
    for name, module in found.items():
        _shard_one(module, routed.get(name), group, replicas, config.capacity_factor, copies_of)
    ignored = [name for name, p in ctx.model.named_parameters() if getattr(p, "expert_parallel", False)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ctx.model, ignored)
    logger.info("expert_parallel: %d experts over groups of %d ranks (%d a rank) in %d MoE blocks", experts, size,
                experts // size, len(found))


def _start_from_the_first_rank(found: dict, data_group) -> None:
    """Every rank slices the first data rank's experts, as DDP and fsdp start every other weight
    from it (they leave the slices alone): without it, ranks that built their model from other
    seeds would hold slices of different models, and copies of one slice would differ for good."""
    source = dist.get_global_rank(data_group, 0)
    with torch.no_grad():
        for module in found.values():
            for param in module.parameters():
                dist.broadcast(param.data, src=source, group=data_group)


def _routed_blocks(model: torch.nn.Module, found: dict) -> dict:
    """For each ModuleList of experts, the RoutedBlock that computes its block as the block does."""
    from atorch.parallel_layers.expert_list import match_block
    from atorch.parallel_layers.experts import block_of

    routed = {}
    for name, module in found.items():
        if isinstance(module, torch.nn.ModuleList):
            routed[name], why = match_block(block_of(model, name), module, getattr(model, "config", None))
            if why is not None:
                raise MethodConfigError(f"expert_parallel: {name}: {why}")
    return routed


def _shard_one(module: torch.nn.Module, routed, group, replicas, capacity_factor, copies_of) -> None:
    from atorch.parallel_layers.expert_dispatch import over_copies, shard_fused_experts
    from atorch.parallel_layers.expert_list import shard_listed_experts

    if routed is None:
        shard_fused_experts(module, group, replicas, capacity_factor, hooks=copies_of is None)
        if copies_of is not None:
            over_copies(module, group, replicas, copies_of)
    else:
        shard_listed_experts(routed.block, module, routed, group, replicas, capacity_factor, copies_of)


def has_experts(model: torch.nn.Module) -> bool:
    from atorch.parallel_layers.experts import routed_experts

    return bool(routed_experts(model))


def ineligible(model: torch.nn.Module, config: ExpertParallelConfig, job) -> str | None:
    """Why the search cannot use expert_parallel on this layout: the model's experts are not the
    fused kind, or its data ranks and experts share no divisor above 1."""
    try:
        found = _experts(model)
    except MethodConfigError as error:
        return str(error)
    data = job.dims.get("data", 1)
    experts = _count(found)
    if any(size > 1 for name, size in job.dims.items() if name not in ("data", "tensor", "pipeline")):
        return "expert_parallel runs over data-parallel ranks, beside tensor and pipeline ones, only in this version"
    try:
        if group_size(data, experts, config.size) < 2:
            return f"expert_parallel: {data} data ranks and {experts} experts share no divisor above 1"
    except WorldSizeError as error:
        return str(error)
    return None


def idle_on_layout(model: torch.nn.Module, config: ExpertParallelConfig, dims: dict[str, int]) -> str | None:
    """Why expert_parallel would leave the experts whole on these dims: the data ranks and the
    experts share no divisor above 1 (then it is dropped, with this note, before anything runs)."""
    from atorch.distributed.topology import DATA_PARALLEL_DIMS

    data = math.prod(size for name, size in dims.items() if name in DATA_PARALLEL_DIMS)
    experts = _count(_experts(model))
    if config.size is None and math.gcd(data, experts) < 2:
        return (f"its {data} data ranks and the {experts} experts share no divisor above 1, so every rank would "
                "keep every expert; use a number of data ranks that shares a factor with the experts")
    return None


def cost_term(config: ExpertParallelConfig, cost) -> None:
    """Memory: a rank keeps 1 / size of the routed experts' weights, gradients and optimizer state,
    held apart from the data ranks (``StepCost.held_apart``: fsdp does not shard them, the data
    sync does not carry them). Time: each MoE block sends every (token, choice) pair's hidden
    state to its expert's rank and back in forward, and both again in backward: 4 all-to-alls of
    tokens x choices x hidden elements, of which (size - 1) / size leave the rank, plus forward's
    2 small ones (counts, ids). An all-to-all is priced at the point-to-point rate
    (``send_recv``): each rank sends its pieces straight to the others. Groups smaller than the
    data ranks average each slice's gradients over its copies once a step (a ring all-reduce of
    the rank's experts), or under fsdp shard it over them (:func:`_copies_sync`). Load
    imbalance: the experts' FLOPs grow by the busiest rank's expected excess under random routing
    (``atorch.auto.load_imbalance.busiest_excess``, per micro-batch: ``StepCost.imbalance_flops``)."""
    from atorch.auto.step_cost import Comm
    from atorch.parallel_layers.experts import routed_experts

    found = routed_experts(cost.model)
    if not found:
        return
    experts = _count(found)
    size = group_size(cost.dp_size, experts, config.size)
    if size < 2:
        return
    routed = sum(p.numel() * p.element_size() for module in found.values() for p in module.parameters())
    fraction = routed / max(cost.param_bytes(), 1)
    cost.split_layers(fraction * (1 - 1 / size))
    cost.held_apart = fraction / size / cost.split  # of the rank's piece (a later tensor split grows it)
    from atorch.parallel_layers.experts import expert_choices

    choices = expert_choices(cost.model)
    hidden = _hidden(cost.model, found)
    leaving = (size - 1) / size
    blocks = len(found)
    # fsdp under amp hands each block bf16 inputs (its mixed-precision policy casts them): the
    # dispatched hidden states are 2-byte; under autocast alone they stay in the weights' dtype,
    # the residual stream's (``stream``: read once amp_native's and half's terms have run, after this one)
    fsdp2 = bool(set(SHARDERS) & set(cost.methods))
    width = 0.5 if fsdp2 and "amp_native" in cost.methods and "half" not in cost.methods else 1.0
    cost.comms.append(Comm("data", 4 * blocks * cost.tokens * choices * hidden * leaving * width, 6 * blocks,
                           kind="send_recv", method="expert_parallel", stream=True))
    # the busiest rank's excess, per micro-batch once accumulation and microbatches are known
    cost.expert_imbalance = (blocks * cost.tokens * choices * _pair_flops(found), cost.tokens * choices, size)
    copies = cost.dp_size // size
    if copies > 1:
        _copies_sync(cost, found, routed, size, copies, fsdp2)


def _pair_flops(found: dict) -> float:
    """Forward FLOPs of one (token, choice) pair through one expert: 2 per weight of an expert."""
    module = next(iter(found.values()))
    if isinstance(module, torch.nn.ModuleList):
        return 2.0 * sum(p.numel() for p in module[0].parameters())
    return 2.0 * (module.gate_up_proj[0].numel() + module.down_proj[0].numel())


def _copies_sync(cost, found: dict, routed: int, size: int, copies: int, fsdp2: bool) -> None:
    """The sync of a slice held by ``copies`` ranks (``routed``: the experts' bytes, all ranks'):
    under fsdp or zero2 sharded over them (its own unit in each block, or each of its experts':
    gathered in forward, and again in backward under fsdp, its gradients reduce-scattered, in
    FSDP's dtypes), else one all-reduce a weight of the rank's experts' gradients."""
    from atorch.auto.step_cost import Comm

    local = routed * cost.weight_scale / size  # bytes: the Comms below count bytes (element_bytes=1)
    units = sum(len(m) // size if isinstance(m, torch.nn.ModuleList) else 1 for m in found.values())
    if not fsdp2:  # one all-reduce per weight of the slice: 2 a fused block, each local expert's own
        weights = sum(len(list(m[0].parameters())) * len(m) // size if isinstance(m, torch.nn.ModuleList)
                      else len(list(m.parameters(recurse=False))) for m in found.values())
        cost.comms.append(Comm("data", local, weights, factor=2 * (copies - 1) / copies, method="expert_parallel",
                               element_bytes=1, per_step=True))  # held until the last micro-batch
        return
    cost.apart_copies = copies
    amp = "amp_native" in cost.methods
    gathered = local * (min(1.0, 2 / cost.element_bytes()) if amp else 1.0)  # gathered in amp's 2 bytes
    leaving = (copies - 1) / copies
    gathers = 2 if "fsdp" in cost.methods else 1  # fsdp regathers for backward (reshard_after_forward); zero2 keeps
    # gathered again in every micro-batch; reduce-scattered once a step (its sync held until the last)
    cost.comms.append(Comm("data", gathers * gathered, gathers * units, factor=leaving, kind="all_gather",
                           each_micro_batch=True, element_bytes=1))
    cost.comms.append(Comm("data", local, units, factor=leaving, kind="reduce_scatter", element_bytes=1,
                           per_step=True))


register_method(
    MethodSpec(
        name="expert_parallel",
        config_cls=ExpertParallelConfig,
        hooks={Stage.REWRITE: shard},
        description="expert parallelism: routed experts split over data ranks, tokens routed by all-to-all",
        distributed_only=True,
        needs_data_parallel=True,
        conflicts=_CONFLICTS,
        resolve=resolve,
        cost_term=cost_term,
        search_space=({},),
        applies_to=has_experts,
        ineligible=ineligible,
        idle_on_layout=idle_on_layout,
        decided_by=("collectives",),
        probed=False,  # its groups and all-to-alls need the ranks; cost_term divides the experts instead
    )
)
