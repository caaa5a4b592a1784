"""One optimizer step's weighting: each part's loss times its count, over the global batch's count.

A step's gradient must be the gradient of the global batch's mean, ``sum of every counted loss /
N`` where N counts over every data rank and every accumulation micro-batch. Data-parallel
reductions average over the W data ranks, so a part's backward carries ``loss x count x W / N``:

- without accumulation, N is known before the backward: one all-reduce of ``[count, sum, samples]``
  over the data group, then the backward of the scaled loss (no pass over the gradients);
- with accumulation, each micro-batch's backward carries ``loss x count / K`` (K: the previous
  step's count per micro-batch and rank, the same on every rank, so gradients keep a mean's
  magnitude); after the last one, one all-reduce gives N and the gradients are multiplied by
  ``W x K / N`` before anyone reads them.

Either way one small all-reduce a step, and the backward stays per micro-batch. A step whose
global count is 0 (every label -100) gets zero gradients and no optimizer step (loop.step).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from atorch.loss.contract import weighed_part


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
        self._local: torch.Tensor | None = None  # [count, sum, samples] of this step's parts so far
        self._totals: torch.Tensor | None = None  # the last finished step's, over the data group
        self._last: StepLoss | None = None

    def loss_to_backward(self, loss: torch.Tensor, accumulation: int = 1) -> torch.Tensor:
        """The tensor whose backward gives this part's share of the step's gradient
        (``accumulation``: the micro-batches of one optimizer step)."""
        part = weighed_part(loss)
        count = part[0].clone()  # _local is all-reduced in place
        self._local = part if self._local is None else self._local + part
        if accumulation == 1:
            totals = self._reduce()
            return loss * (count * self.data_size / totals[0].clamp(min=1)).to(loss.dtype)
        return loss * (count / self.expected).to(loss.dtype)

    def finish_accumulation(self, params, accumulation: int) -> None:
        """After the last micro-batch's backward: the gradients multiplied by ``W x K / N``."""
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
