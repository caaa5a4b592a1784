"""Process groups of atorch's own beside the job's: gloo over every rank, with a timeout.

The search's agreements and a checkpoint's collectives run on such a group, so that they are never
matched against the model's collectives on the default group, and so that a rank that stops
answering ends the others' wait after the timeout instead of the default group's (30 minutes).
"""

import datetime

import torch.distributed as dist

# name -> (the default group it was made under, the group, its timeout in seconds or None)
_made: dict[str, tuple] = {}


def side_group(name: str, seconds: float | None) -> dist.ProcessGroup:
    """The gloo group ``name`` over every rank with ``seconds`` of timeout (None: torch's default),
    made on first use and again when the default group or the timeout changes. Making one is a
    collective: the first use must come where every rank is in step."""
    world, group, timeout = _made.get(name, (None, None, None))
    if world is not dist.GroupMember.WORLD or timeout != seconds:
        extra = {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}
        group = dist.new_group(backend="gloo", group_desc=name, **extra)
        _made[name] = (dist.GroupMember.WORLD, group, seconds)
    return group
