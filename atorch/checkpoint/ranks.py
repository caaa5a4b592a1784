"""How the ranks of a save or load stay together: each step's outcome is agreed before the next.

A rank that fails alone must not leave the others inside a collective it will never join, nor let
them go on changing their model: :func:`agree` runs a step on every rank, shares whether it
failed, and then every rank returns, or every rank raises the same :class:`CheckpointError`.
Without a process group these are plain calls.
"""

import torch.distributed as dist

from atorch.errors import CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def gather(value) -> list:
    """Every rank's ``value``, by rank (plain data; collective)."""
    if not distributed():
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def from_rank0(value):
    """Rank 0's ``value`` on every rank (collective)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def peer_failure(what: str, error: RuntimeError, outcome: str) -> CheckpointError:
    """A collective that failed under a save or load (gloo's "Connection closed by peer", ...) as
    atorch's error: in a job, another rank stopped (killed, out of memory, a failed filesystem)."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    cause = " (another rank stopped: killed, out of memory, or its filesystem failed)" if distributed() else ""
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
