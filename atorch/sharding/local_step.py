"""The optimizer step of FSDP2-sharded parameters run on their local shards (zero2, fsdp), and
with multi-tensor kernels (zero1's partition, whose parameters are plain tensors).

FSDP2 turns every parameter into a DTensor, and a torch optimizer built over them steps one
DTensor at a time: each of its ~10 elementwise ops per parameter goes through DTensor's Python
dispatch. On a 2-core CPU that was 25 ms of a 90 ms zero2 step against DeepSpeed's 1 ms step on
one flat partition (docs/zero_profile.md). Every optimizer listed in :data:`ELEMENTWISE` updates
each element from that element's own parameter, gradient and state, so it can run on the plain
local shards (views of the same storage) and give the same result, grouped into torch's
multi-tensor (foreach) kernels.

The optimizer stays the user's torch optimizer: its parameters, its state (DTensors, as
checkpointing and ``get_optimizer_state_dict`` expect), its param_groups (an LR scheduler's
changes included) and its ``state_dict`` are untouched. Only how one step is computed changes.

    >>> step_on_local_shards(optimizer)  # after building it over FSDP2's DTensors
    True
"""

import types
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Partial

from atorch.utils.log import logger

# Optimizers whose update of an element reads only that element (no norms, no factored moments,
# no line search): stepping each shard alone is the same as stepping the whole tensor. Exact
# classes only: a subclass may override step with something that is not elementwise.
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop")
    if hasattr(torch.optim, name)
)


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer.step()`` run on the local shards of its DTensor parameters.

    Returns False, changing nothing, where that would not be the same step: an optimizer outside
    :data:`ELEMENTWISE` (LBFGS, Adafactor, a subclass) or a ``differentiable`` one. A step that
    meets a parameter it cannot split (a 0-dim or partial DTensor, or state that is not a shard of
    the same layout) runs the ordinary DTensor step instead. Where the user left ``foreach`` and
    ``fused`` unset, the local step uses foreach kernels (torch's own default on GPUs): the same
    update, applied to all the shards at once instead of one Python loop iteration per parameter.

    The instance's ``step`` is replaced by a bound method (not a wrapper object), so the optimizer
    is still a ``torch.optim.Optimizer`` for LR schedulers and trainers, and
    ``type(optimizer).step(optimizer)`` still runs the DTensor step.
    """
    if type(optimizer) not in ELEMENTWISE or any(g.get("differentiable") for g in optimizer.param_groups):
        return False
    if not getattr(optimizer.step, "_atorch_local_shards", False):  # an LR scheduler's wrapper keeps it
        optimizer.step = types.MethodType(_local_step, optimizer)
    return True


def _local_step(self: torch.optim.Optimizer, closure: Callable | None = None):
    loss = None
    if closure is not None:
        # The closure writes new gradients on the DTensor parameters; read them after it ran.
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        plan = _local_plan(self)
    if plan is None:
        if not getattr(self, "_atorch_fallback_logged", False):
            self._atorch_fallback_logged = True
            logger.warning("%s: a parameter, its gradient or its state is not a plain shard (0-dim, partial, or "
                           "laid out otherwise): steps run over the DTensors (slower, same result)", type(self).__name__)
        type(self).step(self)
        return loss
    saved = [(group["params"], group.get("foreach")) for group in self.param_groups]
    try:
        for group, proxies in zip(self.param_groups, plan.group_params):
            group["params"] = proxies
            if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True
        for proxy, state in plan.states.items():
            self.state[proxy] = state
        type(self).step(self)
    finally:
        for group, (params, foreach) in zip(self.param_groups, saved):
            group["params"] = params
            if "foreach" in group:
                group["foreach"] = foreach
        with torch.no_grad():
            _keep_state(self, plan)
    return loss


_local_step._atorch_local_shards = True


class _Plan:
    def __init__(self):
        self.group_params: list[list[torch.Tensor]] = []
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its local proxy)
        self.states: dict[torch.Tensor, dict] = {}


def _local_plan(optimizer: torch.optim.Optimizer) -> _Plan | None:
    """Each DTensor parameter's local proxy (its shard, with its gradient's shard as ``grad``) and
    state (the shards of its DTensor state); None where some parameter cannot be split."""
    plan = _Plan()
    for group in optimizer.param_groups:
        proxies = []
        for param in group["params"]:
            if not isinstance(param, DTensor):
                proxies.append(param)  # an ignored (unsharded) parameter steps as itself
                continue
            if param.dim() == 0 or any(isinstance(p, Partial) for p in param.placements):
                return None
            proxy = param.to_local().detach()  # no_grad: the shard itself, aliased
            if param.grad is not None:
                grad = param.grad
                if not isinstance(grad, DTensor) or grad.placements != param.placements:
                    return None
                proxy.grad = grad.to_local()
            state = optimizer.state.get(param)
            if state:
                local = {}
                for key, value in state.items():
                    if isinstance(value, DTensor):
                        if value.placements != param.placements or value.shape != param.shape:
                            return None
                        value = value.to_local()
                    elif isinstance(value, torch.Tensor) and value.dim() > 0:
                        return None  # a whole tensor beside shards: not this layout
                    local[key] = value
                plan.states[proxy] = local
            proxies.append(proxy)
            plan.pairs.append((param, proxy))
        plan.group_params.append(proxies)
    return plan


def _keep_state(optimizer: torch.optim.Optimizer, plan: _Plan) -> None:
    """Move the proxies' state back under the parameters, new shards wrapped as DTensors like
    the parameter (the layout a DTensor step would have created)."""
    for param, proxy in plan.pairs:
        local = optimizer.state.pop(proxy, None)
        if not local:
            continue
        state = optimizer.state.get(param)
        if state is None:
            state = optimizer.state[param] = {}
        for key, value in local.items():
            old = state.get(key)
            if old is value or (isinstance(old, DTensor) and old.to_local() is value):
                continue  # updated in place
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == proxy.shape:
                value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
            state[key] = value
