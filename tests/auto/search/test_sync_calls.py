"""Collectives per step in the cost model's data-parallel sync (StepCost.sync_calls): each one pays
the link's latency, so a method that syncs unit by unit (fsdp, zero2 on FSDP2) or bucket by
bucket (DDP) says how many it makes. On a CPU's gloo a collective costs 0.5-3 ms, which is what
separated fsdp from plain data parallel on the small models of benchmarks/cost_model.py."""

import pytest
import torch

from atorch.auto.search import cost
from atorch.auto.strategy import Strategy
from atorch.methods.parallel_mode import DDP_BUCKET_BYTES


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(x)


class Stack(torch.nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(blocks: int = 4, width: int = 64) -> torch.nn.Module:
    with torch.device("meta"):
        return Stack(blocks, width)


def _cost(model, *methods, dims=None):
    return cost.build_cost(model, Strategy([("parallel_mode", {}), *methods]), dims or {"data": 2}, 2.0, 0, 1e9, 64)


def test_ddp_all_reduces_one_bucket_at_a_time():
    """Buckets divide the gradients, not the ring's traffic (twice the gradients for an all-reduce)."""
    grads = sum(p.numel() * 4 for p in _model(4, 2048).parameters())  # 64 MiB of gradients: 3 buckets
    assert 2 * DDP_BUCKET_BYTES < grads <= 3 * DDP_BUCKET_BYTES
    ddp = _cost(_model(4, 2048))
    one_call = _cost(_model(4, 2048))
    one_call.sync_calls = {}
    _, latency = ddp._link(("data",), "all_reduce")
    assert ddp.seconds() - one_call.seconds() == pytest.approx(latency * (3 - 1))
    assert _cost(_model())._calls("all_reduce", DDP_BUCKET_BYTES / 2) == 1


def test_fsdp_gathers_and_reduces_unit_by_unit():
    fsdp = _cost(_model(4), ("fsdp", {"atorch_wrap_cls": ["Block"]}))
    # four blocks and the root; gathered in forward and again in backward
    assert fsdp.sync_calls == {"all_gather": 10, "reduce_scatter": 5}
    kept = _cost(_model(4), ("fsdp", {"atorch_wrap_cls": ["Block"], "reshard_after_forward": False}))
    assert kept.sync_calls == {"all_gather": 5, "reduce_scatter": 5}


def test_zero2_syncs_its_bucketed_units():
    one_per_block = _cost(_model(4), ("zero2", {"bucket_params": 0}))
    assert one_per_block.sync_calls == {"all_gather": 5, "reduce_scatter": 5}
    bucketed = _cost(_model(4), ("zero2", {}))  # DeepSpeed's bucket size: every block in the root's unit
    assert bucketed.sync_calls["reduce_scatter"] < 5


def test_zero1_broadcasts_from_every_rank():
    zero1 = _cost(_model(), ("zero1", {}), dims={"data": 4})
    assert zero1._calls("all_gather", 1.0) == 4


def test_each_collective_pays_the_latency():
    """Same bytes moved, more collectives: a slower estimated step, by exactly the extra latencies."""
    model = _model(4)
    plain = _cost(model, ("fsdp", {"atorch_wrap_cls": ["Block"]}))
    single = _cost(model, ("fsdp", {"atorch_wrap_cls": ["Block"]}))
    single.sync_calls = {}
    _, latency = plain._link(("data",), "all_gather")
    assert plain.seconds() - single.seconds() == pytest.approx(latency * (10 - 1 + 5 - 1))
