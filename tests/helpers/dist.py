"""Run a function on N real processes over gloo and collect each rank's return value."""

import io
import os
import socket
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, kwargs, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    import atorch

    torch.set_num_threads(1)
    try:
        atorch.init_distributed(backend="gloo")
        result = fn(*args, **kwargs)
        if dist.is_initialized():  # fn may have left already (atorch.shutdown)
            dist.barrier()  # leave together (see atorch.shutdown)
        # As bytes: tensors sent through a multiprocessing queue live in this process's shared
        # memory, which is gone once it exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be a module-level function (the processes are spawned). A failure on any rank
    raises with that rank's traceback; a hang past ``timeout_s`` kills every rank and raises.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results, failures = {}, {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s)
            (results if ok else failures)[rank] = value
            if failures:
                break
    except Exception as error:  # queue.Empty on a hang
        failures[-1] = f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout_s}s ({error!r})"
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise AssertionError("distributed run failed:\n" + "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items()))
    import torch

    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
