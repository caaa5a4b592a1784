"""atorch.distributed.local.run_local: what the calibrate CLI, the benchmarks and the tests start."""

import os

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


def test_a_rank_that_dies_after_its_result_fails_the_run():
    # Issue 56: a rank that aborted at exit (SIGABRT) after reporting passed unseen.
    with pytest.raises(LocalRunError, match="rank 1 finished its work, then exited with code -6"):
        run_local(_register_abort_at_exit, 2, timeout_s=120)


def _register_abort_at_exit():
    import atexit
    import os

    if dist.get_rank() == 1:
        atexit.register(os.abort)  # dies at exit, as a torn-down gloo thread makes a process die
    return dist.get_rank()


def _grid_4x1x1_step():
    from atorch import intra_layer

    topology = intra_layer.init(G_intra_r=4)
    layer = intra_layer.Linear(8, 12)
    layer(torch.ones(4, 8)).sum().backward()
    return topology.size("row")


RUNS = int(os.environ.get("ATORCH_CLEAN_EXIT_RUNS", "1"))


@pytest.mark.slow  # -m slow; by default: the launcher's exits are checked by the three tests above
def test_a_4_rank_3d_tensor_parallel_job_exits_cleanly_run_after_run():
    """Issue 56: a 4-rank job of the 3D tensor-parallel Linear (grid 4 x 1 x 1) died of SIGABRT at
    exit about once in 9 runs after passing its checks. ``ATORCH_CLEAN_EXIT_RUNS=50`` for the
    measurement the docs give; 1 run in the default suite."""
    for _ in range(RUNS):
        assert run_local(_grid_4x1x1_step, 4, timeout_s=120) == [4, 4, 4, 4]
