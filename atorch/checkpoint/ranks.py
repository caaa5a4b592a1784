"""How the ranks of a save or load stay together: each step's outcome is agreed before the next.

A rank that fails alone must not leave the others inside a collective it will never join, nor let
them go on changing their model: :func:`agree` runs a step on every rank, shares whether it
failed, and then every rank returns, or every rank raises the same :class:`CheckpointError`.
Without a process group these are plain calls. With a ``timeout``, a save's or load's own
collectives (these agreements and torch.distributed.checkpoint's planning and commit) run on a
gloo group of their own with that timeout, so a rank that stops answering (a frozen filesystem, a
stopped process) ends the others' wait with a CheckpointError instead of torch's 30 minutes.
"""

from contextlib import contextmanager

import torch.distributed as dist

from atorch.distributed.side_groups import side_group
from atorch.errors import CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


_timeout: float | None = None


@contextmanager
def deadline(seconds: float | None):
    """Within it, the checkpoint's collectives wait at most ``seconds`` for a rank (None: the
    default group's timeout). Entered on every rank in step: the first use of a timeout builds its
    group (a collective)."""
    global _timeout
    if seconds is not None and seconds <= 0:
        raise ValueError(f"checkpoint timeout={seconds!r}: give seconds > 0, or None for the process group's")
    before, _timeout = _timeout, seconds
    try:
        group()
        yield
    finally:
        _timeout = before


def group():
    """The process group of the checkpoint's collectives: None (the default group) without a
    timeout, else a gloo group with it."""
    if _timeout is None or not distributed():
        return None
    return side_group("atorch_checkpoint", _timeout)


def gather(value) -> list:
    """Every rank's ``value``, by rank (plain data; collective)."""
    if not distributed():
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value, group=group())
    return values


def from_rank0(value):
    """Rank 0's ``value`` on every rank (collective)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group())
    return box[0]


def peer_failure(what: str, error: RuntimeError, outcome: str) -> CheckpointError:
    """A collective that failed under a save or load (gloo's "Connection closed by peer", ...) as
    atorch's error: in a job, another rank stopped (killed, out of memory, a failed filesystem)."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    waited = f" within the checkpoint timeout of {_timeout:g}s" if _timeout is not None else ""
    cause = (f" (another rank stopped or did not answer{waited}: killed, out of memory, stopped, or its "
             "filesystem failed or froze)") if distributed() else ""
    return CheckpointError(f"checkpoint: {what} failed: {type(error).__name__}: {first}{cause}; {outcome}")


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def agree(action, on_failure=None):
    """``action()`` on every rank; its result here, once every rank succeeded.

    When it raised on any rank, ``on_failure()`` runs on every rank (to undo what ``action`` did
    there) and every rank raises :class:`CheckpointError` with the first failing rank's reason.
    """
    result, error = None, None
    try:
        result = action()
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = exc
    errors = gather(None if error is None else _describe(error))
    failed = {r: message for r, message in enumerate(errors) if message is not None}
    if not failed:
        return result
    if on_failure is not None:
        on_failure()
    first = min(failed)
    if not distributed():
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(failed[first]) from error
    others = sorted(set(failed) - {first})
    also = f" (ranks {others} failed too)" if others else ""
    raise CheckpointError(f"checkpoint: rank {first} failed: {failed[first]}{also}") from error


def on_rank0(action):
    """Run ``action`` on rank 0 only; its result on every rank, or :class:`CheckpointError` on every
    rank if it failed there."""
    return from_rank0(agree(lambda: action() if rank() == 0 else None))
