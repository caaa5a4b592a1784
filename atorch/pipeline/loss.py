"""Microbatches in, losses out: splitting a batch, picking the loss from a model's output, and
returning it to the ranks that asked for it."""

from typing import Any

import torch
import torch.distributed as dist

from atorch.errors import MethodConfigError, WorldSizeError


def split_batch(kwargs: dict[str, Any], num_microbatches: int) -> list[dict[str, Any]]:
    """``kwargs`` cut into ``num_microbatches`` equal parts along dim 0 of every tensor (other
    values are repeated); a batch that does not divide raises :class:`WorldSizeError`."""
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] % num_microbatches):
            size = value.shape[0] if value.ndim else "a scalar"
            raise WorldSizeError(
                f"{name} has batch size {size}, which does not split into {num_microbatches} equal microbatches; "
                "make the batch size a multiple of num_microbatches"
            )
    parts = [dict() for _ in range(num_microbatches)]
    for name, value in kwargs.items():
        chunks = value.chunk(num_microbatches) if isinstance(value, torch.Tensor) else [value] * num_microbatches
        for part, chunk in zip(parts, chunks):
            part[name] = chunk
    return parts


def pick_loss(output: Any, spec: Any) -> torch.Tensor:
    """The loss inside ``output``: ``spec`` is a tuple/list or dict of booleans shaped like the output
    with ``True`` at the loss; ``None`` takes the output itself (a tensor), its ``loss`` field, or its
    first item."""
    if spec is None:
        if isinstance(output, torch.Tensor):
            return output
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)) and output:
            loss = output[0]
        if not isinstance(loss, torch.Tensor):
            raise MethodConfigError(
                f"cannot find the loss in the model's output ({type(output).__name__}); return the loss, give "
                "output_loss_value_spec (e.g. (True, False) for a (loss, logits) tuple) or loss_fn"
            )
        return loss
    keys = list(spec) if isinstance(spec, dict) else list(range(len(spec)))
    marked = [key for key in keys if spec[key]]
    if len(marked) != 1:
        raise MethodConfigError(f"output_loss_value_spec {spec!r} must mark exactly one item True (the loss)")
    return output[marked[0]]


def reduce_losses(losses, topology, group, last_group_rank: int, num_microbatches: int, per_microbatch: bool,
                  broadcast: bool):
    """The loss a rank returns from run_train/run_eval (see PipelineModel.run_train): ``losses`` on
    the rank holding the last stage, ``None`` elsewhere; ``group``: the pipeline's."""
    value = None if losses is None else torch.stack([loss.detach().float() for loss in losses])
    if broadcast:
        if value is None:
            value = torch.zeros(num_microbatches)
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast(value, group_src=last_group_rank, group=group)
        if topology.data_parallel_size > 1:
            dist.all_reduce(value, group=topology.data_parallel_group)
            value /= topology.data_parallel_size
    if value is None:
        return None
    return list(value.unbind()) if per_microbatch else value.mean()
