"""Gradient accumulation: n micro-batches per optimizer step train like one batch n times larger.

On 2 gloo ranks under ddp, zero1, zero2 and fsdp, against the single-process run on the whole
batch (fp32, SGD, whose step size shows a gradient off by any factor), with the gradient
reduction checked off on every micro-step but the last.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

import atorch
from atorch.auto import auto_accelerate
from atorch.errors import AtorchConfigError
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_sensitive
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, global_mean, lm_loss, train_losses

STEPS, ACCUMULATION, MICRO_BATCH, LR = 5, 2, 4, 0.05  # MICRO_BATCH: the global batch of one micro-step
STRATEGIES = {"ddp": ["parallel_mode"], "zero1": ["parallel_mode", "zero1"], "zero2": ["parallel_mode", "zero2"],
              "fsdp": ["parallel_mode", "fsdp"]}


def _grads_reduced(model: torch.nn.Module) -> bool:
    """Whether the last backward reduced gradients over the ranks: replicated gradients agree on
    every rank, sharded (FSDP2) ones exist only once reduce-scattered."""
    import torch.distributed as dist

    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.grad is not None
        if p.grad is None:
            continue
        gathered = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())] if dist.is_initialized() else []
        if not gathered:
            return True
        dist.all_gather(gathered, p.grad.contiguous())
        return all(torch.equal(g, gathered[0]) for g in gathered)
    raise AssertionError("no parameter has a gradient")


def accumulate(load_strategy, accumulation: int = ACCUMULATION) -> dict:
    """The user's loop with result.backward / result.step; losses per optimizer step."""
    torch.manual_seed(0)
    status, result, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.SGD, TokenDataset(), lm_loss, optim_args={"lr": LR},
        dataloader_args={"batch_size": MICRO_BATCH}, model_input_format="unpack_dict", load_strategy=load_strategy,
        gradient_accumulation_steps=accumulation,
    )
    assert status
    torch.set_num_threads(1)
    losses, cycle, reduced = [], [], []
    batches = iter(result.dataloader)
    for _ in range(STEPS * accumulation):
        batch = result.prepare_input(next(batches), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        cycle.append(loss.detach())
        result.backward(loss)
        reduced.append(_grads_reduced(result.model))
        if result.sync_gradients:
            losses.append(global_mean(torch.stack(cycle).mean()))
            cycle = []
        result.step()
    return {"losses": losses, "reduced": reduced, "strategy": strategy.opt_names}


def _all_strategies() -> dict:
    out = {name: accumulate(strategy) for name, strategy in STRATEGIES.items()}
    try:  # fairscale reduces inside backward hooks: refused rather than reduced every micro-step
        accumulate(["parallel_mode", ("zero2", {"not_use_fsdp": True})])
    except AtorchConfigError as exc:
        out["fairscale_error"] = str(exc)
    return out


def test_accumulation_matches_the_large_batch_on_2_ranks():
    reference = train_losses([], steps=STEPS, batch_size=MICRO_BATCH * ACCUMULATION, lr=LR)["losses"]
    # What a wrong accumulation would give: the loss not divided (twice the step), or a step after
    # every micro-batch.
    controls = {"loss not divided": train_losses([], steps=STEPS, batch_size=MICRO_BATCH * ACCUMULATION,
                                                 lr=LR * ACCUMULATION)["losses"],
                "no accumulation": train_losses([], steps=STEPS, batch_size=MICRO_BATCH, lr=LR)["losses"]}
    results = run_distributed(_all_strategies, 2)
    for name, strategy in STRATEGIES.items():
        run = results[0][name]
        assert run["strategy"] == strategy
        assert_losses_close(run["losses"], reference, FP32_RTOL)
        assert_sensitive(run["losses"], controls, FP32_RTOL)
        # one reduction per optimizer step, on its last micro-step
        assert run["reduced"] == [False, True] * STEPS, (name, run["reduced"])
    assert "not_use_fsdp" in results[0]["fairscale_error"] and "zero2 on FSDP2" in results[0]["fairscale_error"]


def test_accumulation_on_one_process_matches_the_large_batch():
    reference = train_losses([], steps=STEPS, batch_size=MICRO_BATCH * ACCUMULATION, lr=LR)["losses"]
    run = accumulate([])
    assert_losses_close(run["losses"], reference, FP32_RTOL)
    control = train_losses([], steps=STEPS, batch_size=MICRO_BATCH * ACCUMULATION, lr=LR * ACCUMULATION)["losses"]
    assert_sensitive(run["losses"], {"loss not divided": control}, FP32_RTOL)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_bad_accumulation_steps_are_refused_before_anything_runs(value):
    model = TinyTransformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AtorchConfigError, match="gradient_accumulation_steps must be a positive int"):
        auto_accelerate(model, torch.optim.SGD, TokenDataset(), lm_loss, load_strategy=[],
                        gradient_accumulation_steps=value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
