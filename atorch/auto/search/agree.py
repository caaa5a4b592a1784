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

from atorch.distributed.side_groups import side_group

_wanted_timeout: float | None = None


class AgreementTimeout(RuntimeError):
    """A rank did not reach one of the search's agreements in time: it stopped, hung or died."""


def set_timeout(seconds: float | None) -> None:
    """How long an agreement waits for the slowest rank before it raises :class:`AgreementTimeout`
    (``None``: torch's default, 30 minutes). Call it on every rank, in step (the search does at
    its start): the next agreement builds its group with this timeout."""
    global _wanted_timeout
    _wanted_timeout = None if seconds is None else float(seconds)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agreement_group() -> dist.ProcessGroup:
    """The agreements' process group, created on first use (a collective call: the first use must
    come where every rank is in step, before any group a candidate creates). gloo, whatever the
    default backend: the agreements exchange a few numbers on the CPU."""
    return side_group("atorch_search_agreement", _wanted_timeout)


def _agree(what: str, collective, *args, **kwargs):
    """Run one agreement's collective; a peer that never comes is an AgreementTimeout naming it."""
    try:
        return collective(*args, group=agreement_group(), **kwargs)
    except RuntimeError as error:  # gloo's timeout (DistBackendError is a RuntimeError)
        text = str(error)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        waited = "" if _wanted_timeout is None else f" within {_wanted_timeout:.0f}s"
        raise AgreementTimeout(
            f"rank {dist.get_rank()}: not every rank reached the search's agreement ({what}){waited}: a rank "
            "stopped, hung or died (a frozen file system, a deadlocked data loader, a killed process), and the "
            f"search cannot go on without it; find that rank's last log line, then restart the job "
            f"({text.strip().splitlines()[0] if text.strip() else type(error).__name__})") from error


def all_ok(ok: bool) -> bool:
    """True only when ``ok`` is true on every rank."""
    if not _active():
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    _agree("whether every rank succeeded", dist.all_reduce, flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


def max_over_ranks(value: float | None) -> float | None:
    """The largest value over ranks; None when any rank has None."""
    if not _active():
        return value
    data = torch.tensor([float("nan") if value is None else float(value)], dtype=torch.float64)
    _agree("the largest value", dist.all_reduce, data, op=dist.ReduceOp.MAX)
    missing = torch.tensor([1.0 if value is None else 0.0])
    _agree("the largest value", dist.all_reduce, missing, op=dist.ReduceOp.MAX)
    return None if missing.item() else data.item()


def max_each(*values: float) -> list[float]:
    """Element-wise maximum over ranks of a few numbers, in one collective."""
    if not _active():
        return list(values)
    data = torch.tensor(values, dtype=torch.float64)
    _agree("the slowest rank's clock", dist.all_reduce, data, op=dist.ReduceOp.MAX)
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
    _agree("every rank's answer", dist.all_gather_object, out, obj)
    return out


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    _agree("rank 0's decision", dist.broadcast_object_list, box, src=0)
    return box[0]


_ELSEWHERE = "another rank failed"


def first_error(error: str | None, at: float | None = None) -> str:
    """The failure message of the rank that failed first (``at``: seconds into the dry run when
    this rank failed); ranks that only stopped because of it say so, or fail later (a peer timed
    out in a collective the failed rank never joined)."""
    errors = [(at, error)]
    if _active():
        errors = [None] * dist.get_world_size()
        _agree("which rank failed first", dist.all_gather_object, errors, (at, error))
    own = [(float("inf") if when is None else when, rank, message) for rank, (when, message) in enumerate(errors)
           if message is not None and _ELSEWHERE not in message]
    if not own:
        return "failed on another rank"
    _, rank, message = min(own)
    return f"rank {rank}: {message}" if len(errors) > 1 else message
