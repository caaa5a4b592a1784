"""Process-group start-up from the torchrun environment, and this process's place in it."""

import datetime
import os

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


def shutdown() -> None:
    """Leave the job in order, on every rank, at the end: wait for the device's work, meet the
    other ranks, then destroy the process group.

    A rank that tears down its connections while a peer is still sending (the last checkpoint's
    collectives, a final all-reduce) can make gloo abort that peer at exit ("terminate called
    without an active exception", SIGABRT), and torchrun then reports a finished job as failed,
    or restarts it. The process groups are then released while the interpreter is whole:
    ``destroy_process_group`` only drops torch's own references, and a group that outlives it
    (held by a DDP reducer or a topology in a reference cycle) is destroyed at interpreter
    finalization, where gloo's worker threads releasing their last tensors can abort the
    process. Nothing to do in a single process.
    """
    import gc

    if not dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    from atorch import parallel_state

    parallel_state.set_topology(None)
    gc.collect()


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
