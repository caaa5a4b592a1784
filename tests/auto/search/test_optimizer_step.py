"""The optimizer's step in the cost model: timed once per search on this device, charged over the
bytes a rank steps, which a sharding method divides. This is what makes zero1 (AdamW over a
quarter of the parameters on 4 ranks) estimated faster than plain DDP where the step is dear."""

import pytest
import torch

from atorch.auto.search import cost
from atorch.auto.strategy import Strategy


def test_adamw_is_timed_and_an_optimizer_that_needs_a_closure_is_not():
    rate = cost.optimizer_seconds_per_byte(torch.optim.AdamW, {"lr": 1e-3}, torch.device("cpu"))
    assert 1e-13 < rate < 1e-6
    assert cost.optimizer_seconds_per_byte(torch.optim.LBFGS, {}, torch.device("cpu")) == 0.0
    assert cost.optimizer_seconds_per_byte(None, {}, torch.device("cpu")) == 0.0


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))


def _seconds(methods, rate):
    from atorch.auto.plan import resolve_strategy

    model = _model()
    strategy = resolve_strategy(model, Strategy([("parallel_mode", {}), *methods]))
    return cost.build_cost(model, strategy, {"data": 4}, 2.0, 0, 1e6, 64, "cpu", 0, rate).seconds()


def test_each_rank_steps_its_share_of_the_parameters():
    params = sum(p.numel() * 4 for p in _model().parameters())
    rate = 1e-9
    assert _seconds([], rate) - _seconds([], 0.0) == pytest.approx(params * rate)
    # zero1 steps a quarter on each of 4 ranks (at least the largest tensor, which one rank holds whole)
    largest = 256 * 256 * 4
    assert _seconds(["zero1"], rate) - _seconds(["zero1"], 0.0) == pytest.approx(max(params / 4, largest) * rate)


def test_a_dear_step_makes_sharding_the_faster_estimate():
    assert _seconds(["zero1"], 0.0) > _seconds([], 0.0)  # without the step: only the extra broadcast
    assert _seconds(["zero1"], 1e-8) < _seconds([], 1e-8)
