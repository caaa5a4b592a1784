"""Cross-entropy over vocab-sharded logits, without gathering them (Megatron's vocab-parallel CE)."""

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, label_smoothing, ignore_index, group):
        world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        rank = dist.get_rank(group) if world > 1 else 0
        logits = logits.float()
        part = logits.shape[-1]
        vocab = part * world
        shifted = logits - _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        start = rank * part
        ignored = labels == ignore_index
        outside = (labels < start) | (labels >= start + part) | ignored
        local_labels = (labels - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = _all_reduce(predicted, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        log_z = sum_exp.log()
        loss = log_z - predicted
        if label_smoothing > 0:
            mean_log_p = _all_reduce(shifted.sum(dim=-1), group) / vocab - log_z
            loss = (1 - label_smoothing) * loss - label_smoothing * mean_log_p
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_labels, outside, ignored)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, outside, ignored = ctx.saved_tensors
        grad = softmax
        target_weight = (1 - ctx.label_smoothing) * (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -target_weight.unsqueeze(-1))
        if ctx.label_smoothing > 0:
            grad -= ctx.label_smoothing / ctx.vocab
        grad *= (grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1)
        return grad, None, None, None, None


def parallel_cross_entropy(parallel_logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                           ignore_index: int = -100, group=None) -> torch.Tensor:
    """Per-token loss from logits whose last dim is this rank's vocab slice.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), labels.flatten(), reduction="none",
    label_smoothing=label_smoothing, ignore_index=ignore_index)`` reshaped like ``labels``, and
    so do its gradients; only three per-token numbers cross ranks (max, sum of exponentials,
    the target logit), never the logits. ``group=None`` reads the tensor-parallel group from
    :mod:`atorch.parallel_state`.
    """
    if group is None:
        from atorch import parallel_state

        group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(parallel_logits, labels, float(label_smoothing), int(ignore_index), group)
