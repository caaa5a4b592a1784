import math

import pytest
import torch

from atorch.auto import clip_grad_norm, grad_norm
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def _model_with_grads(seed=0):
    torch.manual_seed(seed)
    model = TinyTransformer()
    data = TokenDataset()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    lm_loss(batch, model(batch["input_ids"])).backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_matches_torch_on_a_serial_model(norm_type):
    ours, theirs = _model_with_grads(), _model_with_grads()
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type)
    got = clip_grad_norm(ours, 0.1, norm_type)
    torch.testing.assert_close(got, expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_no_clipping_below_the_limit():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = grad_norm(model)
    assert clip_grad_norm(model, norm.item() * 2) == pytest.approx(norm.item())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_no_gradients():
    assert clip_grad_norm(torch.nn.Linear(2, 2), 1.0).item() == 0.0
