import pytest
import torch

import atorch
from atorch.amp import AmpOptimizer
from atorch.auto import auto_accelerate
from tests.helpers.compare import LOW_PRECISION_RTOL, assert_losses_close, assert_ranks_agree, assert_sensitive
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss, train_losses


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_amp_on_2_ranks_matches_single_process(dtype):
    strategy = ["parallel_mode", ("amp_native", {"dtype": dtype})]
    reference = train_losses(strategy, micro_batches=2)  # same precision, the ranks' micro-batches
    results = run_distributed(train_losses, 2, strategy)
    assert results[0]["linear_dtypes"] == [{"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]]
    assert_ranks_agree(results, reference, LOW_PRECISION_RTOL)
    assert_losses_close(results[0]["losses"], reference["losses"], LOW_PRECISION_RTOL)
    # Negative controls: without training, or in fp32, the same check fails.
    assert_sensitive(results[0]["losses"], {"lr=0": train_losses(strategy, micro_batches=2, lr=0.0)["losses"],
                                            "fp32": train_losses(["parallel_mode"], micro_batches=2)["losses"]},
                     LOW_PRECISION_RTOL)


# bf16 vs fp32 on this job: 6.3e-5 apart (measured); with lr=0 bf16 is 1.5e-3 from the fp32
# run, so 5e-4 says "trains like fp32" and fails a run that does not train.
BF16_VS_FP32_RTOL = 5e-4


def test_amp_bf16_trains_like_fp32_but_is_not_fp32():
    fp32 = train_losses([])
    bf16 = train_losses([("amp_native", "bf16")])
    assert bf16["linear_dtypes"] == ["torch.bfloat16"] and fp32["linear_dtypes"] == ["torch.float32"]
    assert_losses_close(bf16["losses"], fp32["losses"], BF16_VS_FP32_RTOL)
    assert_sensitive(bf16["losses"], {"fp32 itself": fp32["losses"]}, LOW_PRECISION_RTOL)
    assert_sensitive(train_losses([("amp_native", "bf16")], lr=0.0)["losses"], {"fp32": fp32["losses"]},
                     BF16_VS_FP32_RTOL)


def _accelerate(config, loss_func=lm_loss):
    torch.manual_seed(0)
    model = TinyTransformer()
    _, result, _ = auto_accelerate(
        model, torch.optim.SGD, TokenDataset(), loss_func, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 4}, load_strategy=[("amp_native", config)],
    )
    return result


def test_forward_runs_in_autocast():
    result = _accelerate({"dtype": torch.bfloat16})
    seen = []
    result.model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    batch = next(iter(result.dataloader))
    result.model(batch["input_ids"])
    assert seen == [torch.bfloat16]
    assert result.model.head.weight.dtype == torch.float32  # fp32 master weights
    assert "forward" not in type(result.model).__dict__ or type(result.model) is TinyTransformer


def _step(result, scale_loss_by=1.0):
    batch = result.prepare_input(next(iter(result.dataloader)), atorch.device())
    loss = result.loss_func(batch, result.model(**batch))
    (loss * scale_loss_by).backward()
    result.optim.step()
    result.optim.zero_grad()
    return loss


def test_fp16_loss_value_is_unscaled_and_grads_are_scaled():
    result = _accelerate("fp16")
    batch = next(iter(result.dataloader))
    loss = result.loss_func(batch, result.model(**batch))
    plain = lm_loss(batch, result.model(**batch))
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
    loss.backward()
    scaled_grad = result.model.head.bias.grad.clone()
    result.optim.zero_grad()
    plain.backward()
    assert torch.allclose(scaled_grad, result.model.head.bias.grad * 2.0**16, rtol=1e-3)


def test_fp16_skips_steps_with_inf_and_lowers_the_scale():
    result = _accelerate("fp16")
    assert isinstance(result.optim, AmpOptimizer)
    before = {k: v.clone() for k, v in result.model.state_dict().items()}
    scale = result.optim.scaler.get_scale()
    _step(result, scale_loss_by=float("inf"))
    assert all(torch.equal(before[k], v) for k, v in result.model.state_dict().items())
    assert result.optim.scaler.get_scale() < scale
    assert result.optim.skipped_steps == 1
    _step(result)
    assert not torch.equal(before["head.weight"], result.model.head.weight)


@pytest.mark.parametrize("skip", [True, False])
def test_bf16_skip_if_nonfinite(skip):
    result = _accelerate({"dtype": "bf16", "skip_if_nonfinite": skip})
    before = result.model.head.weight.clone()
    _step(result, scale_loss_by=float("nan"))
    if skip:
        assert torch.equal(before, result.model.head.weight) and result.optim.skipped_steps == 1
    else:
        assert torch.isnan(result.model.head.weight).any()


def test_optimizer_state_dict_round_trip():
    result = _accelerate("fp16")
    _step(result)
    state = result.optim.state_dict()
    assert set(state) == {"optimizer", "grad_scaler"}
    other = _accelerate("fp16")
    other.optim.load_state_dict(state)
    assert other.optim.scaler.get_scale() == result.optim.scaler.get_scale()
    assert other.optim.param_groups[0]["lr"] == 0.1


def test_loss_func_returning_a_tuple():
    result = _accelerate("fp16", loss_func=lambda batch, out: (lm_loss(batch, out), {"extra": 1}))
    batch = next(iter(result.dataloader))
    loss, extra = result.loss_func(batch, result.model(**batch))
    assert extra == {"extra": 1} and loss.requires_grad


@pytest.mark.parametrize("dtype", ["fp16", {"dtype": "bf16", "skip_if_nonfinite": True}])
def test_step_with_a_closure_runs_it_and_steps_as_without(dtype):
    """Lightning steps as ``optimizer.step(closure=...)``: the closure's forward and backward run
    first, its loss comes back, and the parameters move exactly as in ``backward(); step()``."""
    results = [_accelerate(dtype) for _ in range(2)]
    batch = next(iter(results[0].dataloader))

    def closure():
        results[0].optim.zero_grad()
        loss = results[0].loss_func(batch, results[0].model(**batch))
        loss.backward()
        return loss

    loss = results[0].optim.step(closure)
    results[1].optim.zero_grad()
    expected = results[1].loss_func(batch, results[1].model(**batch))
    expected.backward()
    results[1].optim.step()
    assert loss.item() == expected.item()
    before = _accelerate(dtype).model.head.weight
    assert not torch.equal(before, results[0].model.head.weight)
    assert torch.equal(results[0].model.head.weight, results[1].model.head.weight)


@pytest.mark.parametrize("scale", [0, -1, 0.0])
def test_a_loss_scale_that_is_not_positive_is_refused(scale):
    # GradScaler divides the gradients by its scale: 0 or below would make every step non-finite
    # or flip the gradients' sign (issue 56: the bound could go and no test noticed).
    from atorch.auto.strategy import parse_strategy
    from atorch.errors import MethodConfigError

    with pytest.raises(MethodConfigError, match="init_scale: Input should be greater than 0"):
        parse_strategy([("amp_native", {"init_scale": scale})])
