"""How a loss tells atorch what it counts, and the wrapper that reads it (``result.loss_func``).

atorch weights each part of a split batch (a data rank's share, an accumulation micro-batch, a
pipeline microbatch) by what its loss counts, so that a step's gradient is the gradient of the
whole global batch's mean (docs/loss_normalization.md). It learns the count in one of three ways:

- the loss is the model's own (``lambda batch, out: out.loss`` with a Hugging Face model): atorch
  counts the batch's labels the way that loss does (atorch/loss/counting.py);
- ``loss_func`` returns :class:`TokenSum` ``(sum, count)``: the sum over what it counts, and that count;
- ``loss_func`` returns :func:`with_count` ``(mean, count)``: a mean, and the count it averaged over.

Any other loss counts as one per part: the per-part mean, exact when the parts hold the same
number of counted items (unpadded batches), and reported once with a WARNING on a padded batch.
``auto_accelerate(..., loss_normalization="per_part_mean")`` asks for that weighting explicitly.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from atorch.loss.counting import LabelRule, padded
from atorch.utils.log import logger

COUNT = "_atorch_count"      # on a loss tensor: what it averages over (a 0-dim tensor)
SAMPLES = "_atorch_samples"  # on a loss tensor: the samples of its part of the batch
STEP_TOTALS = "_atorch_step_totals"  # on a pipeline's loss: its step's [count, sum, samples], global
MODES = ("tokens", "per_part_mean")


class TokenSum(NamedTuple):
    """A loss as the sum over what it counts, and that count; atorch divides by the global count.

    Example: a token loss that atorch cannot see into::

        def loss_func(batch, out):
            logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
            total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            return atorch.TokenSum(total, (labels != -100).sum())
    """

    sum: torch.Tensor
    count: Any  # an int or a 0-dim tensor


def with_count(loss: torch.Tensor, count: Any) -> torch.Tensor:
    """``loss`` (a mean over ``count`` items) marked with its count; returns ``loss`` itself.

    Example: ``return atorch.with_count(F.cross_entropy(logits, labels), (labels != -100).sum())``.
    """
    setattr(loss, COUNT, _as_tensor(count, loss.device))
    return loss


def count_of(loss: torch.Tensor) -> torch.Tensor | None:
    """The count a loss carries (:func:`with_count`), or None."""
    return getattr(loss, COUNT, None)


def samples_of(loss: torch.Tensor) -> int:
    """The samples of the part of the batch a loss was computed on (0: not known)."""
    return getattr(loss, SAMPLES, 0)


def weighed_part(loss: torch.Tensor, samples: int | None = None) -> torch.Tensor:
    """``[count, sum, samples]`` of one part (float64): its count (one when it carries none), the
    sum of its loss over that count (0 where it counts nothing), its samples."""
    count = count_of(loss)
    count = torch.ones((), device=loss.device) if count is None else count.to(loss.device)
    value = torch.where(count > 0, loss.detach().double() * count, torch.zeros((), dtype=torch.float64,
                                                                               device=loss.device))
    samples = samples_of(loss) if samples is None else samples
    return torch.stack([count.double(), value, torch.tensor(float(samples), dtype=torch.float64, device=loss.device)])


def carry_marks(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``target`` with ``source``'s count and samples (a wrapper that makes a new loss tensor)."""
    for name in (COUNT, SAMPLES):
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))
    return target


def _as_tensor(count: Any, device: torch.device) -> torch.Tensor:
    if isinstance(count, bool) or not isinstance(count, (int, torch.Tensor)):
        raise TypeError(f"a loss's count must be an int or an integer tensor, got {type(count).__name__}")
    return (count if torch.is_tensor(count) else torch.tensor(count)).detach().reshape(()).to(device)


class CountedLoss:
    """``result.loss_func``: the user's ``loss_func(batch, output)``, its loss marked with its count.

    ``rule``: how the model's own loss counts labels (None: atorch cannot read the model);
    ``mode``: "tokens" (weight by the count) or "per_part_mean" (one per part).
    """

    def __init__(self, loss_func: Callable, rule: LabelRule | None, mode: str = "tokens"):
        if mode not in MODES:
            from atorch.errors import AtorchConfigError

            raise AtorchConfigError(f"loss_normalization={mode!r} is not one of {list(MODES)}: 'tokens' weights each "
                                    "part of a split batch by what its loss counts (the default), "
                                    "'per_part_mean' by one")
        self.loss_func, self.rule, self.mode = loss_func, rule, mode
        self._warned = False

    def __call__(self, batch: Any, output: Any) -> Any:
        out = self.loss_func(batch, output)
        loss = out[0] if isinstance(out, (tuple, list)) and not isinstance(out, TokenSum) else out
        marked = self._mark(loss, batch, output)
        if isinstance(out, (tuple, list)) and not isinstance(out, TokenSum):
            return type(out)([marked, *out[1:]])
        return marked

    def _mark(self, loss: Any, batch: Any, output: Any) -> Any:
        if isinstance(loss, TokenSum):
            count = _as_tensor(loss.count, loss.sum.device)
            loss = loss.sum / count.clamp(min=1)
            setattr(loss, COUNT, count)
        if not torch.is_tensor(loss):
            return loss  # check_loss names the problem at backward
        setattr(loss, SAMPLES, batch_samples(batch))
        if self.mode == "per_part_mean":
            setattr(loss, COUNT, torch.ones((), dtype=torch.int64, device=loss.device))
        elif count_of(loss) is None:
            count = self.rule.count(batch) if self.rule is not None and loss is _model_loss(output) else None
            if count is None and not self._warned and padded(batch):
                self._warned = True
                logger.warning(
                    "loss_func's loss is not the model's own and does not say what it counts, and the batch is padded "
                    "(labels -100): each part of a split batch is weighted as one, so the strategy changes the math. "
                    "Return atorch.TokenSum(sum, count) or atorch.with_count(mean, count) from loss_func, or pass "
                    "loss_normalization='per_part_mean' to choose this weighting (docs/loss_normalization.md)")
            if count is not None:
                setattr(loss, COUNT, count)
        return loss


def counted_loss(model: torch.nn.Module, loss_func: Callable | None, mode: str) -> CountedLoss | None:
    """``loss_func`` wrapped to mark its losses with their counts (None stays None)."""
    from atorch.loss.counting import rule_for

    if loss_func is None:
        return None
    return CountedLoss(loss_func, rule_for(model), mode)


def user_loss_func(loss_func: Any) -> Any:
    """The function the user gave, inside the counting wrapper (and only that one)."""
    return loss_func.loss_func if isinstance(loss_func, CountedLoss) else loss_func


def _model_loss(output: Any) -> Any:
    if isinstance(output, Mapping):
        return output.get("loss")
    return getattr(output, "loss", None)


def batch_samples(batch: Any) -> int:
    """The samples in a batch: the first dim of its labels, else of its first tensor."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim():
        return labels.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
    first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim()), None)
    return first.shape[0] if first is not None else 0
