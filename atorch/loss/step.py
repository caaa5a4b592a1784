"""One optimizer step's weighting: each part's loss times its count, over the global batch's count.

A step's gradient must be the gradient of the global batch's mean, ``sum of every counted loss /
N`` where N counts over every data rank and every accumulation micro-batch. Data-parallel
reductions average over the W data ranks, so a part's backward carries ``loss x count x W / N``:

- without accumulation, N is known before the backward: one all-reduce of ``[count, sum, samples]``
  over the data group, then the backward of the scaled loss (no pass over the gradients);
- with accumulation, each micro-batch's backward carries ``loss x count / K`` (K: the previous
  step's count per micro-batch and rank, at the first step the first micro-batch's mean count
  over the ranks; the same on every rank, so gradients keep a mean's magnitude); after the last
  one, one all-reduce gives N and the gradients are multiplied by ``W x K / N`` before anyone
  reads them.

Either way one small all-reduce a step, and the backward stays per micro-batch. A step whose
global count is 0 (every label -100) gets zero gradients and no optimizer step (loop.step).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from atorch.loss.contract import weighed_part


def _weighted(loss: torch.Tensor, count: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``loss x weight``; 0 for a part that counts nothing (its mean is NaN, 0/0), so that neither
    its backward nor the value handed back carries the NaN."""
    return torch.where(count > 0, loss * weight.to(loss.dtype), torch.zeros((), dtype=loss.dtype, device=loss.device))


@dataclass(frozen=True)
class StepLoss:
    """What one optimizer step trained on, over the whole global batch (every rank, every part)."""

    loss: float | None  # the mean over every counted position (None: nothing was counted)
    tokens: int         # the positions the loss counted (label tokens; parts without a count: one each)
    samples: int        # the samples (sequences) the step took


class StepTokens:
    """The weighting state of ``result.backward`` (atorch/auto/loop.py); one per applied strategy."""

    def __init__(self, group: dist.ProcessGroup | None, data_size: int):
        self.group, self.data_size = group, max(int(data_size), 1)
        self.skipped = 0  # optimizer steps skipped because their global batch counted nothing
        self.expected = 1.0  # K: the previous step's count per micro-batch and data rank
        self._first_part = True  # the first deferred part sets K from its own count
        self._local: torch.Tensor | None = None  # [count, sum, samples] of this step's parts so far
        self._totals: torch.Tensor | None = None  # the last finished step's, over the data group
        self._last: StepLoss | None = None

    def loss_to_backward(self, loss: torch.Tensor, accumulation: int = 1) -> torch.Tensor:
        """The tensor whose backward gives this part's share of the step's gradient
        (``accumulation``: the micro-batches of one optimizer step)."""
        if accumulation > 1:
            return self.deferred(loss)
        count = self._add(loss)
        totals = self._reduce()
        return _weighted(loss, count, count * self.data_size / totals[0].clamp(min=1))

    def deferred(self, loss: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """A part of a step whose count is known only after its last part: its backward carries
        ``loss x multiplier x count / K`` (``multiplier`` undoes a division the caller's loop made);
        :meth:`finish_accumulation` scales the gradients after the last part."""
        count = self._add(loss)
        if self._first_part:  # K from this part's mean count over the ranks: one more all-reduce, once
            self._first_part = False
            first = count.double().clone()
            if self.group is not None and self.data_size > 1:
                dist.all_reduce(first, group=self.group)
            self.expected = max(float(first) / self.data_size, 1.0)
        return _weighted(loss, count, count * multiplier / self.expected)

    def _add(self, loss: torch.Tensor) -> torch.Tensor:
        """This part's ``[count, sum, samples]`` added to the step's; its count."""
        part = weighed_part(loss)
        count = part[0].clone()  # _local is all-reduced in place
        self._local = part if self._local is None else self._local + part
        return count

    def finish_accumulation(self, params, accumulation: int) -> None:
        """After the last part's backward (``accumulation`` parts a data rank): the gradients
        multiplied by ``W x K / N``."""
        totals = self._reduce()
        factor = self.data_size * self.expected / max(float(totals[0]), 1.0)
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(factor)
        if totals[0] > 0:
            self.expected = float(totals[0]) / (self.data_size * accumulation)

    def record(self, totals: torch.Tensor) -> None:
        """A step whose parts were weighted elsewhere (a pipeline schedule): its global totals."""
        self._totals, self._last = totals.detach(), None

    def _reduce(self) -> torch.Tensor:
        totals, self._local = self._local, None
        if self.group is not None and self.data_size > 1:
            dist.all_reduce(totals, group=self.group)
        self._totals, self._last = totals, None
        return totals

    @property
    def empty(self) -> bool:
        """Whether the last finished step counted nothing (every label -100): it must not step."""
        return self._totals is not None and float(self._totals[0]) == 0

    @property
    def last(self) -> StepLoss | None:
        """The last finished step's loss and counts (None before the first)."""
        if self._last is None and self._totals is not None:
            count, total, samples = (float(v) for v in self._totals)
            self._last = StepLoss(total / count if count else None, int(count), int(samples))
        return self._last
