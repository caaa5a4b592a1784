"""The cost model: peak memory per rank of a candidate, estimated before anything runs.

peak = parameters + optimizer state + gathered weights + max(activations, gradients + step temporaries)

Parameters, gradients and optimizer state are divided by the shards a method splits them over;
gathered weights are the largest FSDP unit twice (the current one and the prefetched one), or
autocast's low-precision weight copies. Activations and gradients share the last term because
``zero_grad(set_to_none=True)`` frees gradients before forward, and backward frees activations
about as fast as it creates gradients; at the optimizer step the gradients are joined by the
step's temporaries (the foreach implementations build one intermediate per parameter shard). Activations are measured, not guessed: one forward of a copy
of the model, with the candidate's module rewrites and checkpointing applied, on one per-rank
micro-batch, counting the bytes autograd saves (on the meta device when no real memory may be
used). The formula's terms are kept apart so the report can show where the memory goes.
"""

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from atorch.auto.context import run_model
from atorch.auto.registry import Stage, get_method
from atorch.auto.strategy import Strategy

_SHARD_RULES = {
    # method: which of (params, grads, optimizer state) it splits over the data-parallel ranks
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "fsdp": (True, True, True),
}


@dataclass
class MemoryEstimate:
    params: int
    grads: int
    optim_state: int
    gathered: int
    activations: int
    step_temp: int = 0
    forward_flops: float = 0.0

    @property
    def total(self) -> int:
        return self.params + self.optim_state + self.gathered + max(self.activations, self.grads + self.step_temp)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def optimizer_state_factor(optim_func, optim_args: dict) -> float:
    """Bytes of optimizer state per byte of trainable fp32 parameter (Adam: 2, SGD: 0 or 1)."""
    if optim_func is None:
        return 0.0
    param = torch.nn.Parameter(torch.zeros(64))
    optim = optim_func([param], **optim_args)
    param.grad = torch.ones_like(param)
    optim.step()
    state = sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values()
                if torch.is_tensor(v) and v.ndim > 0)
    return state / (param.numel() * param.element_size())


def _largest_unit_bytes(model: torch.nn.Module, unit_classes: list[str]) -> int:
    from atorch.auto.config_types import class_matches

    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in model.modules()
             if any(class_matches(type(m), n) for n in unit_classes)]
    return max(sizes, default=sum(p.numel() * p.element_size() for p in model.parameters()))


class _SavedBytes:
    """Counts the bytes autograd saves for backward (each storage once)."""

    def __init__(self):
        self.bytes = 0
        self._seen: set = set()

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device) if tensor.device.type != "meta" else id(storage)
        if key not in self._seen and not isinstance(tensor, torch.nn.Parameter):
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor


def _saved_bytes(model, strategy, batch, model_input_format, loss_func, device_ctx, stages,
                 flops: list | None = None) -> tuple[int, int]:
    """(bytes saved for backward, number of checkpointed modules) of one forward of a copy;
    the forward's FLOPs are appended to ``flops`` when given."""
    from torch.utils.flop_counter import FlopCounterMode

    from atorch.auto.context import ModelContext, move_to_device
    from atorch.methods.checkpoint import CheckpointedForward

    probe = copy.deepcopy(model)
    ctx = ModelContext(model=probe, device_ctx=device_ctx, loss_func=loss_func, prepare_input=move_to_device)
    for name, config in strategy.items():
        for stage, hook in get_method(name).hooks.items():
            if stage in stages and name != "fp8":
                hook(ctx, config)
    checkpointed = sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in probe.modules())
    if not any(p.is_meta for p in probe.parameters()):  # a plan on the meta device keeps its meta inputs
        batch = ctx.prepare_input(batch, device_ctx.device)
    counter = _SavedBytes()
    flop_counter = FlopCounterMode(display=False)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), flop_counter:
        output = run_model(ctx.model, batch, model_input_format)
        if loss_func is not None:
            loss_func(batch, output)
    if flops is not None:
        flops.append(flop_counter.get_total_flops())
    return counter.bytes, checkpointed


def activation_bytes(model: torch.nn.Module, strategy: Strategy, batch: Any, model_input_format, loss_func,
                     device_ctx, flops: list | None = None) -> int:
    """Bytes of activations alive at the peak: those saved by one forward of a copy of ``model``
    under the candidate's module rewrites and checkpointing (parameters excluded), plus, with
    checkpointing, one checkpointed block's activations recomputed during backward. The
    forward's FLOPs are appended to ``flops`` when given."""
    saved, checkpointed = _saved_bytes(model, strategy, batch, model_input_format, loss_func, device_ctx,
                                       (Stage.REWRITE, Stage.MEMORY), flops)
    if checkpointed:
        full, _ = _saved_bytes(model, strategy, batch, model_input_format, loss_func, device_ctx, (Stage.REWRITE,))
        saved += max(full - saved, 0) // checkpointed
    return saved


def estimate_memory(model: torch.nn.Module, strategy: Strategy, dp_size: int, optim_state_factor: float,
                    activations: int) -> MemoryEstimate:
    """Peak bytes per rank of ``strategy`` for ``model`` (see the module docstring)."""
    names = strategy.opt_names
    half = strategy.get("half")
    scale = 0.5 if half is not None else 1.0  # half stores params and grads in 2 bytes
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * scale
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) * scale
    grads = trainable
    optim_state = trainable * optim_state_factor
    step_temp = trainable
    gathered = 0
    for method, (shard_params, shard_grads, shard_optim) in _SHARD_RULES.items():
        if method in names:
            config = strategy.get(method)
            if shard_params:
                param_bytes /= dp_size
                units = list(getattr(config, "atorch_wrap_cls", []) or [])
                gathered = 2 * _largest_unit_bytes(model, units) * scale
            if shard_grads:
                grads /= dp_size
            if shard_optim:
                optim_state /= dp_size
                step_temp /= dp_size
                if method == "zero1" and not config.use_ds_zero:
                    # ZeroRedundancyOptimizer hands out whole tensors: some rank holds the largest
                    # one (often the embedding), however many ranks there are.
                    largest = max((p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                                  default=0) * scale
                    optim_state = max(optim_state, largest * optim_state_factor)
                    step_temp = max(step_temp, largest)
    if "amp_native" in names and not any(m in names for m in ("zero2", "fsdp")):
        # autocast keeps a low-precision copy of each weight it casts during forward
        gathered += sum(p.numel() * 2 for p in model.parameters())
    return MemoryEstimate(math.ceil(param_bytes), math.ceil(grads), math.ceil(optim_state), math.ceil(gathered),
                          int(activations), math.ceil(step_temp))


# Rough rates, used only to order candidates (dry runs measure the real thing): sustained matmul
# FLOP/s by device and compute dtype, and collective bandwidth in bytes/s by device.
_FLOPS = {"cuda": {"fp32": 4e13, "half": 3e14}, "cpu": {"fp32": 5e10, "half": 2.5e10}}
_BANDWIDTH = {"cuda": 5e10, "cpu": 1e9}


def estimate_step_seconds(model: torch.nn.Module, strategy: Strategy, dp_size: int, forward_flops: float,
                          device_type: str) -> float:
    """A rough step time: forward + 2x backward FLOPs (+1 forward recomputed under checkpointing)
    over the device's rate, plus the bytes the data-parallel collectives move over its bandwidth.
    Good enough to rank candidates and to order dry runs, not to predict seconds."""
    names = strategy.opt_names
    flops = forward_flops * (4 if "checkpoint" in names else 3)
    rates = _FLOPS.get(device_type, _FLOPS["cpu"])
    half = "half" in names or "amp_native" in names
    compute = flops / rates["half" if half else "fp32"]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    spread = (dp_size - 1) / dp_size if dp_size > 1 else 0.0
    if "fsdp" in names:
        moved = 2 * param_bytes + grad_bytes  # all-gather in forward and backward, reduce-scatter
    elif "zero2" in names:
        moved = param_bytes + grad_bytes  # reduce-scatter gradients, all-gather updated parameters
    elif "zero1" in names:
        moved = 2 * grad_bytes + param_bytes  # all-reduce gradients, broadcast updated parameters
    else:
        moved = 2 * grad_bytes  # all-reduce
    return compute + moved * spread / _BANDWIDTH.get(device_type, _BANDWIDTH["cpu"])


def parse_bytes(value: Any) -> int | None:
    """``70GiB``, ``512MB``, ``1e9`` or an int, as bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    lower = text.lower()
    for suffix, factor in units.items():
        if lower.endswith(suffix):
            try:
                return int(float(lower[: -len(suffix)]) * factor)
            except ValueError:
                break
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"memory_budget {value!r} is not a size; write bytes or e.g. '70GiB', '512MB'") from None
