"""Decisions every rank takes together, through collectives on the default process group."""

import torch
import torch.distributed as dist


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_ok(ok: bool) -> bool:
    """True only when ``ok`` is true on every rank."""
    if not _active():
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


def max_over_ranks(value: float | None) -> float | None:
    """The largest value over ranks; None when any rank has None."""
    if not _active():
        return value
    data = torch.tensor([float("nan") if value is None else float(value)], dtype=torch.float64)
    dist.all_reduce(data, op=dist.ReduceOp.MAX)
    missing = torch.tensor([1.0 if value is None else 0.0])
    dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    return None if missing.item() else data.item()


def max_each(*values: float) -> list[float]:
    """Element-wise maximum over ranks of a few numbers, in one collective."""
    if not _active():
        return list(values)
    data = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(data, op=dist.ReduceOp.MAX)
    return data.tolist()


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_ELSEWHERE = "another rank failed"


def first_error(error: str | None) -> str:
    """The first rank's own failure message (ranks that only stopped because of it say so)."""
    errors = [error]
    if _active():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    for rank, message in enumerate(errors):
        if message is not None and _ELSEWHERE not in message:
            return f"rank {rank}: {message}" if len(errors) > 1 else message
    return "failed on another rank"
