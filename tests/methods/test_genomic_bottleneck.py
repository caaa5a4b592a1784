import json

import pytest
import torch

from atorch.auto import auto_accelerate
from atorch.compression import GenomicBottleneck
from atorch.errors import MethodConfigError, StrategyConflictError
from atorch.methods.genomic_bottleneck import GenomicBottleneckConfig
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed
from tests.helpers.models import (
    TinyTransformer,
    TokenDataset,
    lm_loss,
    optimizer_state_numel,
    replicated_params,
    train_steps,
)

CONFIG = {"tile_size": 16, "gnet_width": 16, "gnet_depth": 1, "min_numel": 1000, "lr": 3e-3}
STEPS, LR = 6, 0.05


def _through_auto_accelerate(strategy, steps: int = STEPS, micro_batches: int = 1) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer()
    _, result, applied = auto_accelerate(
        model, torch.optim.SGD, TokenDataset(), lm_loss, optim_args={"lr": LR}, dataloader_args={"batch_size": 8},
        model_input_format="unpack_dict", load_strategy=strategy,
    )
    trained = train_steps(result, steps, micro_batches=micro_batches)
    gnets = result.args["gnets"]
    return {
        **trained, "replicated": replicated_params(result.model), "owned": sorted(r.name for r in gnets.owned()), "covered": sorted(gnets.gnetdict),
        "state_numel": optimizer_state_numel(result.optim), "direct_numel": sum(p.numel() for p in gnets.direct_parameters()),
        "weights": {n: p.detach().clone() for n, p in gnets._params.items()}, "strategy": applied.to_json(),
    }


def _torchgb_loop(steps: int = STEPS) -> list[float]:
    """The reference: the loop from the torchGB docs with the standalone API."""
    torch.manual_seed(0)
    model = TinyTransformer()
    gnets = GenomicBottleneck(model, tile_size=16, gnet_width=16, gnet_depth=1, min_numel=1000, optimizer_args={"lr": 3e-3})
    optim = torch.optim.SGD(gnets.direct_parameters(), lr=LR)
    data = TokenDataset()
    losses = []
    for step in range(steps):
        batch = {k: torch.stack([data[i][k] for i in range(8 * step, 8 * step + 8)]) for k in ("input_ids", "labels")}
        gnets.zero_grad()
        optim.zero_grad()
        gnets.predict_weights()
        loss = lm_loss(batch, model(**batch))
        loss.backward()
        gnets.backward()
        optim.step()
        gnets.step()
        losses.append(loss.item())
    return losses


def test_the_standard_loop_trains_the_gnets_like_the_torchgb_loop():
    result = _through_auto_accelerate([("genomic_bottleneck", CONFIG)])
    assert len(result["covered"]) == 9  # in_proj, out_proj and 2 MLP weights per block, and the head
    assert result["losses"] == pytest.approx(_torchgb_loop(), rel=1e-6)
    # The user's optimizer holds only the directly trained parameters (SGD keeps no state here).
    assert result["state_numel"] == 0 and result["direct_numel"] > 0
    methods = json.loads(result["strategy"])["methods"]
    assert methods == [{"name": "genomic_bottleneck", "config": {**GenomicBottleneckConfig(**CONFIG).model_dump(mode="json")}}]
    assert methods[0]["config"]["tile_size"] == [16, 16]


def test_on_2_ranks_matches_single_process_and_splits_the_gnets():
    strategy = [("genomic_bottleneck", CONFIG)]
    reference = _through_auto_accelerate(strategy)
    ranks = run_distributed(_through_auto_accelerate, 2, strategy)
    # Per rank, before any reduction: the directly trained parameters and the predicted weights
    # are the same on both ranks, and each rank's own loss is its half of the batch's.
    assert_ranks_agree(ranks, _through_auto_accelerate(strategy, micro_batches=2), FP32_RTOL)
    assert_losses_close(ranks[0]["losses"], reference["losses"], FP32_RTOL)
    assert ranks[0]["owned"] and ranks[1]["owned"] and sorted(ranks[0]["owned"] + ranks[1]["owned"]) == reference["covered"]
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name])


def test_config_typos_and_conflicts_are_errors_before_anything_runs():
    with pytest.raises(MethodConfigError, match="gnet_widht"):
        auto_accelerate(TinyTransformer(), load_strategy=[("genomic_bottleneck", {"gnet_widht": 8})])
    with pytest.raises(StrategyConflictError, match="bf16"):
        auto_accelerate(TinyTransformer(), load_strategy=[("amp_native", "fp16"), ("genomic_bottleneck", CONFIG)])
    with pytest.raises(StrategyConflictError, match="half"):
        auto_accelerate(TinyTransformer(), load_strategy=["half", ("genomic_bottleneck", CONFIG)])


def _accumulated(micro_batches: int) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer()
    _, result, _ = auto_accelerate(
        model, torch.optim.SGD, optim_args={"lr": LR}, load_strategy=[("genomic_bottleneck", CONFIG)],
        optim_param_func=lambda m: [{"params": list(m.parameters())}],  # covered weights filtered out
    )
    gnets = result.args["gnets"]
    assert not any(gnets.is_covered(p) for group in result.optim.param_groups for p in group["params"])
    first = {n: p.detach().clone() for n, p in gnets._params.items()}
    data = TokenDataset()
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    for step in range(2):
        for part in range(micro_batches):
            piece = {k: v.chunk(micro_batches)[part] for k, v in batch.items()}
            (lm_loss(piece, result.model(**piece)) / micro_batches).backward()
        result.optim.step()
        result.optim.zero_grad()
    with torch.no_grad():
        result.model(batch["input_ids"])  # the pre-hook writes the g-nets' latest weights
    assert not any(torch.equal(first[n], p) for n, p in gnets._params.items())
    return {n: p.detach().clone() for n, p in result.model.named_parameters()}


def test_gradient_accumulation_equals_one_big_batch():
    """Two forwards and backwards per step predict once and accumulate the covered grads."""
    whole, accumulated = _accumulated(1), _accumulated(2)
    for name, weight in whole.items():
        assert torch.allclose(weight, accumulated[name], atol=1e-6), name
