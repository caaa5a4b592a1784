"""A collective inside one node runs at the measured rate of its own group size: the data group
of pipeline=2 x data=2 is 2 ranks (2 apart), and its all-reduces cost the 2-rank latency, not the
4-rank one its ranks span. Before, search_quality's pipeline=2 x data=2 candidates were estimated
at 1.5-1.8x their measured step (20 all-reduces at the 4-rank latency of 5.6 ms instead of 0.8)."""

import dataclasses

import pytest
import torch

from atorch.auto.search import cost
from atorch.auto.search.profiles import Link, load_profile
from atorch.auto.strategy import Strategy


def _seconds(dims: dict, latency: dict[int, float]) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    step = cost.build_cost(model, Strategy([("parallel_mode", {})]), dims, 2.0, 0, 1e6, 32, "cpu")
    links = {size: Link(1e9, seconds) for size, seconds in latency.items()}
    step.profile = dataclasses.replace(load_profile("h100_80gb"), gpus_per_node=4,
                                       collectives={"all_reduce": links})
    return step.seconds()


def test_a_group_inside_a_node_costs_its_own_size_rate():
    dims = {"pipeline": 2, "data": 2}  # the data group: ranks 0 and 2, 1 and 3
    assert _seconds(dims, {2: 1e-3, 4: 1e-2}) == pytest.approx(_seconds(dims, {2: 1e-3, 4: 5e-2}))
    # two all-reduces over the data group a step: the gradients' and the loss count's (atorch/loss)
    assert _seconds(dims, {2: 2e-3, 4: 1e-2}) - _seconds(dims, {2: 1e-3, 4: 1e-2}) == pytest.approx(2 * 1e-3)


def test_a_group_over_every_rank_costs_the_world_rate():
    dims = {"data": 4}
    assert _seconds(dims, {2: 1e-3, 4: 2e-2}) - _seconds(dims, {2: 1e-3, 4: 1e-2}) == pytest.approx(2 * 1e-2)
