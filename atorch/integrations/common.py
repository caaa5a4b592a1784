"""What the trainer integrations share: which strategies a foreign training loop can run, and how
its loss is weighted on padded batches (TokenWeights)."""

import collections
import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from atorch.auto.strategy import Strategy, parse_strategy
from atorch.errors import AtorchConfigError
from atorch.utils.log import logger

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


class TokenWeights:
    """Loss normalization for a trainer that owns its step (Lightning's AtorchStrategy, Fabric).

    Each backward's loss is weighted by the label tokens it counts, and before the step's
    gradients are read (clipping, ``on_before_optimizer_step``, the optimizer) they are divided by
    the global batch's count: the step's gradient is that of the global batch's token mean, over
    every data rank and accumulation micro-batch, whatever the split (docs/integrations.md, "Loss
    normalization"). A loss is counted when it is

    - a transformers model's own ``out.loss``, passed on as it is: a forward hook on the model
      reads the labels it was called with and counts them as its loss does (a causal LM shifted
      by one, atorch/loss/counting.py);
    - marked with :func:`atorch.with_count` (a custom loss: its mean and the count it averages over).

    Other losses keep the trainer's per-part mean; on a padded batch (labels -100) a WARNING says
    so once. The weighting is atorch's own loop's (:meth:`atorch.loss.step.StepTokens.deferred`):
    each part's backward carries ``loss x count / K``, and ``finish`` multiplies the gradients by
    ``W x K / N`` after one all-reduce of the count a step (and one more at the first step).
    """

    def __init__(self, root: torch.nn.Module, group: Any, data_size: int, mode: str, fix: str):
        from atorch.loss.contract import MODES
        from atorch.loss.step import StepTokens

        if mode not in MODES:
            raise AtorchConfigError(f"loss_normalization={mode!r} is not one of {list(MODES)}: 'tokens' weights each "
                                    "part of a split batch by the label tokens its loss counts (the default), "
                                    "'per_part_mean' weights each part as one")
        self.mode, self.fix = mode, fix
        self.steps = StepTokens(group, data_size)  # the weighting itself, as atorch's own loop does it
        self.last_inputs: Any = None  # the keyword arguments of the last model call that gave a loss
        # (a weak reference to a model call's loss, its count): held weakly, so a loss that is never
        # passed to backward (an evaluation with gradients on) does not keep its graph alive.
        self._seen: collections.deque = collections.deque(maxlen=4)
        self._parts = self._unweighted = 0
        self._warned = False  # the first unweighted backward's batch was checked for padding
        if mode == "tokens":
            self._hook(root)

    def _hook(self, root: torch.nn.Module) -> None:
        from atorch.loss.counting import rule_for

        for module in root.modules():
            rule = rule_for(module)
            if rule is not None:
                module.register_forward_hook(functools.partial(self._record, rule), with_kwargs=True)

    def _record(self, rule, module, args, kwargs, output) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not torch.is_grad_enabled() or not torch.is_tensor(loss):
            return
        if not self._warned:
            self.last_inputs = kwargs
        count = rule.count(kwargs)
        if count is not None:
            self._seen.append((weakref.ref(loss), count))

    def count_of(self, loss: Any) -> torch.Tensor | None:
        """What ``loss`` counts: its :func:`atorch.with_count` mark, or the labels of the model
        call that returned it; None for any other loss."""
        from atorch.loss.contract import count_of

        if self.mode != "tokens" or not torch.is_tensor(loss):
            return None
        count = count_of(loss)
        if count is None:
            count = next((c for seen, c in self._seen if seen() is loss), None)
        self._seen.clear()
        return count

    def weigh(self, loss: torch.Tensor, count: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """The tensor to backward for a part whose loss (``loss / multiplier``) counts ``count``."""
        from atorch.loss.contract import with_count

        self._parts += 1
        return self.steps.deferred(with_count(loss, count.detach()), multiplier)

    def unweighted(self, batch: Any = None) -> None:
        """A backward whose loss says nothing of its count: the trainer's own per-part mean. The
        first such backward checks its batch (default: the last model call's inputs) for padding."""
        from atorch.loss.counting import padded

        self._unweighted += 1
        if self._warned or self.mode != "tokens":
            return
        self._warned = True  # checked once: a check reads the labels back from the device
        batch, self.last_inputs = (self.last_inputs if batch is None else batch), None
        if padded(batch):
            logger.warning(
                "the batch is padded (labels -100) but the loss passed to backward is neither the model's own out.loss "
                "nor marked with atorch.with_count, so each part of the split batch (data rank, accumulation "
                "micro-batch) weighs as one and the strategy changes the math. %s, or pass "
                "loss_normalization='per_part_mean' to choose this weighting (docs/integrations.md, \"Loss "
                "normalization\")", self.fix)

    def finish(self, params: Iterable[torch.Tensor]) -> None:
        """After the step's last backward, before its gradients are read: divide them by the
        global count. A step whose global batch counts nothing gets no gradients (None), so the
        optimizer leaves the weights as they are."""
        parts, unweighted, self._parts, self._unweighted = self._parts, self._unweighted, 0, 0
        if parts == 0:
            return
        if unweighted:
            raise TrainerStrategyError(
                f"one optimizer step took {parts} loss(es) with a token count and {unweighted} without one: weight "
                "every backward of a step the same way (the model's own loss or atorch.with_count on each)")
        params = list(params)
        self.steps.finish_accumulation(params, parts)
        if not self.steps.empty:
            return
        for param in params:
            param.grad = None
        self.steps.skipped += 1
        logger.warning("an optimizer step's global batch has no counted label (every label is -100): its "
                       "gradients are dropped and the weights stay as they are; %d such step(s) so far",
                       self.steps.skipped)


def token_weights(root: torch.nn.Module, mode: str, fix: str) -> TokenWeights:
    """The TokenWeights of a strategy just applied to ``root``, over its data-parallel group."""
    from atorch import parallel_state

    topology = parallel_state.current_topology()
    if topology is None:  # one process, or no parallel_mode: no gradient reduction to undo
        return TokenWeights(root, None, 1, mode, fix)
    return TokenWeights(root, topology.data_parallel_group, topology.data_parallel_size, mode, fix)
