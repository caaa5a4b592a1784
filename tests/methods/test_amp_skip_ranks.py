"""Sharded gradients: an inf/nan in one rank's gradient shard skips the step on every rank.

After FSDP2's reduce-scatter (fsdp, zero2) or fairscale's reduce to the owner (zero2
not_use_fsdp) each rank holds only its own shard of the gradients, so an inf that lands in
rank 1's shard is invisible to rank 0; the ranks must agree on the skip, or rank 0 steps while
rank 1 skips and the shards of one model come from two different steps.

Who agrees: amp_native's optimizer all-reduces the finite flag over the data-parallel group
(atorch/amp/optimizer.py, ``_grads_finite``): the only agreement for bf16 with
``skip_if_nonfinite`` and for fp16 under fairscale. For fp16 under FSDP2, torch's DTensor also
reduces GradScaler's found_inf over the mesh (``found_inf_reduce_handler`` in
torch/distributed/tensor/_dispatch.py), so with atorch's all-reduce removed those two cases
still pass and the others fail (docs/dev/negative_controls.md).
"""

import pytest
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


FP16, BF16_SKIP = ("amp_native", "fp16"), ("amp_native", {"dtype": "bf16", "skip_if_nonfinite": True})
FSDP2_CASES = {"fsdp fp16": [FP16, "fsdp"], "zero2 fp16": [FP16, "zero2"],
               "fsdp bf16": [BF16_SKIP, "fsdp"], "zero2 bf16": [BF16_SKIP, "zero2"]}
# Apart: a rank of fairscale's OSS that steps broadcasts its shard, so ranks that disagree hang.
FAIRSCALE_CASES = {"fairscale fp16": [FP16, ("zero2", {"not_use_fsdp": True})]}


def _inf_in_own_shard(model) -> None:
    """An inf confined to this rank's shard (a whole-gradient inf would reach every rank through
    the reduction, and each would skip on its own)."""
    param = next(p for p in model.parameters() if p.grad is not None)
    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
    grad.view(-1)[0] = float("inf")


def _inf_on_rank_1(methods: list) -> dict:
    torch.manual_seed(0)
    _, result, _ = auto_accelerate(
        TinyTransformer(), torch.optim.SGD, TokenDataset(), lm_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 4}, model_input_format="unpack_dict", load_strategy=["parallel_mode", *methods])
    scaler = result.optim.scaler
    before, scale = _full(result.model), scaler.get_scale() if scaler else None
    batch = result.prepare_input(next(iter(result.dataloader)), atorch.device())
    result.loss_func(batch, result.model(**batch)).backward()
    if dist.get_rank() == 1:
        _inf_in_own_shard(result.model)
    result.optim.step()
    after = _full(result.model)
    return {"unchanged": [k for k in before if torch.equal(before[k], after[k])], "names": list(before),
            "after": after, "skipped": result.optim.skipped_steps,
            "scale_fell": scaler is None or scaler.get_scale() < scale}


def _cases(cases: dict) -> dict:
    return {name: _inf_on_rank_1(methods) for name, methods in cases.items()}


def _assert_both_skipped(per_rank: list, cases: dict) -> None:
    for name in cases:
        ranks = [r[name] for r in per_rank]
        for rank, r in enumerate(ranks):
            assert r["unchanged"] == r["names"], (name, rank, sorted(set(r["names"]) - set(r["unchanged"])))
            assert r["skipped"] == 1 and r["scale_fell"], (name, rank, r["skipped"], r["scale_fell"])
        assert all(torch.equal(ranks[0]["after"][k], ranks[1]["after"][k]) for k in ranks[0]["names"]), name


def test_an_inf_in_one_ranks_gradient_shard_skips_the_step_on_both_under_fsdp2():
    _assert_both_skipped(run_distributed(_cases, 2, FSDP2_CASES), FSDP2_CASES)


def test_an_inf_in_one_ranks_gradient_shard_skips_the_step_on_both_under_fairscale():
    pytest.importorskip("fairscale")
    _assert_both_skipped(run_distributed(_cases, 2, FAIRSCALE_CASES, timeout_s=60), FAIRSCALE_CASES)
