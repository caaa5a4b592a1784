"""A save that fails on one rank only raises CheckpointError on every rank within seconds: no rank
is left inside a collective the failing one never joins (it used to wait the process group's
whole timeout, 30 minutes by default)."""

import time

import torch
import torch.distributed as dist

import atorch.checkpoint as ckpt
from atorch.errors import CheckpointError
from tests.helpers.dist import run_distributed


def _save_with_extra_that_differs_by_rank(directory: str):
    from tests.checkpoint.jobs import build

    result = build("ddp")
    # Rank 0's extra holds a module, which a checkpoint refuses; rank 1's is plain data.
    extra = {"loss_func": torch.nn.MSELoss()} if dist.get_rank() == 0 else {"step": 1}
    start = time.perf_counter()
    try:
        ckpt.save(f"{directory}/ckpt", result.model, result.optim, extra=extra)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    seconds = time.perf_counter() - start
    # The job goes on after the refused save: the ranks are still in step.
    ckpt.save(f"{directory}/ckpt", result.model, result.optim, extra={"step": 1})
    return error, seconds, ckpt.exists(f"{directory}/ckpt")


def test_extra_that_differs_by_rank_raises_on_every_rank_within_seconds(tmp_path):
    # Before the fix rank 1 waited in the save's first collective for a rank that had raised.
    results = run_distributed(_save_with_extra_that_differs_by_rank, 2, str(tmp_path), timeout_s=90)
    for rank, (error, seconds, saved) in enumerate(results):
        assert error is not None and "rank 0" in error and "extra holds objects other than tensors" in error, (rank, error)
        assert seconds < 10, (rank, seconds)
        assert saved, rank
