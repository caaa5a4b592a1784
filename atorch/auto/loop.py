"""One training loop for every strategy: what ``result.backward(loss)`` and ``result.step()`` do.

Most strategies keep PyTorch's own calls (``loss.backward()``, ``optim.step()``,
``optim.zero_grad()``); pipeline strategies run backward inside the model call, and DeepSpeed's
engine owns backward and step. These functions hide the difference, so a loop written with
them never branches on ``result.args``.

Gradient accumulation (``auto_accelerate(..., gradient_accumulation_steps=n)``) lives here too:
``backward`` keeps the gradient reduction (DDP's all-reduce, FSDP2's reduce-scatter) off until
the last of ``n`` backwards; ``step`` steps only after that one. Each backward weights its loss
by what it counts (atorch/loss/step.py), so ``n`` micro-batches of ``b`` samples train exactly
like one batch of ``n x b``, padded or not, with one gradient reduction per optimizer step.
"""

from typing import Any

import torch

from atorch.auto.inputs import check_loss
from atorch.loss.contract import STEP_TOTALS
from atorch.loss.step import StepTokens
from atorch.utils.log import logger

ACCUMULATION_STEPS = "gradient_accumulation_steps"
MICROSTEP = "microstep"  # backwards run so far (kept in result.args, so it travels with the result)


def backward(args: dict, optim: Any, loss: torch.Tensor | tuple | list, model: torch.nn.Module | None = None,
             tokens: StepTokens | None = None) -> None:
    """Backward of ``loss`` (a loss or a sequence whose first item is the loss) the strategy's way,
    weighted by what it counts through ``tokens`` (atorch/loss/step.py: the applied strategy's
    ``ModelContext.loss_tokens``) so the step trains on the global batch's mean; without it, the
    per-part mean."""
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    if args.get("backward_in_forward"):  # pipeline methods: the model call ran the backward
        if tokens is not None and torch.is_tensor(loss) and hasattr(loss, STEP_TOTALS):
            tokens.record(getattr(loss, STEP_TOTALS))
        return
    check_loss(loss)
    steps = args.get(ACCUMULATION_STEPS, 1)
    if tokens is not None:
        scaled = tokens.loss_to_backward(loss, steps)
    else:  # a loop that was not set up by apply_strategy: the per-part mean
        scaled = loss / steps
    if args.get("use_optim_backward"):  # DeepSpeed ZeRO: the engine reduces (accumulation is refused with it)
        optim.backward(scaled)
        return
    scaled.backward()
    if steps == 1:
        return
    args[MICROSTEP] = args.get(MICROSTEP, 0) + 1
    if args[MICROSTEP] % steps == 0 and tokens is not None:
        tokens.finish_accumulation(_trained_parameters(model, optim), steps)
    # The reduction flags are read by the next forward (DDP) and backward (FSDP2): set them now
    # for the coming micro-step, which reduces only when it completes the accumulation.
    if model is not None:
        set_gradient_sync(model, (args[MICROSTEP] + 1) % steps == 0)


def step(args: dict, optim: Any, tokens: StepTokens | None = None) -> None:
    """The optimizer step, then gradients cleared for the next one (DeepSpeed clears them itself).

    Under gradient accumulation, a call before the accumulation is complete does nothing. A step
    whose global batch counted nothing (every label -100) clears the gradients without stepping
    (a WARNING says so): a zero gradient would still move AdamW's weights through its momentum
    and weight decay.
    """
    if not sync_gradients(args):
        return
    if tokens is not None and tokens.empty and not args.get("step_in_forward"):
        tokens.skipped += 1
        logger.warning("skipped an optimizer step: its global batch has no counted label (every label is -100); "
                       "%d such step(s) so far", tokens.skipped)
        optim.zero_grad()
        return
    optim.step()
    if not args.get("use_optim_backward"):
        optim.zero_grad()


def _trained_parameters(model: torch.nn.Module | None, optim: Any) -> list[torch.Tensor]:
    """Every parameter whose gradient the optimizer reads: the model's and the optimizer's groups."""
    params = {id(p): p for p in (model.parameters() if model is not None else ())}
    for group in getattr(optim, "param_groups", ()):
        params.update((id(p), p) for p in group["params"])
    return list(params.values())


def sync_gradients(args: dict) -> bool:
    """Whether the gradients are complete: the last backward ended an accumulation (or there is none)."""
    return args.get(MICROSTEP, 0) % args.get(ACCUMULATION_STEPS, 1) == 0


def set_gradient_sync(model: torch.nn.Module, on: bool) -> None:
    """Turn the data-parallel gradient reduction of every DDP / FSDP2 wrapper in ``model`` on or
    off, and that of expert_parallel's replicated slices (a module's ``_atorch_expert_sync``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = on
        elif isinstance(module, FSDPModule):  # fsdp's reduce_every_micro_batch keeps it on
            module.set_requires_gradient_sync(on or getattr(module, "_atorch_reduce_every_micro_batch", False),
                                              recurse=False)
        if isinstance(getattr(module, "_atorch_expert_sync", None), bool):
            module._atorch_expert_sync = on


def accumulation_steps(value: Any) -> int:
    """``gradient_accumulation_steps`` as given, checked before anything is applied."""
    from atorch.errors import AtorchConfigError

    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AtorchConfigError(f"gradient_accumulation_steps must be a positive int, got {value!r}; "
                                "1 (the default) steps the optimizer after every backward")
    return value


def setup_accumulation(args: dict, model: torch.nn.Module, steps: int) -> None:
    """Check ``steps`` against the applied strategy (refused where it would be wrong); start the count.

    Called by the gradient_accumulation method, then with auto_accelerate's
    ``gradient_accumulation_steps``: the two multiply."""
    from atorch.errors import AtorchConfigError

    if steps == 1:
        return
    steps *= args.get(ACCUMULATION_STEPS, 1)  # the gradient_accumulation method's, when it ran
    why = _accumulation_unsupported(args, model)
    if why is not None:
        raise AtorchConfigError(f"gradient_accumulation_steps={steps} is not supported here: {why}")
    args[ACCUMULATION_STEPS], args[MICROSTEP] = steps, 0
    set_gradient_sync(model, False)


def _accumulation_unsupported(args: dict, model: torch.nn.Module) -> str | None:
    if args.get("backward_in_forward"):
        return ("pipeline strategies accumulate over their own micro-batches; raise the pipeline's num_microbatches "
                "(and the global batch size) instead")
    if args.get("use_optim_backward"):
        return ("DeepSpeed's engine runs its own backward and step; use zero1/zero2 without use_ds_zero, or fsdp, "
                "which support it")
    for module in model.modules():
        if type(module).__name__ == "ShardedDataParallel":  # fairscale: reduces inside backward hooks
            return ("fairscale's ShardedDataParallel (zero2 with not_use_fsdp) reduces every backward; use zero2 on "
                    "FSDP2 (the default) or zero1, which support it")
    return None
