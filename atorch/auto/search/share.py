"""Work the ranks share out: each does its part, and every rank gets every result.

A search's probes (one forward and backward of a copy of the model per distinct combination of
methods, :func:`atorch.auto.search.cost.probe_once`) give the same answer on every rank: the same
model and the same first batch. Run by every rank, they multiplied the work by the world size; on
benchmarks/search_quality.py's tensor-best (4 ranks on 2 cores) they were 0.6 of a search's 4 s.
Shared out, job ``i`` runs on rank ``i % world``, in rounds of one job per rank, and each round's
results reach every rank. A job must not call a collective (``MethodSpec.probed``)."""

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch.distributed as dist

from atorch.auto.search.agree import gathered
from atorch.auto.search.cost import ProbeFailed


def run_shared(jobs: list[tuple[Hashable, Callable[[], Any]]], results: dict,
               out_of_time: Callable[[], bool]) -> dict[Hashable, float]:
    """Run each of ``jobs`` (the same list, in the same order, on every rank) once over the ranks
    and put its result under its key in ``results``, on every rank; a job that raised leaves a
    :class:`ProbeFailed`. Between rounds, stops when ``out_of_time()`` (an agreed answer): the
    jobs left out are not in ``results``. Returns each job's seconds on the rank that ran it."""
    several = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if several else (0, 1)
    seconds: dict[Hashable, float] = {}
    for first in range(0, len(jobs), world):
        if first and out_of_time():
            break
        mine = None
        if first + rank < len(jobs):
            began = time.perf_counter()
            try:
                value = jobs[first + rank][1]()
            except Exception as error:  # noqa: BLE001 - the candidate's estimate meets it and records it
                value = ProbeFailed(f"{type(error).__name__}: {error}")
            mine = (value, time.perf_counter() - began)
        for index, entry in enumerate(gathered(mine), first):
            if entry is not None:
                key = jobs[index][0]
                results[key], seconds[key] = entry
    return seconds
