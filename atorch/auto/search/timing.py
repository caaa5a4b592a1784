"""Timing a piece of work the way the calibration and the cost model do: the median (or the
fastest) of a few repetitions, the slowest rank's."""

import statistics
import time

import torch
import torch.distributed as dist

from atorch.auto.search.agree import max_each

REPEATS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(device: torch.device, run, group=None, batch: int = 1, repeats: int = REPEATS,
                   warmup: bool = True, fastest: bool = False) -> float:
    """Median wall time of ``run()`` over ``repeats`` (after one warm-up, unless the caller ran it
    already), the slowest rank's; each repetition runs it ``batch`` times and counts the mean.
    With ``group``, its ranks start each repetition together. With ``fastest``, the fastest
    repetition instead of the median: what the work itself takes, where something else on the
    machine only ever adds."""
    if warmup:
        run()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        for _ in range(batch):
            run()
        _sync(device)
        times.append((time.perf_counter() - start) / batch)
    return max_each(min(times) if fastest else statistics.median(times))[0]
