"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied to a model in units chosen by class,
size, or trainability; shared by the fsdp and zero2 methods."""

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# torch.distributed.fsdp imports torch.distributed.tensor and torch._dynamo (0.5 s): imported in
# the functions that shard, not when the method registry loads (`atorch validate`).
if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

from atorch.auto.config_types import class_matches
from atorch.errors import AtorchConfigError, NotSupportedError


def _matches(module: torch.nn.Module, names: Sequence[str]) -> bool:
    return any(class_matches(type(module), name) for name in names)


def _has_forward(module: torch.nn.Module) -> bool:
    return type(module).forward is not torch.nn.Module.forward


def _trainable_outmost(model: torch.nn.Module) -> list[str]:
    """The outermost submodules whose parameters are all trainable (LoRA adapters in a frozen model)."""
    found: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        params = list(module.parameters())
        # Containers (ModuleDict, ModuleList) have no forward for FSDP to hook: look inside them.
        if prefix and params and all(p.requires_grad for p in params) and _has_forward(module):
            found.append(prefix)
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return found


def _size_based(model: torch.nn.Module, min_num_params: int, already: set[str]) -> list[str]:
    """Post-order: a module whose not-yet-covered parameters reach ``min_num_params`` becomes a unit."""
    found: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> int:
        uncovered = sum(p.numel() for p in module.parameters(recurse=False))
        for name, child in module.named_children():
            uncovered += visit(f"{prefix}.{name}" if prefix else name, child)
        if prefix in already:
            return 0
        if prefix and uncovered >= min_num_params and _has_forward(module):
            found.append(prefix)
            return 0
        return uncovered

    visit("", model)
    return found


def choose_units(
    model: torch.nn.Module,
    wrap_names: Sequence[str],
    min_num_params: int | None = None,
    ignored_names: Sequence[str] = (),
    trainable_outmost: bool = False,
) -> list[str]:
    """Names of the submodules that become their own FSDP unit, innermost first (the order
    ``fully_shard`` must be applied in). The root is always a unit and is not listed."""
    ignored_prefixes = [name for name, m in model.named_modules() if name and _matches(m, ignored_names)]

    def is_ignored(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in ignored_prefixes)

    units = [name for name, m in model.named_modules() if name and _matches(m, wrap_names)]
    if trainable_outmost:
        units += [n for n in _trainable_outmost(model) if n not in units]
    if min_num_params:
        units += [n for n in _size_based(model, min_num_params, set(units)) if n not in units]
    units = [n for n in units if not is_ignored(n)]
    return sorted(units, key=lambda n: n.count("."), reverse=True)


def group_units(model: torch.nn.Module, units: Sequence[str], bucket_params: int) -> list[tuple[str, ...]]:
    """``units`` (non-nested, e.g. the blocks) in model order, consecutive ones grouped until a group
    holds ``bucket_params`` parameters; a last group short of that is left to the root's unit.

    Each group becomes one FSDP unit: one all-gather and one reduce-scatter for all its blocks, the
    way DeepSpeed's reduce bucket gathers gradients. ``bucket_params=0`` keeps one unit per block.
    """
    nested = any(a != b and a.startswith(b + ".") for a in units for b in units)
    if bucket_params <= 0 or nested:  # a list given to fully_shard must not nest
        return [(name,) for name in units]
    modules = dict(model.named_modules())
    order = list(modules)
    groups: list[tuple[str, ...]] = []
    current: list[str] = []
    numel = 0
    for name in sorted(units, key=order.index):
        current.append(name)
        numel += sum(p.numel() for p in modules[name].parameters())
        if numel >= bucket_params:
            groups.append(tuple(current))
            current, numel = [], 0
    return groups


def unit_sizes(model: torch.nn.Module, units: Sequence[Sequence[str]],
               skip: set[int] = frozenset()) -> tuple[list[int], int]:
    """Parameter bytes each FSDP unit holds (a unit: the names of the modules it wraps, innermost
    units first, so a unit does not hold what a unit inside it holds), and the root's own: what no
    unit holds (a Llama's embedding, final norm and head); parameters whose ids are in ``skip``
    (left out of FSDP) are in neither."""
    claimed: set[int] = set(skip)
    sizes = []
    for names in units:
        params = [p for name in names for p in model.get_submodule(name).parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        sizes.append(sum(p.numel() * p.element_size() for p in params))
    return sizes, sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in claimed)


def ignored_parameters(model: torch.nn.Module, ignored_names: Sequence[str]) -> set[torch.nn.Parameter]:
    return {p for m in model.modules() if _matches(m, ignored_names) for p in m.parameters()}


def held_per_rank(param: torch.Tensor) -> bool:
    """A weight each rank holds a different slice of (expert_parallel's experts): never broadcast,
    sharded or averaged over the data ranks (its method reduces its gradients itself)."""
    return getattr(param, "expert_parallel", False)


def broadcast_module_states(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Every rank starts from the first rank's parameters and buffers, as DDP does; each rank's
    own slices (:func:`held_per_rank`) stay its own."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if not held_per_rank(tensor):
                dist.broadcast(tensor.data, src=src, group=group)


def _average_grad_hook(group: dist.ProcessGroup):
    size = dist.get_world_size(group)

    def hook(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    return hook


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    units: Sequence[str | tuple[str, ...]],
    *,
    reshard_after_forward: bool = True,
    mp_policy: "MixedPrecisionPolicy | None" = None,
    cpu_offload: bool = False,
    ignored: set[torch.nn.Parameter] = frozenset(),
    forward_prefetch: bool = False,
) -> torch.nn.Module:
    """Shard ``units`` (innermost first; a tuple of names is one unit) and then the root over
    ``mesh``; return the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }
    copies = {id(p) for m in model.modules() if hasattr(m, "_atorch_expert_copies") for p in m.parameters()}
    own = {p for p in model.parameters() if held_per_rank(p) and id(p) not in copies}
    if ignored or own:
        kwargs["ignored_params"] = set(ignored) | own
        # FSDP leaves ignored parameters alone, gradients included; average trainable ones here
        # so every rank still takes the same step (the per-rank slices' method reduces theirs).
        hook = _average_grad_hook(mesh.get_group())
        for param in set(ignored) - own:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(hook)
    modules = dict(model.named_modules())
    # a unit of expert_parallel's experts only (a listed expert's class repeats like a block's)
    # is theirs: sharded over their copies below, or held apart
    apart = {id(p) for p in own} | copies
    units = [u for u in units if any(id(p) not in apart for n in (u if isinstance(u, tuple) else (u,))
                                     for p in modules[n].parameters())]
    roots = stage_roots(model)
    units = within_roots(units, roots)
    shard_expert_copies(model, kwargs)
    for unit in units:
        fully_shard([modules[n] for n in unit] if isinstance(unit, tuple) else modules[unit], **kwargs)
    for name in roots:
        fully_shard(modules[name], **kwargs)
    if forward_prefetch:
        in_order = [modules[n] for n in sorted(units, key=list(modules).index)]
        for current, following in zip(in_order, in_order[1:]):
            current.set_modules_to_forward_prefetch([following])
    return model


# Why fsdp and zero2 cannot shard a pipeline split by tracing (its stages are built at the first call).
TRACED_PIPELINE = ("fsdp and zero2 shard a pipeline's stages as it builds them from a layout; this model's pipeline "
                   "is split by tracing, at its first call (a layout: atorch.pipeline.register_layout; or zero1, "
                   "which shards the optimizer state only)")


def pipeline_ineligible(model, config, job) -> str | None:
    """fsdp's and zero2's ``ineligible``: why they cannot shard ``model`` on the layout of ``job``
    (a pipeline split by tracing), or None."""
    if model is None or job.dims.get("pipeline", 1) <= 1:
        return None
    from atorch.pipeline.layouts import layout_for

    try:
        traced = getattr(layout_for(model), "traced", False)
    except AtorchConfigError:
        return None  # no pipeline on this model at all: the layout's own check says why
    return TRACED_PIPELINE if traced else None


def stage_roots(model: torch.nn.Module) -> list[str]:
    """The modules that become FSDP roots: the model itself (``""``), or in a PipelineModel each of
    this rank's stage modules, which torch's PipelineStage runs (and whose gradient reduce-scatter
    it starts after the last microbatch's backward); the PipelineModel itself runs the schedule and
    is no unit."""
    stages = getattr(model, "stage_modules", None)
    if stages is None or not hasattr(model, "local_stage_ids"):
        return [""]
    if getattr(model, "traced", False):
        raise NotSupportedError(TRACED_PIPELINE)
    return [f"stage_modules.{index}" for index in range(len(stages))]


def within_roots(units: list, roots: list[str]) -> list:
    """``units`` with every group cut where it crosses from one root's modules to another's: a unit
    belongs to one stage (one FSDP root's state, which its stage's post-backward reduces).

    >>> within_roots([("s.0.a", "s.0.b", "s.1.a"), ("s.1.b",)], ["s.0", "s.1"])
    [('s.0.a', 's.0.b'), ('s.1.a',), ('s.1.b',)]
    """
    if roots == [""]:
        return units

    def root_of(name: str) -> str:
        return next((r for r in roots if name == r or name.startswith(r + ".")), "")

    out: list = []
    for unit in units:
        if not isinstance(unit, tuple):
            out.append(unit)
            continue
        for _, names in itertools.groupby(unit, key=root_of):
            out.append(tuple(names))
    return out


def shard_expert_copies(model: torch.nn.Module, kwargs: dict) -> None:
    """Shard each expert module expert_parallel marked (``_atorch_expert_copies``: the ranks that
    hold the same slice, its expert group, the data-parallel size) over those copies, as its own
    FSDP unit inside the block's; its reduced gradients divided by the data-parallel size. The
    new sharded parameters keep the expert group for clip_grad_norm (``shard_group``)."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        marked = getattr(module, "_atorch_expert_copies", None)
        if marked is None:
            continue
        copies, group, data = marked
        mesh = DeviceMesh.from_group(copies, kwargs["mesh"].device_type)
        fully_shard(module, **{**{k: v for k, v in kwargs.items() if k != "ignored_params"}, "mesh": mesh})
        module.set_gradient_divide_factor(float(data))
        if dist.get_backend(copies) != "nccl":  # the divide factor needs NCCL's PREMUL_SUM; gloo sums, then divides
            module.set_force_sum_reduction_for_comms(True)
        for param in module.parameters():
            param.shard_group = group


def local_shard_step(ctx, method: str) -> None:
    """Step the optimizer on the plain local shards of FSDP2's DTensors (see local_step.py)."""
    from atorch.sharding.local_step import step_on_local_shards
    from atorch.utils.log import logger

    optim = ctx.base_optim
    if optim is None:
        return
    if step_on_local_shards(optim):
        logger.info("%s: %s steps on each rank's local shards", method, type(optim).__name__)
    else:
        logger.info("%s: %s is not one of the elementwise optimizers that can step on local shards; "
                    "it steps over the DTensors (slower, same result)", method, type(optim).__name__)


def mixed_precision(param_dtype, reduce_dtype, output_dtype) -> "MixedPrecisionPolicy":
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype)
