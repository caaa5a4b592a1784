"""A training-progress line every few steps, and the writers that send the same figures elsewhere.

    log = StepLogger(every=10, writers=[TensorBoardWriter("runs/x")])
    for batch in result.dataloader:
        ...
        result.backward(loss)
        stepped = result.sync_gradients
        result.step()
        log.step(result.last_step if stepped else None, stepped=stepped)   # every 10th step, rank 0:
        # step   10  loss 3.2104  812.4 samples/s  20795 tokens/s  peak 1.2GiB

Given ``result.last_step`` (a :class:`~atorch.loss.StepLoss`), the loss is each optimizer step's
global batch's mean over its label tokens (what the serial model would print, whatever the
strategy splits), averaged over the steps since the last line; samples and tokens are counted
from it. Given a loss tensor instead (any loop), the loss is the mean over the ranks and steps
(one all-reduce per line, none between lines) and samples/s needs ``samples_per_step``. Peak
memory is the largest over the ranks (the device's allocator peak on GPU, the process's peak
resident size on CPU).
A writer is any callable ``writer(metrics: dict, step: int)``; TensorBoard and Weights & Biases
writers are here, imported only when built.
"""

import resource
import sys
import time
from collections.abc import Callable, Iterable

import torch

from atorch.loss.step import StepLoss
from atorch.utils.log import logger

Writer = Callable[[dict, int], None]


class StepLogger:
    """Logs ``step  loss  samples/s  tokens/s  peak`` every ``every`` calls to :meth:`step` (see module doc).

    ``samples_per_step``: samples of the whole job per optimizer step (the global batch, times the
    gradient accumulation steps), for steps logged with a loss tensor; ``result.last_step``
    brings its own samples and tokens. ``start``: the step count so far
    (a resumed run's), so lines carry the job's step numbers. Every rank must call :meth:`step`
    (the line's all-reduce runs on all of them); only rank 0 logs and writes.
    """

    def __init__(self, every: int = 10, samples_per_step: int | None = None, writers: Iterable[Writer] = (),
                 prefix: str = "", start: int = 0):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (steps between lines), got {every!r}")
        self.every, self.samples_per_step, self.prefix = every, samples_per_step, prefix
        self.writers = list(writers)
        self.steps = start
        self._logged_at = start  # self.steps at the last line
        self._loss_sum: torch.Tensor | None = None
        self._count = 0
        self._global: list[float] = []  # StepLoss losses since the last line (already the same on every rank)
        self._tokens = self._samples = 0  # StepLoss counts since the last line
        self._since = time.perf_counter()

    def step(self, loss: "StepLoss | torch.Tensor | float | None" = None, *, stepped: bool = True) -> dict | None:
        """Count one optimizer step with its loss; every ``every`` steps, log and return the metrics.

        ``loss``: ``result.last_step`` (the global batch's loss and counts), or a loss tensor.

        Under gradient accumulation, call it for every micro-batch with
        ``stepped=result.sync_gradients``: the micro-batches' losses join the mean, and only the
        call that completes an accumulation counts a step (so step numbers and samples/s are the
        optimizer's, not the micro-batches')."""
        if isinstance(loss, StepLoss):
            self._tokens, self._samples = self._tokens + loss.tokens, self._samples + loss.samples
            if loss.loss is not None:  # None: a step without a counted label (skipped)
                self._global.append(loss.loss)
        elif loss is not None:
            value = loss.detach().float().reshape(()) if torch.is_tensor(loss) else torch.tensor(float(loss))
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value.to(self._loss_sum.device)
            self._count += 1
        if not stepped:
            return None
        self.steps += 1
        if self.steps % self.every:
            return None
        return self.flush()

    def flush(self) -> dict | None:
        """Log the steps since the last line now (e.g. after the last step); return the metrics
        (None when no step was counted since the last line)."""
        import torch.distributed as dist

        elapsed, steps = time.perf_counter() - self._since, self.steps - self._logged_at
        if steps == 0:
            return None
        device = self._loss_sum.device if self._loss_sum is not None else torch.device("cpu")
        # [loss sum, losses counted, ranks] summed; peak memory maxed: two collectives per line.
        totals = torch.tensor([0.0 if self._loss_sum is None else self._loss_sum.item(), float(self._count), 1.0],
                              dtype=torch.float64, device=device)
        peak = torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        metrics: dict = {}
        if self._global:
            metrics["loss"] = sum(self._global) / len(self._global)
        elif totals[1] > 0:
            metrics["loss"] = (totals[0] / totals[1]).item()
        samples = self._samples or (self.samples_per_step or 0) * steps
        if samples and elapsed > 0:
            metrics["samples_per_second"] = samples / elapsed
        if self._tokens:
            metrics["tokens"] = self._tokens
            if elapsed > 0:
                metrics["tokens_per_second"] = self._tokens / elapsed
        metrics["peak_memory_bytes"] = int(peak.item())
        self._loss_sum, self._count, self._since, self._logged_at = None, 0, time.perf_counter(), self.steps
        self._global, self._tokens, self._samples = [], 0, 0
        if _rank() == 0:
            logger.info(self.prefix + format_metrics(self.steps, metrics))
            for writer in self.writers:
                writer(metrics, self.steps)
        return metrics


def format_metrics(step: int, metrics: dict) -> str:
    from atorch.utils.sizes import size_text

    parts = [f"step {step:4d}"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "samples_per_second" in metrics:
        parts.append(f"{metrics['samples_per_second']:.1f} samples/s")
    if "tokens_per_second" in metrics:
        parts.append(f"{metrics['tokens_per_second']:.0f} tokens/s")
    parts.append(f"peak {size_text(metrics['peak_memory_bytes'])}")
    return "  ".join(parts)


def peak_memory_bytes(device: torch.device) -> int:
    """The allocator's peak on a CUDA device; else this process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TensorBoardWriter:
    """Each line's metrics as TensorBoard scalars under ``log_dir`` (``pip install tensorboard``)."""

    def __init__(self, log_dir: str, prefix: str = "train/"):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's module needs the tensorboard package
            raise ImportError("TensorBoardWriter needs tensorboard: pip install 'atorch[tensorboard]'") from exc
        self.prefix = prefix
        self._writer = SummaryWriter(log_dir) if _rank() == 0 else None

    def __call__(self, metrics: dict, step: int) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            self._writer.add_scalar(self.prefix + name, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbWriter:
    """Each line's metrics to Weights & Biases (``pip install wandb``); ``init_args`` go to
    ``wandb.init`` on rank 0 at the first line, unless a run is already active."""

    def __init__(self, **init_args):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbWriter needs wandb: pip install wandb") from exc
        self._wandb, self._init_args = wandb, init_args

    def __call__(self, metrics: dict, step: int) -> None:
        if self._wandb.run is None:
            self._wandb.init(**self._init_args)
        self._wandb.log(metrics, step=step)
