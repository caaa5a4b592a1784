"""Decisions every rank takes together, through collectives on a process group of their own.

The agreements have a group of their own (over every rank, gloo, created once per default group)
so that they are never matched against the model's collectives: a rank that failed alone and
waits here cannot collide with a peer still inside DDP's or FSDP's all-reduce on the default
group (gloo aborts the process on such a mismatch). The peer leaves its collective when it times
out (a dry run's groups have the candidate's timeout, see :func:`atorch.auto.search.dryrun.dry_run`)
and then joins the agreement.
"""

import torch
import torch.distributed as dist

_agreement: tuple = (None, None)  # (the default group it belongs to, the agreement group)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agreement_group() -> dist.ProcessGroup:
    """The agreements' process group, created on first use (a collective call: the first use must
    come where every rank is in step, before any group a candidate creates)."""
    global _agreement
    world, group = _agreement
    if world is not dist.GroupMember.WORLD:
        # gloo, whatever the default backend: the agreements exchange a few numbers on the CPU.
        group = dist.new_group(backend="gloo", group_desc="atorch_search_agreement")
        _agreement = (dist.GroupMember.WORLD, group)
    return group


def all_ok(ok: bool) -> bool:
    """True only when ``ok`` is true on every rank."""
    if not _active():
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=agreement_group())
    return flag.item() == 1.0


def max_over_ranks(value: float | None) -> float | None:
    """The largest value over ranks; None when any rank has None."""
    if not _active():
        return value
    data = torch.tensor([float("nan") if value is None else float(value)], dtype=torch.float64)
    dist.all_reduce(data, op=dist.ReduceOp.MAX, group=agreement_group())
    missing = torch.tensor([1.0 if value is None else 0.0])
    dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=agreement_group())
    return None if missing.item() else data.item()


def max_each(*values: float) -> list[float]:
    """Element-wise maximum over ranks of a few numbers, in one collective."""
    if not _active():
        return list(values)
    data = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(data, op=dist.ReduceOp.MAX, group=agreement_group())
    return data.tolist()


def agreed(first, *values: float | None) -> tuple:
    """Rank 0's ``first``, then the largest of each of ``values`` over ranks (None where any rank
    has None), in one collective."""
    rows = gathered((first, values))
    columns = zip(*(each for _, each in rows))
    return (rows[0][0], *(None if any(v is None for v in column) else max(column) for column in columns))


def gathered(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=agreement_group())
    return out


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=agreement_group())
    return box[0]


_ELSEWHERE = "another rank failed"


def first_error(error: str | None, at: float | None = None) -> str:
    """The failure message of the rank that failed first (``at``: seconds into the dry run when
    this rank failed); ranks that only stopped because of it say so, or fail later (a peer timed
    out in a collective the failed rank never joined)."""
    errors = [(at, error)]
    if _active():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, (at, error), group=agreement_group())
    own = [(float("inf") if when is None else when, rank, message) for rank, (when, message) in enumerate(errors)
           if message is not None and _ELSEWHERE not in message]
    if not own:
        return "failed on another rank"
    _, rank, message = min(own)
    return f"rank {rank}: {message}" if len(errors) > 1 else message
