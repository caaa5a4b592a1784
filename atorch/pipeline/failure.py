"""A pipeline step that fails on one rank stops every rank of the pipeline within moments.

Inside a schedule each rank waits in point-to-point receives (and, with data or tensor
parallelism, in collectives) for its peers. A rank whose stage raises never sends what they wait
for, and gloo gives a rank no way to abandon a receive it is blocked in: the peer would wait
until its process group's timeout (30 minutes by default). So the failing rank

1. records why it failed in the job's store, under a key of each of its groups (the first
   failure recorded wins), and
2. closes its connections in those groups: gloo closes every connection of a group when one of
   its receives times out, so a receive posted with a tag nothing sends and a 1 ms timeout does
   it. A peer blocked in a receive from this rank raises at once ("Connection closed by peer").

A peer whose step raised that way reads the recorded reason, records it under its own groups and
closes them in turn (so a stage two hops away, or a data-parallel replica waiting in the
gradient all-reduce, stops too), and raises :class:`PipelineStepError` naming the rank that
failed first and its error. The groups stay closed: the model cannot run again, and says so.

Only gloo groups are closed this way; with other backends a peer waits for its group's timeout.
The default group is never closed (PipelineModel runs its schedule on a group of its own when
the pipeline spans the whole world).
"""

import datetime

import torch
import torch.distributed as dist

_KEY = "atorch/pipeline_failed/"
# A tag no schedule uses: the receive that closes a group must never match a real message.
_CLOSING_TAG = 0x7A7A17


class PipelineStepError(RuntimeError):
    """A pipeline step failed on some rank: every rank of the pipeline raises it, naming the rank
    that failed first and its error; the model's process groups are closed (restart the job)."""


def own_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or a new group over the same ranks when it is the default group (which a failed
    step must never close). A collective call when it creates one."""
    if group is None or group is not dist.GroupMember.WORLD or dist.get_world_size() == 1:
        return group
    return dist.new_group(group_desc="atorch_pipeline")


def stop(groups: list, error: BaseException, rank_text: str, step: int) -> str:
    """After ``error`` ended this rank's step: the reason every rank reports (the first recorded
    failure's, else this one's), recorded under ``groups``' keys; then ``groups`` are closed."""
    groups = [g for g in dict.fromkeys(groups) if g is not None and g is not dist.GroupMember.WORLD
              and dist.get_world_size(g) > 1]
    own = f"{rank_text}: {_first_line(error)}"
    store = _store()
    recorded = _recorded(store, groups)
    reason = recorded if recorded is not None else own
    if store is not None:
        for group in groups:  # the first failure's reason, for the peers of every group of this rank
            try:
                store.compare_set(_KEY + group.group_name, "", reason)
            except RuntimeError:  # noqa: PERF203 - a store that is gone: the peers still see the close
                pass
    for group in groups:
        _close(group)
    if recorded is None:
        return (f"step {step} of this PipelineModel failed on {own}; every rank of the pipeline stops this step "
                "and its process groups are closed: fix the cause and restart the job")
    return (f"step {step} of this PipelineModel stopped on rank {dist.get_rank()} because another rank failed: "
            f"{recorded}; its process groups are closed: fix the cause and restart the job")


def _recorded(store, groups: list) -> str | None:
    """The failure a peer recorded under one of ``groups``, if any."""
    if store is None:
        return None
    for group in groups:
        key = _KEY + group.group_name
        try:
            if store.check([key]):
                return store.get(key).decode()
        except RuntimeError:  # noqa: PERF203
            return None
    return None


def _close(group: dist.ProcessGroup) -> None:
    """Close this rank's connections in a gloo ``group`` (every peer's pending receive from this
    rank raises at once): gloo closes all of a group's connections when a receive times out."""
    if "gloo" not in str(dist.get_backend(group)):
        return
    peer = 1 if dist.get_rank(group) == 0 else 0
    try:
        work = dist.irecv(torch.empty(1), group=group, group_src=peer, tag=_CLOSING_TAG)
        work.wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:  # the expected timeout, or connections already closed by a peer
        pass


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _first_line(error: BaseException) -> str:
    """The error in one line; torch's "[Stage 0] failed to run forward" wrapper with its cause."""
    def line(e):
        text = str(e).strip()
        return text.splitlines()[0].rstrip(":") if text else ""

    if error.__cause__ is not None and line(error).startswith("[Stage"):
        return f"{line(error)}: {_first_line(error.__cause__)}"
    return f"{type(error).__name__}: {line(error)}".rstrip(": ")
