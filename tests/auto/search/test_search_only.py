"""auto_accelerate(search_only=True): the search's pick, with the model left as it was."""

import torch

from atorch.auto import auto_accelerate
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def test_search_only_returns_the_pick_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = TinyTransformer()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    modules = [type(m) for m in model.modules()]
    status, result, strategy = auto_accelerate(
        model, torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
        model_input_format="unpack_dict", excluded=["native_dynamo", "half"], dryrun_warmup_steps=1,
        dryrun_steps=1, use_search_cache=False, search_only=True)
    assert status and result is None and strategy is not None
    # The same module tree and weights; applying the pick afterwards works as with any strategy.
    assert [type(m) for m in model.modules()] == modules
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    status, applied, again = auto_accelerate(model, torch.optim.AdamW, TokenDataset(), lm_loss,
                                             optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                             model_input_format="unpack_dict", load_strategy=strategy)
    assert status and applied is not None and again.opt_names == strategy.opt_names
