"""atorch.distributed.local.run_local: what the calibrate CLI, the benchmarks and the tests start."""

import pytest
import torch
import torch.distributed as dist

from atorch.distributed.local import LocalRunError, run_local


def _rank_sum_and_threads(value: float, scale: float = 1.0):
    t = torch.tensor([value * (dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return dist.get_rank(), float(t), torch.get_num_threads()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 was told to fail")
    dist.barrier()


def test_results_come_back_by_rank_from_one_group():
    out = run_local(_rank_sum_and_threads, 2, (1.0,), {"scale": 2.0}, timeout_s=120)
    assert out == [(0, 6.0, 1), (1, 6.0, 1)]  # 2 + 4 on both ranks, one thread each


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(LocalRunError, match="(?s)rank 1:.*ValueError: rank 1 was told to fail"):
        run_local(_fail_on_rank_1, 2, timeout_s=120)


def test_no_processes_is_refused():
    with pytest.raises(ValueError, match="nproc=0"):
        run_local(_rank_sum_and_threads, 0)
