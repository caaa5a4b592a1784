"""Bad input reaching auto_accelerate is refused before anything runs, with the argument, the
value and the fix named (before, torch's own errors came from deep inside, or the search only
wrote them to its report)."""

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.errors import AtorchConfigError
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


class _NoParameters(torch.nn.Module):
    def forward(self, input_ids, labels=None):
        return torch.nn.functional.one_hot(input_ids, 64).float()


def _job(**overrides):
    job = {"model": TinyTransformer(), "optim_func": torch.optim.SGD, "dataset": TokenDataset(), "loss_func": lm_loss,
           "dataloader_args": {"batch_size": 8}, "model_input_format": "unpack_dict", "load_strategy": []}
    job.update(overrides)
    return job


@pytest.mark.parametrize("overrides, message", [
    ({"dataset": TokenDataset(n=0)}, "dataset TokenDataset is empty"),
    ({"dataloader_args": {"batch_size": 0}}, r"batch_size'\] must be a positive int .* got 0"),
    ({"dataloader_args": {"batch_size": -4}}, "got -4"),
    ({"dataloader_args": {"batch_size": 2.5}}, "got 2.5"),
    ({"model": _NoParameters()}, "_NoParameters has no parameters"),
], ids=["empty-dataset", "batch-0", "batch-negative", "batch-float", "no-parameters"])
@pytest.mark.parametrize("search", [False, True], ids=["load_strategy", "search"])
def test_refused_before_anything_runs(overrides, message, search):
    job = _job(**overrides)
    if search:
        job.pop("load_strategy")
    model = job["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AtorchConfigError, match=message):
        auto_accelerate(**job)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_loss_that_is_not_a_scalar_is_named_at_backward():
    def per_token(batch, logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch["labels"].reshape(-1), reduction="none")

    status, result, _ = auto_accelerate(**_job(loss_func=per_token))
    batch = next(iter(result.dataloader))
    loss = result.loss_func(batch, result.model(**batch))
    with pytest.raises(AtorchConfigError, match=r"scalar loss, got a tensor of shape \(64,\); .*loss.mean\(\)"):
        result.backward(loss)
    with pytest.raises(AtorchConfigError, match="must return a tensor"):
        result.backward("3.0")
    result.backward(loss.mean())  # the fix works
    assert all(p.grad is not None for p in result.model.parameters())
