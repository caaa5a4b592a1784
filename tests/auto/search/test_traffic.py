"""The bytes that operators without FLOPs move (ops.traffic) and what the cost model charges
for them on a device with a memory bandwidth (StepCost.traffic_seconds)."""

import dataclasses

import pytest
import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.search import cost
from atorch.auto.search.profiles import load_profile
from atorch.auto.strategy import Strategy


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.GELU())


def _probe(model, batch, device: str = "meta") -> list:
    """The probe's counts on ``device`` (meta: as atorch plan and the GPU check probe; a CPU's real
    tensors count no traffic, its profiles charging none)."""
    counts: list = []
    cost.activation_bytes(model.to(device), Strategy([("parallel_mode", {})]), batch.to(device), None, None,
                          DeviceContext.detect(), counts)
    return counts


def test_the_probe_counts_what_element_wise_operators_read_and_write():
    traffic = _probe(_model(), torch.randn(2, 16))[6]
    # ReLU reads and writes 2 x 32 fp32, GELU 2 x 16; the Linears' matmuls have FLOPs, their
    # weights' transposes are views
    assert traffic == 4 * (2 * (2 * 32) + 2 * (2 * 16))
    assert _probe(_model(), torch.randn(2, 16), "cpu")[6] == 0  # not counted where nothing charges it


def test_the_traffic_grows_with_the_batch_and_a_weight_is_not_counted():
    model = _model()
    assert _probe(model, torch.randn(8, 16))[6] == 4 * _probe(model, torch.randn(2, 16))[6]
    # layer norm reads 2 x 16 and writes 2 x 16 with a mean and a 1 / std a row; its weight and
    # bias (16 each) are not the batch's: counted, they would not grow with it
    norm = torch.nn.Sequential(torch.nn.LayerNorm(16))
    assert _probe(norm, torch.randn(2, 16))[6] == 4 * (2 * 16 + 2 * 16 + 2 + 2)
    half = _probe(norm.to(torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16))[6]
    assert half == 2 * (2 * 16 + 2 * 16) + 4 * (2 + 2)  # in its tensors' dtypes: bf16, its statistics fp32


def _step(traffic: float, checkpoint: bool = False):
    methods = [("parallel_mode", {})] + (["checkpoint"] if checkpoint else [])
    return cost.build_cost(_model(), Strategy(methods), {"data": 1}, 2.0, 0, 1e9, 32, "cuda", 0,
                           forward_traffic=traffic)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_bandwidth_charges_the_traffic_over_each_pass(checkpoint):
    h100 = load_profile("h100_80gb")
    step = _step(1e9, checkpoint)
    step.profile = dataclasses.replace(h100, memory_bandwidth=0.0)
    without = step.seconds()
    step.profile = dataclasses.replace(h100, memory_bandwidth=1e12)
    passes = 4 if checkpoint else 3  # checkpointing runs the forward again
    assert step.seconds() - without == pytest.approx(1e9 * passes / 1e12)


def test_a_profile_without_a_bandwidth_charges_nothing():
    """A CPU's calibration has none: its per-operator overhead was fitted with these operators in."""
    step = _step(1e12)
    step.profile = dataclasses.replace(load_profile("h100_80gb"), memory_bandwidth=0.0)
    assert step.traffic_seconds() == 0.0
    step.profile = None
    assert step.traffic_seconds() == 0.0


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _backward_traffic(checkpointing: str | None) -> tuple[int, int]:
    """(forward, backward) bytes the operators without FLOPs move in two checkpointed blocks, counted
    as they run (the recompute is in the backward's)."""
    from atorch.auto.search.ops import OpCounter
    from atorch.methods.checkpoint import CheckpointedForward

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_Block() for _ in range(2)])
    weights = {p.untyped_storage()._cdata for p in blocks.parameters()}
    for block in blocks if checkpointing else ():
        block.forward = CheckpointedForward(block.forward, False, selective=checkpointing == "selective")
    x = torch.randn(4, 8, 32, requires_grad=True)
    with OpCounter(weights) as forward:
        for block in blocks:
            x = block(x)
        loss = x.sum()
    with OpCounter(weights) as backward:
        loss.backward()
    return forward.traffic, backward.traffic


def test_selective_checkpointing_is_charged_the_bytes_its_recompute_moves():
    """Selective checkpointing recomputes the element-wise operators in backward: their bytes move
    again, as many as under full checkpointing (which recomputes the matmuls too). Charged nothing
    before, which ranked it faster than it runs on a device bound by its memory."""
    _, plain = _backward_traffic(None)
    _, selective = _backward_traffic("selective")
    _, full = _backward_traffic("full")
    assert selective - plain == full - plain > 0
    h100 = dataclasses.replace(load_profile("h100_80gb"), memory_bandwidth=1e12)

    def charged(methods):
        step = cost.build_cost(_model(), Strategy([("parallel_mode", {}), *methods]), {"data": 1}, 2.0, 0, 1e9, 32,
                               "cuda", 0, forward_traffic=1e9)
        step.profile = h100
        return step.traffic_seconds()

    none = charged([])
    ratio = (charged([("checkpoint", {"selective": True})]) - none) / (charged(["checkpoint"]) - none)
    assert ratio == pytest.approx((selective - plain) / (full - plain), rel=0.15)
