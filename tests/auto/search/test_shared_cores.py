"""Ranks that share CPU cores: while a pipeline stage idles in its bubble, the ranks sharing its
core run faster, so the bubble costs less than its share of the compute (4 stages over 2 cores:
nothing, as long as the critical path at the full rate is shorter than the compute at the
shared one)."""

import os

import pytest
import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.search import cost
from atorch.auto.strategy import Strategy


def _seconds(bubble: float, ranks_per_core: float) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    step = cost.build_cost(model, Strategy([("parallel_mode", {})]), {"data": 1}, 2.0, 0, 1e12, 32, "cpu")
    step.bubble, step.ranks_per_core = bubble, ranks_per_core
    return step.seconds()


def test_a_bubble_costs_less_where_ranks_share_cores():
    compute = _seconds(0.0, 1.0)
    assert compute > 0
    assert _seconds(0.75, 1.0) == pytest.approx(1.75 * compute)  # a core per rank: the idle time counts
    assert _seconds(0.75, 2.0) == pytest.approx(compute)  # 1.75 / 2 < 1: the shared compute bounds the step
    assert _seconds(3.0, 2.0) == pytest.approx(2.0 * compute)  # a bubble longer than the sharing
    assert _seconds(0.0, 2.0) == pytest.approx(compute)  # no pipeline: sharing changes nothing here


def test_ranks_per_core_counts_every_local_rank_thread_over_the_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        many = DeviceContext(4 * cores, 4 * cores, torch.device("cpu"), None, 0)
        assert many.ranks_per_core == pytest.approx(4.0)
        assert DeviceContext(1, 1, torch.device("cpu"), None, 0).ranks_per_core == 1.0  # never below 1
    finally:
        torch.set_num_threads(threads)
    assert DeviceContext(8, 8, torch.device("cuda"), (9, 0), 0).ranks_per_core == 1.0
