"""Run a function on N processes of this machine that form one process group, and collect what
each rank returns: what ``atorch calibrate --nproc N``, the benchmarks and the tests start."""

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class LocalRunError(RuntimeError):
    """A rank raised, or the ranks did not finish in time; the message holds each rank's traceback."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(rank: int, nproc: int, port: int, backend: str, threads: int | None, fn, args, kwargs, report) -> None:
    """One rank's part of a run in this process: join the group, call ``fn``, leave together.
    ``report(True, the result as torch.save bytes)`` or ``report(False, the traceback)`` is called
    before the group is destroyed (a failing rank's own traceback reaches the parent before its
    peers fail on the closed connection)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
    if threads is not None:  # as torchrun does: ranks sharing a machine do not fight over its cores
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    import torch.distributed as dist

    import atorch

    try:
        atorch.init_distributed(backend=backend)
        result = fn(*args, **kwargs)
        if dist.is_initialized():  # fn may have left already (atorch.shutdown)
            dist.barrier()  # leave together (see atorch.shutdown)
        # As bytes: tensors sent through a multiprocessing queue live in this process's shared
        # memory, which is gone once it exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        report(True, buffer.getvalue())
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        report(False, traceback.format_exc())
    finally:
        # Not destroy_process_group alone: a group something still holds (the topology a job made
        # current, a default argument bound at import) outlives it with gloo's threads, and the
        # process can die of SIGABRT at exit after its work is done.
        from atorch.distributed.env import release_groups

        release_groups()


def _worker(rank: int, nproc: int, port: int, backend: str, threads: int | None, fn, args, kwargs, queue) -> None:
    run_rank(rank, nproc, port, backend, threads, fn, args, kwargs, lambda ok, value: queue.put((rank, ok, value)))


def run_local(fn: Callable[..., Any], nproc: int, args: tuple = (), kwargs: dict | None = None, *,
              backend: str = "gloo", timeout_s: float = 180.0, threads: int | None = 1) -> list:
    """Call ``fn(*args, **kwargs)`` on ``nproc`` spawned processes joined in one ``backend``
    group; return the results by rank.

    ``fn`` must be importable by name (a module-level function: the processes are spawned).
    ``threads`` sets each rank's CPU threads (None leaves torch's default). A failure on any rank
    raises :class:`LocalRunError` with that rank's traceback; ranks still running past
    ``timeout_s`` are killed and it raises too.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: give a number of processes, 1 or more")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, backend, threads, fn, args, kwargs or {}, queue))
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    results, failures = {}, {}
    try:
        for _ in range(nproc):
            rank, ok, value = queue.get(timeout=timeout_s)
            (results if ok else failures)[rank] = value
            if failures:
                break
    except Exception as error:  # queue.Empty on a hang
        failures[-1] = f"ranks {sorted(set(range(nproc)) - set(results))} did not finish in {timeout_s}s ({error!r})"
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if not failures:  # every rank reported its result: it must also have exited cleanly
        for rank, proc in enumerate(procs):
            if proc.exitcode not in (0, -9):  # -9: still running past the join, killed above
                failures[rank] = f"rank {rank} finished its work, then exited with code {proc.exitcode}"
    if failures:
        raise LocalRunError("distributed run failed:\n" + "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items()))
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(nproc)]
