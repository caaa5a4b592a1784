"""The genomic bottleneck on 2 gloo processes, all checks from one spawn (see the module fixture)."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from atorch.compression import GenomicBottleneck
from tests.compression.models import (
    LM_GNETS,
    CharLM,
    char_batches,
    lm_loss,
    regression_data,
    regression_model,
)
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed

REG_GNETS = {"tile_size": 32, "gnet_width": 16, "gnet_depth": 2, "min_numel": 1000, "optimizer_args": {"lr": 1e-2}}
REG_STEPS, LM_STEPS = 12, 60


def _covered(gnets) -> dict:
    return {name: p.detach().clone() for name, p in gnets._params.items()}


def train_regression(rank: int = 0, world: int = 1, ddp_first: bool = False) -> dict:
    """Full-batch regression; each rank takes its slice of the batch (the reference: world 1)."""
    model = regression_model()
    if world > 1 and ddp_first:
        ddp = DistributedDataParallel(model)
        gnets = GenomicBottleneck(ddp, **REG_GNETS)  # DDP averages every grad, the covered ones too
    else:
        gnets = GenomicBottleneck(model, **REG_GNETS)  # covered weights skipped by DDP, averaged to owners
        ddp = DistributedDataParallel(model) if world > 1 else model
    optim = torch.optim.SGD(gnets.direct_parameters(), lr=0.01)
    x, y = regression_data()
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    losses = []
    for _ in range(REG_STEPS):
        gnets.zero_grad()
        optim.zero_grad()
        gnets.predict_weights()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        gnets.backward()
        optim.step()
        gnets.step()
        losses.append(_global_mean(loss))
    return {"losses": losses, "reduce_grads": gnets.reduce_grads, "owners": {n: r.rank for n, r in gnets.gnetdict.items()}}


def _global_mean(loss: torch.Tensor) -> float:
    from tests.helpers.models import global_mean

    return global_mean(loss)


def train_lm(gnets_kwargs: dict, steps: int, world: int = 1, rank: int = 0) -> tuple:
    model = CharLM()
    gnets = GenomicBottleneck(model, optimizer_args={"lr": 3e-3}, **gnets_kwargs)
    ddp = DistributedDataParallel(model) if world > 1 else model
    optim = torch.optim.Adam(gnets.direct_parameters(), lr=3e-3)
    losses = []
    for window in char_batches(steps, 16):
        gnets.zero_grad()
        optim.zero_grad()
        gnets.predict_weights()
        loss = lm_loss(ddp, window.chunk(world)[rank])
        loss.backward()
        gnets.backward()
        optim.step()
        gnets.step()
        losses.append(_global_mean(loss))
    gnets.predict_weights()
    return model, gnets, losses


def _on_two_ranks(tmp: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {"plain": train_regression(rank, 2), "ddp_first": train_regression(rank, 2, ddp_first=True)}
    model, gnets, losses = train_lm(LM_GNETS, LM_STEPS, 2, rank)
    out["lm"] = {
        "losses": losses, "ratio": gnets.compression_ratio(), "weights": _covered(gnets),
        "owned": sorted(r.name for r in gnets.owned()), "built": sorted(n for n, r in gnets.gnetdict.items() if r.gnet),
        "repr": repr(gnets),
    }
    gnets.save(f"{tmp}/two")
    fresh = GenomicBottleneck(CharLM(seed=5), **LM_GNETS)
    fresh.load(f"{tmp}/one")
    out["loaded_from_one"] = _covered(fresh)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gnets")
    _, one, _ = train_lm(LM_GNETS, 3)  # a 1-process checkpoint for the ranks to load
    one.save(f"{tmp}/one")
    results = run_distributed(_on_two_ranks, 2, str(tmp))
    return {"tmp": tmp, "one": _covered(one), "ranks": results, "reference": train_regression()}


def test_gnets_are_split_between_ranks_and_built_only_on_their_owner(runs):
    owned = [r["lm"]["owned"] for r in runs["ranks"]]
    assert owned[0] and owned[1] and not set(owned[0]) & set(owned[1])
    assert sorted(owned[0] + owned[1]) == sorted(runs["ranks"][0]["lm"]["weights"])
    assert [r["lm"]["built"] for r in runs["ranks"]] == owned
    assert "rank" in runs["ranks"][0]["lm"]["repr"]


def test_every_rank_holds_identical_predicted_weights(runs):
    first, second = (r["lm"]["weights"] for r in runs["ranks"])
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("variant", ["plain", "ddp_first"])
def test_regression_under_ddp_matches_single_process(runs, variant):
    """Gnets made before DDP average the covered grads to their owners; made on a DDP model they
    rely on DDP's allreduce. Both equal the single-process full-batch run."""
    ranks = runs["ranks"]
    assert ranks[0][variant]["reduce_grads"] is (variant == "plain")
    assert ranks[0][variant]["losses"] == ranks[1][variant]["losses"]
    assert_losses_close(ranks[0][variant]["losses"], runs["reference"]["losses"], FP32_RTOL)
    losses = runs["reference"]["losses"]
    assert losses[-1] < 0.7 * losses[0]  # only biases are trained directly: the g-nets learn


def test_char_lm_learns_at_more_than_10x_compression(runs):
    lm = runs["ranks"][0]["lm"]
    assert lm["ratio"] >= 10
    first, last = sum(lm["losses"][:5]) / 5, sum(lm["losses"][-5:]) / 5
    assert last < 0.7 * first, (first, last)


def test_saved_on_two_ranks_loads_in_one_process(runs):
    fresh = GenomicBottleneck(CharLM(seed=7), **LM_GNETS)
    fresh.load(f"{runs['tmp']}/two")
    for name, weight in runs["ranks"][0]["lm"]["weights"].items():
        assert torch.equal(fresh._params[name], weight), name


def test_saved_in_one_process_loads_on_two_ranks(runs):
    for result in runs["ranks"]:
        for name, weight in runs["one"].items():
            assert torch.equal(result["loaded_from_one"][name], weight), name
