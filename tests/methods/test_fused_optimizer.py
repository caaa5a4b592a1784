"""fused_optimizer: the user's optimizer with torch's fused (or foreach) step, the same update."""

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.auto.step_cost import NOMINAL_FUSED_SHARE
from atorch.errors import MethodConfigError
from atorch.methods.fused_optimizer import optimizer_keywords
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def _train(strategy, optim=torch.optim.AdamW, steps=4):
    torch.manual_seed(0)
    status, result, _ = auto_accelerate(
        TinyTransformer(), optim, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", load_strategy=strategy)
    batches = iter(result.dataloader)
    for _ in range(steps):
        batch = next(batches)
        result.backward(result.loss_func(batch, result.model(**batch)))
        result.step()
    return result


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_the_same_update_as_the_unfused_step(impl):
    plain = _train([])
    fused = _train([("fused_optimizer", {"impl": impl})])
    group = fused.optim.param_groups[0]
    assert group[impl] is True and plain.optim.param_groups[0].get(impl) in (None, False)
    for (name, a), b in zip(plain.model.named_parameters(), fused.model.parameters()):
        # The key third of attention's input bias has a gradient of rounding noise only (softmax
        # ignores a bias shared by every key): Adam's m / sqrt(v) of noise is a coin toss that any
        # other summation order tosses again (0.5e-3 apart after 4 steps; foreach matches exactly).
        if name.endswith("in_proj_bias"):
            a, b = a[:32], b[:32]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_an_optimizer_without_a_fused_step_is_refused_by_name():
    with pytest.raises(MethodConfigError, match="RMSprop takes no 'fused' argument"):
        _train(["fused_optimizer"], optim=torch.optim.RMSprop, steps=0)
    assert optimizer_keywords(torch.optim.SGD, "fused") == {"fused": True, "foreach": False}
    assert optimizer_keywords(torch.optim.RMSprop, "foreach") == {"foreach": True}


def test_the_cost_term_charges_the_fused_rate_timed_here():
    from atorch.auto.search.cost import build_cost, optimizer_seconds_per_byte
    from atorch.auto.strategy import Strategy

    model = TinyTransformer()
    unfused = optimizer_seconds_per_byte(torch.optim.AdamW, {"lr": 1e-3}, torch.device("cpu"))
    fused = optimizer_seconds_per_byte(torch.optim.AdamW, {"lr": 1e-3, **optimizer_keywords(torch.optim.AdamW, "fused")},
                                       torch.device("cpu"))
    costs = {}
    for names in ([], ["fused_optimizer"]):
        cost = build_cost(model, Strategy(names), {"data": 1}, 2.0, 0, optim_seconds_per_byte=unfused)
        cost.fused_optim_seconds_per_byte = fused
        costs[tuple(names)] = cost
    assert costs[()].optimizer_rate() == unfused
    assert costs[("fused_optimizer",)].optimizer_rate() == fused
    costs[("fused_optimizer",)].fused_optim_seconds_per_byte = 0.0  # not timed: the nominal share
    assert costs[("fused_optimizer",)].optimizer_rate() == pytest.approx(unfused * NOMINAL_FUSED_SHARE)
