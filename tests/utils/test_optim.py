"""One optimizer wrapping protocol: checkpointing sees the real optimizer under stacked wrappers."""

import torch

import atorch.checkpoint
from atorch.amp.optimizer import AmpOptimizer
from atorch.auto import auto_accelerate
from atorch.utils.optim import unwrap_optimizer, wrapper_chain
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def test_unwrap_goes_through_every_wrapper():
    base = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    stacked = AmpOptimizer(AmpOptimizer(base, None, False), None, False)
    assert unwrap_optimizer(stacked) is base
    assert [type(o).__name__ for o in wrapper_chain(stacked)] == ["AmpOptimizer", "AmpOptimizer", "SGD"]
    assert unwrap_optimizer(base) is base


def _job(strategy):
    torch.manual_seed(0)
    model = TinyTransformer()
    _, result, _ = auto_accelerate(
        model, torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", load_strategy=strategy)
    return result


def _step(result, batch):
    loss = result.loss_func(batch, result.model(**batch))
    result.backward(loss)
    result.step()
    return loss.item()


def test_checkpoint_under_genomic_bottleneck_and_amp_restores_the_optimizer(tmp_path):
    # Two wrappers (AmpOptimizer around GenomicOptimizer): checkpointing once knew one only.
    strategy = [("genomic_bottleneck", {"min_numel": 1024, "tile_size": 16}), ("amp_native", "bf16")]
    result = _job(strategy)
    assert [type(o).__name__ for o in wrapper_chain(result.optim)] == ["AmpOptimizer", "GenomicOptimizer", "AdamW"]
    batches = list(result.dataloader)
    _step(result, batches[0])
    atorch.checkpoint.save(tmp_path / "ck", result.model, result.optim)
    saved_state = {k: v.clone() for k, v in unwrap_optimizer(result.optim).state_dict()["state"][0].items()}
    fresh = _job(strategy)
    atorch.checkpoint.load(tmp_path / "ck", fresh.model, fresh.optim)
    loaded = unwrap_optimizer(fresh.optim).state_dict()["state"][0]
    assert saved_state.keys() == loaded.keys() and all(torch.equal(saved_state[k], loaded[k]) for k in saved_state)
