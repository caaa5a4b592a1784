"""fp16 under fsdp/zero2: an overflow in one rank's gradient shard skips the step on every rank.

After FSDP2's reduce-scatter each rank holds only its own shard of every gradient, so an inf
that lands in rank 1's rows is invisible to rank 0; amp_native's optimizer must agree on the
skip over the data-parallel group (atorch/amp/optimizer.py, ``_grads_finite``), or rank 0
steps while rank 1 skips and the shards of one model come from two different steps.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import atorch
from atorch.auto import auto_accelerate
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss


def _full(model) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _overflow_on_rank_1(method: str) -> dict:
    torch.manual_seed(0)
    _, result, _ = auto_accelerate(
        TinyTransformer(), torch.optim.SGD, TokenDataset(), lm_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 4}, model_input_format="unpack_dict",
        load_strategy=["parallel_mode", ("amp_native", "fp16"), method])
    before = _full(result.model)
    scale = result.optim.scaler.get_scale()
    batch = result.prepare_input(next(iter(result.dataloader)), atorch.device())
    result.loss_func(batch, result.model(**batch)).backward()
    grad = result.model.head.weight.grad
    assert isinstance(grad, DTensor)  # sharded: each rank holds its own rows
    if dist.get_rank() == 1:
        # An overflow confined to rows this rank owns (a whole-gradient inf would reach every
        # shard through the reduce-scatter, and each rank would skip on its own).
        grad.to_local()[0, 0] = float("inf")
    result.optim.step()
    after = _full(result.model)
    return {"unchanged": [k for k in before if torch.equal(before[k], after[k])], "names": list(before),
            "after": after, "skipped": result.optim.skipped_steps,
            "scale": (scale, result.optim.scaler.get_scale())}


def _both_methods() -> dict:
    return {method: _overflow_on_rank_1(method) for method in ("fsdp", "zero2")}


def test_fp16_overflow_on_one_rank_skips_the_step_on_both():
    per_rank = run_distributed(_both_methods, 2)
    for method in ("fsdp", "zero2"):
        ranks = [r[method] for r in per_rank]
        for rank, r in enumerate(ranks):
            assert r["unchanged"] == r["names"], (method, rank, sorted(set(r["names"]) - set(r["unchanged"])))
            assert r["skipped"] == 1, (method, rank, r["skipped"])
            assert r["scale"][1] < r["scale"][0], (method, rank, r["scale"])
        assert all(torch.equal(ranks[0]["after"][k], ranks[1]["after"][k]) for k in ranks[0]["names"]), method
