"""Process-group start-up from the torchrun environment, and this process's place in it."""

import datetime
import os
import sys
from types import FunctionType

import torch
import torch.distributed as dist

from atorch.utils.log import logger

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Join the process group that torchrun describes in the environment.

    ``backend`` defaults to ``"nccl"`` when CUDA is available and ``"gloo"`` otherwise. A plain
    ``python train.py`` (no torchrun variables) is a valid single process: nothing is started and
    ``False`` is returned. Calling it again once initialized does nothing and returns ``True``.

    Example::

        # torchrun --nproc_per_node=2 train.py
        import atorch
        atorch.init_distributed()
        print(atorch.rank(), atorch.world_size(), atorch.device())
    """
    if dist.is_initialized():
        return True
    present = [name for name in _TORCHRUN_VARS if name in os.environ]
    if not present:
        return False
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed found {present} but not {missing} in the environment; launch with "
            "torchrun (it sets all of them) or unset them to run a single process."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs.update(_store_of_this_attempt(kwargs.get("timeout")))
    dist.init_process_group(backend=backend, **kwargs)
    logger.info("process group started: backend=%s world_size=%d", backend, dist.get_world_size())
    return True


def _store_of_this_attempt(timeout: datetime.timedelta | None) -> dict:
    """torchrun's agent store, under a prefix for this restart attempt.

    After ``--max-restarts`` restarts the workers, they find the agent's store still holding the
    previous attempt's keys (gloo's peer addresses among them); a new rank could read a dead
    peer's address and fail to connect ("connectFullMesh failed ... Connection refused") or wait
    until the timeout. A prefix per attempt keeps each attempt to its own keys.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout or datetime.timedelta(minutes=5))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"atorch/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def destroy_groups(groups) -> None:
    """Destroy these process groups (the default group is left alone), first making DTensor
    forget the meshes built on them.

    DTensor memoizes each op's output sharding keyed by its inputs' specs, and a ``DeviceMesh``
    compares equal to another over the same ranks and dim names whatever its process groups. A
    later mesh over the same ranks (the next dry run's) then hits that memo, and its op outputs
    carry the dead mesh, whose next collective fails with "Could not resolve the process group
    registered under the name N". The memo is cleared while the groups still exist.
    """
    _forget_dtensor_shardings()
    for group in groups:
        if group is not None and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _forget_dtensor_shardings() -> None:
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # an older torch: its memo is the sharding propagator's LRU cache
        from torch.distributed.tensor import DTensor

        propagate = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
        if hasattr(propagate, "cache_clear"):
            propagate.cache_clear()
        return
    _clear_sharding_prop_cache()


def shutdown() -> None:
    """Leave the job in order, on every rank, at the end: wait for the device's work, meet the
    other ranks, destroy the process group, and make sure nothing still holds it.

    Why each step: a rank that tears down its connections while a peer is still sending (the last
    checkpoint's collectives, a final all-reduce) can make gloo abort that peer, so the ranks meet
    first. ``destroy_process_group`` only drops torch's own references; a group that something
    else still holds lives on, with gloo's worker and socket threads, until the interpreter
    finalizes, and a process that tears it down there sometimes dies of SIGABRT ("terminate
    called without an active exception") after its job has finished, which torchrun reports as a
    failure. Some torch modules hold it by default arguments bound on their first import (see
    :func:`_release_groups_bound_at_import`); atorch's topology and the reference cycles of a
    DDP reducer hold it too. Nothing to do in a single process.
    """
    if not dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    release_groups()


def release_groups() -> None:
    """Destroy the process group and drop every reference atorch and torch keep to it (the second
    half of :func:`shutdown`, without meeting the other ranks: for a rank that leaves after a
    failure, or that met them already)."""
    import gc

    if dist.is_initialized():
        _forget_dtensor_shardings()  # a later init_distributed in this process gets fresh meshes
        dist.destroy_process_group()
    from atorch import parallel_state

    parallel_state.set_topology(None)
    _release_groups_bound_at_import()
    gc.collect()


def _release_groups_bound_at_import() -> int:
    """Replace process groups held in the default arguments of torch.distributed's functions by
    ``None`` (the default group, whichever it is when called); return how many were replaced.

    A module such as ``torch.distributed.nn.functional`` or
    ``torch.distributed.optim.zero_redundancy_optimizer`` evaluates ``group=dist.group.WORLD``
    when it is first imported: imported before the process group starts, the default is None;
    imported after (atorch imports them lazily, in a save or a strategy), it is the group itself,
    and keeps the destroyed group alive until interpreter finalization.
    """
    released = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for value in list(vars(module).values()):
            # type(), not isinstance: some module attributes warn when their class is asked for.
            if type(value) is FunctionType:
                released += _release_defaults(value)
            elif issubclass(type(value), type) and value.__module__ == name:
                released += sum(_release_defaults(f) for f in vars(value).values() if type(f) is FunctionType)
    return released


def _release_defaults(function) -> int:
    def is_group(value) -> bool:
        return issubclass(type(value), dist.ProcessGroup)

    defaults, kwdefaults = function.__defaults__ or (), function.__kwdefaults__ or {}
    held = sum(map(is_group, (*defaults, *kwdefaults.values())))
    if held:
        function.__defaults__ = tuple(None if is_group(v) else v for v in defaults) or None
        function.__kwdefaults__ = {k: None if is_group(v) else v for k, v in kwdefaults.items()} or None
    return held


def rank() -> int:
    """This process's global rank (0 for a single process)."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of processes in the job (1 for a single process)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node, from torchrun's ``LOCAL_RANK`` (0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<local_rank>`` when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
