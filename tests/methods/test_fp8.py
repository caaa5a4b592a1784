"""fp8's selection and replacement logic on CPU; the transformer-engine path where a GPU exists."""

import importlib.util

import pytest
import torch
from torch import nn

from atorch.auto import Strategy
from atorch.auto.environment import DeviceContext
from atorch.auto.plan import plan_strategy
from atorch.methods.fp8 import fp8_candidates, swap_linears
from tests.helpers.gpu import requires_gpu


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 64) for _ in range(2))
        self.odd = nn.Linear(32, 30)
        self.head = nn.Linear(64, 16)


def test_only_aligned_included_not_excluded_linears():
    chosen, skipped = fp8_candidates(Net(), include=None, exclude=["head"])
    assert chosen == ["layers.0", "layers.1"]
    assert "multiples of 16" in skipped["odd"] and skipped["head"] == "matched by exclude"
    chosen, skipped = fp8_candidates(Net(), include=[r"layers\.1"], exclude=[])
    assert chosen == ["layers.1"] and skipped["layers.0"] == "not matched by include"


def test_a_model_with_no_layer_for_fp8_drops_it_with_a_warning_note():
    from atorch.auto.plan import resolve_strategy

    notes = []
    strategy = resolve_strategy(Net(), Strategy([("fp8", {"include": ["odd"]})]), notes)
    assert strategy.opt_names == []
    assert notes[0].warning and notes[0].startswith("fp8: dropped because it would change nothing: no nn.Linear")
    assert "multiples of 16" in notes[0] and "not matched by include" in notes[0]
    assert resolve_strategy(Net(), Strategy(["fp8"]), notes).opt_names == ["fp8"]


def test_swap_keeps_weights_through_the_factory():
    net = Net()
    before = net.layers[0].weight.clone()

    class Marked(nn.Linear):
        pass

    def factory(linear):
        new = Marked(linear.in_features, linear.out_features)
        new.load_state_dict(linear.state_dict())
        return new

    swap_linears(net, ["layers.0", "head"], factory)
    assert isinstance(net.layers[0], Marked) and isinstance(net.head, Marked) and type(net.layers[1]) is nn.Linear
    assert torch.equal(net.layers[0].weight, before)


@pytest.mark.parametrize(
    "device, capability, expected",
    [("cpu", None, "CUDA GPU"), ("cuda", (8, 0), "8.9 or newer"), ("cuda", (9, 0), None)],
)
def test_dropped_where_it_cannot_run(device, capability, expected):
    ctx = DeviceContext(1, 1, torch.device(device), capability, 2**30)
    strategy, notes = plan_strategy(Strategy(["fp8"]), ctx)
    if importlib.util.find_spec("transformer_engine") is None:
        assert strategy.opt_names == [] and "transformer-engine is not installed" in notes[0]
    elif expected is None:
        assert strategy.opt_names == ["fp8"]
    else:
        assert expected in notes[0]


@requires_gpu(min_capability=(8, 9), packages=("transformer_engine",))
def test_fp8_training_step_on_gpu():
    from atorch.auto import auto_accelerate

    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    _, result, strategy = auto_accelerate(model, torch.optim.AdamW, load_strategy=["fp8"])
    assert strategy.opt_names == ["fp8"]
    x = torch.randn(32, 64, device="cuda")
    loss = result.model(x).float().pow(2).mean()
    loss.backward()
    result.optim.step()
    assert torch.isfinite(loss)
