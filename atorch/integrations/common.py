"""What the trainer integrations share: which strategies a foreign training loop can run."""

from typing import Any

import torch

from atorch.auto.strategy import Strategy, parse_strategy
from atorch.errors import AtorchConfigError

# A trainer (Hugging Face, Lightning) owns the step: it calls loss.backward(), clips, then
# optimizer.step(). A method that replaces that step, or computes the loss its own way, cannot
# run under it; each is refused with the reason.
STEP_CHANGING = {
    "pipeline_parallel": "a pipeline schedule runs forward and backward inside the model call",
    "mixed_parallel": "its pipeline schedule runs forward and backward inside the model call",
    "ds_3d_parallel": "DeepSpeed's pipeline engine runs the whole step inside the model call",
    "gradient_accumulation": "it splits atorch's dataloader's batches and steps every n backwards; set the "
                             "trainer's own gradient accumulation instead",
}
SUPPORTED = ("parallel_mode (DDP), zero1 and zero2 (PyTorch or fairscale, not use_ds_zero), fsdp, "
             "tensor_parallel, sequence_parallel, amp_native with bf16, half, checkpoint, module_replace, "
             "native_dynamo, fp8")


class TrainerStrategyError(AtorchConfigError):
    """A strategy that the trainer's own training step cannot run."""


def _refusal(trainer: str, name: str, why: str) -> TrainerStrategyError:
    return TrainerStrategyError(
        f"{trainer} cannot run {name}: {why}, and {trainer} runs its own step (loss.backward(), clipping, "
        f"optimizer.step()). Strategies it supports: {SUPPORTED}. Use atorch.auto_accelerate with "
        "result.backward()/result.step() in your own loop for this strategy."
    )


def check_strategy(strategy: Any, trainer: str) -> Strategy:
    """Parse ``strategy`` (list, file path, JSON, Strategy) and refuse what ``trainer`` cannot run."""
    parsed = parse_strategy(strategy)
    for name, config in parsed.items():
        if name in STEP_CHANGING:
            raise _refusal(trainer, name, STEP_CHANGING[name])
        if getattr(config, "use_ds_zero", False):
            raise _refusal(trainer, f"{name} with use_ds_zero", "DeepSpeed's engine owns backward and the step")
        if name == "amp_native" and config.dtype == torch.float16:
            raise _refusal(trainer, "amp_native with fp16",
                           "its loss scaling wraps atorch's loss function, which the trainer does not call")
    return parsed


def check_applied(args: dict, loss_func_changed: bool, trainer: str) -> None:
    """After applying: the result must not need a step other than the trainer's (a backstop for
    strategies the search chose or methods added later)."""
    for key, why in (("backward_in_forward", "it runs backward inside the model call"),
                     ("use_optim_backward", "its optimizer owns backward"),
                     ("step_in_forward", "it steps inside the model call")):
        if args.get(key):
            raise _refusal(trainer, "this strategy", why)
    if loss_func_changed:
        raise _refusal(trainer, "this strategy", "it wraps the loss function (loss scaling)")


def needs_atorch_norm(strategy: Strategy) -> bool:
    """Whether torch's clip_grad_norm_ (what the trainers call) would measure the gradients wrong:
    tensor-parallel pieces are plain tensors, fairscale's zero2 keeps each gradient on its owner
    only, g-nets train in place of the weights. DDP and FSDP2 (DTensor) gradients keep the
    trainer's own clipping, bit for bit."""
    zero2 = strategy.get("zero2")
    return ("tensor_parallel" in strategy or "genomic_bottleneck" in strategy
            or bool(zero2 is not None and zero2.not_use_fsdp))


# The search must not propose what the trainer refuses.
SEARCH_EXCLUDED = sorted(STEP_CHANGING)


def data_parallel_sampler_kwargs() -> dict[str, int] | None:
    """``num_replicas`` and ``rank`` of this rank's data-parallel group for a DistributedSampler
    (ranks of one tensor-parallel group read the same batches), or None without a topology."""
    from atorch import parallel_state

    if parallel_state.current_topology() is None:
        return None
    return {"num_replicas": parallel_state.get_data_parallel_size(), "rank": parallel_state.get_data_parallel_rank()}
