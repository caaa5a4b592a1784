"""Model and optimizer state in one layout on disk, whatever the strategy: the serial model's.

Every tensor is stored under the serial model's parameter name with its full (logical) shape,
as torch.distributed.checkpoint (DCP) sees it:

- plain modules and DDP: full tensors, written once (DCP drops the replicas);
- FSDP2 (fsdp, zero2): the DTensors ``get_model_state_dict`` returns, each rank writing its shard;
- Megatron-style tensor-parallel layers hold plain local slices: each becomes a DTensor over the
  tensor group, ``Shard(partition_dim)``, so DCP sees the full weight (with FSDP2 on top, the
  data-parallel shards are gathered first);
- ZeroRedundancyOptimizer: each rank holds the state of its partition only; its inner optimizer
  goes through ``get_optimizer_state_dict`` like any other, so a rank writes the state of the
  parameters it owns and reads back exactly those (no consolidation on one rank);
- a PipelineModel (pipeline_parallel, mixed_parallel): the user's module holds every unit, those
  of other stages on the meta device; each rank writes and reads its own stages' tensors.

Optimizer state uses DCP's flattened form (``state.<name>.<key>``, ``param_groups.<name>.<key>``):
keyed per parameter, it carries over to any partitioning of the parameters.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from atorch.compression.bottleneck import GenomicBottleneck
from atorch.errors import NotSupportedError
from atorch.utils.optim import unwrap_optimizer, wrapper_chain

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Wrapper modules whose attribute name torch's state dicts leave out of parameter names.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def check_supported(model: torch.nn.Module, optim) -> None:
    """Refuse the back-ends whose state this module cannot lay out, naming the alternative."""
    kinds = {type(model).__module__.split(".")[0], type(optim).__module__.split(".")[0] if optim is not None else ""}
    kinds.update(type(inner).__module__.split(".")[0] for inner in wrapper_chain(optim))
    if "deepspeed" in kinds:
        raise NotSupportedError(
            "atorch.checkpoint cannot save or load a DeepSpeed engine (use_ds_zero): DeepSpeed keeps its own "
            "partitioned state. Use zero1 or zero2 without use_ds_zero (ZeroRedundancyOptimizer / FSDP2), whose "
            "checkpoints load under any strategy, or DeepSpeed's engine.save_checkpoint / load_checkpoint"
        )
    if "fairscale" in kinds:
        raise NotSupportedError(
            "atorch.checkpoint cannot save or load fairscale's OSS / ShardedDDP (zero2 with not_use_fsdp). Use zero2 "
            "without not_use_fsdp (FSDP2), whose checkpoints load under any strategy"
        )
    if any(isinstance(getattr(inner, "gnets", None), GenomicBottleneck) for inner in wrapper_chain(optim)):
        # The covered weights are regenerated from the g-nets before every forward: a checkpoint
        # without the g-nets would load weights that the next forward overwrites.
        raise NotSupportedError(
            "atorch.checkpoint does not hold the g-nets of genomic_bottleneck (the covered weights are regenerated "
            "from them); save and load them with result.args['gnets'].save(path) / .load(path) (docs/compression.md)"
        )


def split_optimizer(optim):
    """``(torch optimizer to read and write, ZeroRedundancyOptimizer or None, GradScaler or None)``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    scaler = getattr(optim, "scaler", None)
    base = unwrap_optimizer(optim)  # under AmpOptimizer, GenomicOptimizer, in any number
    if isinstance(base, ZeroRedundancyOptimizer):
        return base.optim, base, scaler  # the partition this rank owns
    if not isinstance(base, torch.optim.Optimizer):
        raise NotSupportedError(f"atorch.checkpoint does not know how to read optimizer {type(optim).__name__}")
    return base, None, scaler


def _user_module(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel) or type(model).__name__ == "OptimizedModule":
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def holder(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """The module whose parameter names the state dicts use, and whether this rank holds only
    part of it (a pipeline stage: the other stages' units are on the meta device)."""
    if hasattr(model, "local_named_parameters") and isinstance(getattr(model, "_module", None), list):
        return model._module[0], True  # PipelineModel keeps the user's module out of its children
    return model, False


def _model_state(model: torch.nn.Module) -> tuple[torch.nn.Module, bool, dict]:
    module, partial = holder(model)
    content = get_model_state_dict(module)
    if partial:
        content = {k: v for k, v in content.items() if not v.is_meta}
    return module, partial, content


def tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each parameter name, the other names of the same weight: a tied embedding and head
    (``lm_head.weight`` and ``transformer.wte.weight``). A strategy that keeps one tensor saves the
    optimizer state under one of them; a pipeline keeps a copy on each stage, under each name."""
    groups = [[name for _, name in users] for users in getattr(model, "ties", ())]
    if not groups:
        module, _ = holder(model)
        shared: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            shared.setdefault(id(param), []).append(_canonical(name))
        groups = [names for names in shared.values() if len(names) > 1]
    return {name: [other for other in names if other != name] for names in groups for name in names}


def _canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


_MESHES: dict = {}


def _mesh(group, device_type: str) -> DeviceMesh:
    key = (group, device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def _split_dims(module: torch.nn.Module) -> dict[str, int]:
    """``{parameter name: split dim}`` of a tensor-parallel layer's own parameters."""
    from atorch.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

    # By layer class: FSDP2 replaces the parameters by DTensors, which lose the Megatron
    # attributes (tensor_model_parallel, partition_dim) set on the originals.
    if isinstance(module, ColumnParallelLinear):
        dims = {"weight": 0, "bias": 0}
    elif isinstance(module, RowParallelLinear):
        dims = {"weight": 1}
    elif isinstance(module, ParallelEmbedding):
        dims = {"weight": 1 if module.shard_across_embedding else 0}
    elif isinstance(getattr(module, "split_dims", None), dict):  # expert_parallel's slices (under fsdp too)
        dims = dict(module.split_dims)
    else:
        dims = {name: p.partition_dim for name, p in module.named_parameters(recurse=False)
                if getattr(p, "tensor_model_parallel", False)}
    return {name: dim for name, dim in dims.items() if getattr(module, name, None) is not None}


def tensor_parallel_shards(model: torch.nn.Module) -> dict[str, tuple[object, int, str | None]]:
    """``{serial parameter name: (tensor group, split dim, layout)}`` of Megatron-style split
    parameters; layout is None, or how tensor_parallel rebuilt a transformers Conv1D."""
    found = {}
    for module_name, module in _user_module(holder(model)[0]).named_modules():
        group = getattr(module, "group", None)
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            continue
        for name, dim in _split_dims(module).items():
            found[_canonical(f"{module_name}.{name}" if module_name else name)] = (
                group, dim, getattr(module, "serial_layout", None))
    return found


def _owner(key: str, names) -> str | None:
    """The parameter name that prefixes optimizer key ``state.<name>.<state key>``."""
    if not key.startswith("state."):
        return None
    rest = key[len("state."):]
    cut = rest.rfind(".")
    while cut > 0:
        if rest[:cut] in names:
            return rest[:cut]
        cut = rest.rfind(".", 0, cut)
    return None


def _serial(value: torch.Tensor, group, dim: int, fill: bool):
    """``value`` (this rank's tensor-parallel slice, maybe FSDP-sharded) as a DTensor of the full
    tensor, and the function that turns what was loaded into it back into ``value``'s kind."""
    mesh = _mesh(group, value.device.type)
    if not isinstance(value, DTensor):
        # Shares storage with ``value``: what DCP loads into it lands in ``value`` itself.
        return DTensor.from_local(value, mesh, [Shard(dim)], run_check=False), lambda loaded: value
    # FSDP2 over the data dim on top: the data-parallel shards are gathered into the slice first.
    local = value.full_tensor() if not fill else torch.empty(value.shape, dtype=value.dtype, device=value.device)
    full = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    return full, lambda loaded: distribute_tensor(local, value.device_mesh, value.placements, src_data_rank=None)


def _gather_slices(local: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim)


def _conv1d_serial(value: torch.Tensor, group, dim: int, layout: str, fill: bool):
    """A slice of a layer rebuilt from a transformers Conv1D, as the full Conv1D tensor (weights
    transposed back, c_attn's rows put back in q, k, v order), plain and alike on the tensor
    ranks; and the function that slices what was loaded back into ``value``."""
    from atorch.parallel_layers.auto_shard import _qkv_rows

    local = value.full_tensor() if isinstance(value, DTensor) else value
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = list(local.shape)
    shape[dim] *= world
    rows = _qkv_rows(shape[0], world) if layout == "column_conv1d_qkv" else None
    if not fill:
        linear = _gather_slices(local, group, dim)
        if rows is not None:  # tensor_parallel took linear[rows]; undo it
            linear = torch.empty_like(linear).index_copy_(0, rows, linear)
        return (linear.t().contiguous() if linear.ndim == 2 else linear), None
    loaded = torch.empty(shape[::-1] if len(shape) == 2 else shape, dtype=local.dtype, device=local.device)

    def back(filled: torch.Tensor) -> torch.Tensor:
        linear = filled.t() if filled.ndim == 2 else filled
        mine = (linear[rows] if rows is not None else linear).chunk(world, dim)[rank].contiguous()
        if isinstance(value, DTensor):
            return distribute_tensor(mine, value.device_mesh, value.placements, src_data_rank=None)
        return value.copy_(mine)

    return loaded, back


def _to_serial(state: dict, owner: Callable[[str], str | None], shards: dict, fill: bool) -> list:
    """Replace tensor-parallel slices in ``state`` (in place); return the restore steps."""
    restore = []
    for key, value in list(state.items()):
        name = owner(key)
        if name is None or not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        group, dim, layout = shards[name]
        if layout is not None:
            state[key], back = _conv1d_serial(value, group, dim, layout, fill)
        else:
            state[key], back = _serial(value, group, dim, fill)
        restore.append((key, back))
    return restore


def gather(model: torch.nn.Module, optim) -> dict:
    """``{"model": ..., "optim": ...}`` of this rank, in the serial layout, ready for ``dcp.save``."""
    check_supported(model, optim)
    shards = tensor_parallel_shards(model)
    module, _, content = _model_state(model)
    state = {"model": content}
    _to_serial(state["model"], lambda key: key if key in shards else None, shards, fill=False)
    if optim is not None:
        base, _, _ = split_optimizer(optim)
        fresh = base.state_dict() if not base.state else None
        state["optim"] = get_optimizer_state_dict(module, base, options=_OPTIM_OPTIONS)
        if fresh is not None:
            # torch allocated the state with a zero step at lr 0 (Adam's step count is then 1):
            # this job goes on as if never saved, and the checkpoint says "no state yet".
            base.load_state_dict(fresh)
            state["optim"] = {k: v for k, v in state["optim"].items() if not k.startswith("state.")}
        _to_serial(state["optim"], lambda key: _owner(key, shards), shards, fill=False)
    return state


def _allocate_state(model: torch.nn.Module, base: torch.optim.Optimizer) -> dict:
    """This optimizer's flattened state dict with every state tensor allocated.

    torch allocates the state with a zero-gradient step at lr 0 when the optimizer has none yet,
    but skips it when gradients are present: they are set aside for that call.
    """
    params = [p for group in base.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if not base.state:
        for p in params:
            p.grad = None
    try:
        return get_optimizer_state_dict(model, base, options=_OPTIM_OPTIONS)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _optimizer_layout(model: torch.nn.Module, base: torch.optim.Optimizer) -> dict:
    """What :func:`_allocate_state` returns, leaving the optimizer as it was (no state allocated)."""
    fresh = base.state_dict() if not base.state else None
    layout = _allocate_state(model, base)
    if fresh is not None:
        base.load_state_dict(fresh)
    return layout


def _staged(state: dict) -> dict:
    """``state`` with every tensor replaced by a new one of the same kind (a DTensor stays a DTensor
    on its mesh): what DCP loads into, so that a load that fails changes nothing the job holds."""
    return {key: torch.empty_like(value) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def targets(model: torch.nn.Module, optim) -> tuple[dict, Callable[[dict], None]]:
    """The state dict for ``dcp.load`` to fill, and ``finish(state)`` that puts it into the model
    and optimizer afterwards.

    The state dict holds new tensors, not the model's or the optimizer's: until ``finish`` runs,
    nothing the job holds has changed (the cost is one extra copy of this rank's share of the
    state while loading).
    """
    check_supported(model, optim)
    shards = tensor_parallel_shards(model)
    module, partial, content = _model_state(model)
    state = {"model": _staged(content)}
    restore = {"model": _to_serial(state["model"], lambda key: key if key in shards else None, shards, fill=True)}
    base = zero = None
    if optim is not None:
        base, zero, _ = split_optimizer(optim)
        state["optim"] = _staged(_optimizer_layout(module, base))
        restore["optim"] = _to_serial(state["optim"], lambda key: _owner(key, shards), shards, fill=True)

    def finish(loaded: dict) -> None:
        for part, steps in restore.items():
            for key, back in steps:
                loaded[part][key] = back(loaded[part][key])
        # A pipeline stage loads its own units; the meta ones of other stages stay as they are.
        set_model_state_dict(module, loaded["model"], options=StateDictOptions(strict=not partial))
        if base is not None:
            _allocate_state(module, base)  # torch loads flattened state only into allocated state
            set_optimizer_state_dict(module, base, loaded["optim"], options=_OPTIM_OPTIONS)
            if zero is not None:
                # ZeroRedundancyOptimizer copies its own param_groups into the partition's at every
                # step: they must carry the loaded hyperparameters (lr, betas, ...) too.
                zero._sync_param_groups(base.param_groups, zero.param_groups)

    return state, finish
