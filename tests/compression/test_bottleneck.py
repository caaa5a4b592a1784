import pytest
import torch
from torch import nn

from atorch.compression import GenomicBottleneck
from atorch.errors import CompressionError
from tests.compression.models import LM_GNETS, CharLM, char_batches, lm_loss, regression_data, regression_model


def _step(gnets, model, optim, x, y) -> float:
    gnets.zero_grad()
    optim.zero_grad()
    gnets.predict_weights()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    gnets.backward()
    optim.step()
    gnets.step()
    return loss.item()


def test_covers_linear_conv_and_attention_weights_above_the_threshold():
    model = nn.Sequential(nn.Linear(40, 300), nn.Conv2d(3, 8, 3), nn.MultiheadAttention(64, 4), nn.Linear(4, 4))
    gnets = GenomicBottleneck(model, tile_size=32, min_numel=100)
    assert list(gnets.gnetdict) == ["0.weight", "1.weight", "2.in_proj_weight", "2.out_proj.weight"]
    assert gnets.gnetdict["2.in_proj_weight"].shapes == [(64, 64)] * 3  # q, k, v tiled apart
    assert gnets.gnetdict["1.weight"].shapes == [(8, 27)]
    assert all(r.rank == 0 and r.gnet is not None for r in gnets.gnetdict.values())
    for name in gnets.gnetdict:  # the p-net holds the g-nets' predictions from the start
        record = gnets.gnetdict[name]
        assert torch.equal(model.get_parameter(name).detach(), gnets._predict(record).detach())


def test_compression_ratio_counts_exactly_the_covered_weights():
    model = CharLM()
    gnets = GenomicBottleneck(model, **LM_GNETS)
    covered = sum(model.get_parameter(n).numel() for n in gnets.gnetdict)
    assert covered == 2 * (3 * 64 * 64 + 64 * 64 + 2 * 256 * 64)  # attention and MLP weights of 2 blocks
    gnet_params = sum(p.numel() for r in gnets.gnetdict.values() for p in r.gnet.parameters())
    assert gnets.compression_ratio() == covered / gnet_params
    direct = sum(p.numel() for p in gnets.direct_parameters())
    assert direct + covered == sum(p.numel() for p in model.parameters())
    text = repr(gnets)
    assert "blocks.1.mlp.2.weight" in text and f"{gnets.compression_ratio():.1f}x" in text and f"{covered:,}" in text


def test_ignore_layers_and_threshold_leave_weights_to_direct_training():
    model = CharLM()
    gnets = GenomicBottleneck(model, ignore_layers=["blocks.0", "*.out_proj.weight"], **LM_GNETS)
    assert sorted(gnets.gnetdict) == ["blocks.1.attn.in_proj_weight", "blocks.1.mlp.0.weight", "blocks.1.mlp.2.weight"]
    assert "head.weight" in GenomicBottleneck(CharLM(), min_numel=1, **LM_GNETS).gnetdict
    with pytest.raises(CompressionError, match="match no module or parameter"):
        GenomicBottleneck(CharLM(), ignore_layers=["blocks.9"])
    with pytest.raises(CompressionError, match="no weight of the model is covered.*min_numel"):
        GenomicBottleneck(nn.Linear(4, 4))
    with pytest.raises(CompressionError, match="tile_size"):
        GenomicBottleneck(CharLM(), tile_size=(0, 4))


def test_frozen_weights_are_not_covered():
    model = CharLM()
    model.blocks[0].mlp[0].weight.requires_grad_(False)
    assert "blocks.0.mlp.0.weight" not in GenomicBottleneck(model, **LM_GNETS).gnetdict


def test_a_user_optimizer_over_all_params_never_updates_covered_weights():
    """gnets.backward() clears the covered grads: torch optimizers skip params without a grad."""
    model = regression_model()
    gnets = GenomicBottleneck(model, tile_size=32, gnet_width=16, min_numel=1000)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    x, y = regression_data()
    _step(gnets, model, optim, x, y)
    covered = [model.get_parameter(n) for n in gnets.gnetdict]
    assert all(p not in optim.state for p in covered) and all(p.grad is None for p in covered)
    gnets.zero_grad()
    optim.zero_grad()
    gnets.predict_weights()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nn.functional.mse_loss(model(x), y).backward()
    gnets.backward()
    optim.step()
    for name in gnets.gnetdict:  # AdamW with weight decay would have moved them
        assert torch.equal(model.get_parameter(name).detach(), before[name]), name
    assert not torch.equal(model.get_parameter("4.weight").detach(), before["4.weight"])


def test_the_gnets_learn():
    """With the directly trained parameters frozen, only the g-nets can lower the loss."""
    model = regression_model()
    for layer in (model[0], model[2], model[4]):
        layer.bias.requires_grad_(False)
    model[4].weight.requires_grad_(False)
    gnets = GenomicBottleneck(model, tile_size=32, gnet_width=16, min_numel=1000, optimizer_args={"lr": 1e-2})
    first = [r.gnet.head.weight.detach().clone() for r in gnets.owned()]
    optim = torch.optim.SGD(gnets.direct_parameters() or [torch.zeros(1, requires_grad=True)], lr=0.0)
    x, y = regression_data()
    losses = [_step(gnets, model, optim, x, y) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(not torch.equal(a, r.gnet.head.weight) for a, r in zip(first, gnets.owned()))


def test_backward_without_prediction_is_an_error_that_says_what_to_call():
    model = CharLM()
    gnets = GenomicBottleneck(model, **LM_GNETS)  # predicts without grad at construction
    lm_loss(model, char_batches(1, 2)[0]).backward()
    with pytest.raises(CompressionError, match="predict_weights"):
        gnets.backward()


def test_refresh_predicts_only_when_needed():
    model = CharLM()
    gnets = GenomicBottleneck(model, **LM_GNETS)
    calls = []
    original = gnets.predict_weights
    gnets.predict_weights = lambda: calls.append(1) or original()
    with torch.no_grad():
        gnets.refresh()  # fresh weights, no graph needed
    assert calls == []
    gnets.refresh()  # a forward with grad needs the graph
    gnets.refresh()
    assert calls == [1]
    lm_loss(model, char_batches(1, 2)[0]).backward()
    gnets.backward()
    gnets.step()  # stale now
    with torch.no_grad():
        gnets.refresh()
    assert calls == [1, 1]
