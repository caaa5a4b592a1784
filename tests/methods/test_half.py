import torch

from atorch.auto import auto_accelerate
from atorch.methods.half import cast_floats
from tests.helpers.compare import LOW_PRECISION_RTOL, assert_losses_close, assert_ranks_agree, assert_sensitive
from tests.helpers.dist import run_distributed
from tests.helpers.models import train_losses


def test_model_and_float_inputs_in_half():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    _, result, strategy = auto_accelerate(model, load_strategy=[("half", "bf16")])
    assert all(p.dtype == torch.bfloat16 for p in result.model.parameters())
    batch = result.prepare_input({"x": torch.randn(2, 4), "ids": torch.arange(2), "n": 3}, torch.device("cpu"))
    assert batch["x"].dtype == torch.bfloat16 and batch["ids"].dtype == torch.int64 and batch["n"] == 3
    assert result.model(batch["x"]).dtype == torch.bfloat16
    assert result.optim is None and result.dataloader is None and result.loss_func is None
    assert strategy.get("half").dtype == torch.bfloat16


def test_cast_floats_keeps_structure():
    data = ([torch.ones(1)], (torch.ones(1, dtype=torch.float64),))
    out = cast_floats(data, torch.float16)
    assert isinstance(out, tuple) and isinstance(out[0], list)
    assert out[0][0].dtype == out[1][0].dtype == torch.float16


def test_half_on_2_ranks_matches_single_process():
    strategy = ["parallel_mode", ("half", "bf16")]
    reference = train_losses(strategy, lr=0.05, micro_batches=2)  # bf16 too, on the ranks' micro-batches
    results = run_distributed(train_losses, 2, strategy, lr=0.05)
    assert results[0]["linear_dtypes"] == ["torch.bfloat16"]
    assert all(p.dtype == torch.bfloat16 for p in results[0]["replicated"].values())
    assert_ranks_agree(results, reference, LOW_PRECISION_RTOL)
    assert_losses_close(results[0]["losses"], reference["losses"], LOW_PRECISION_RTOL)
    # Negative controls: without training, or in fp32, the same check fails.
    assert_sensitive(results[0]["losses"], {"lr=0": train_losses(strategy, lr=0.0, micro_batches=2)["losses"],
                                            "fp32": train_losses([], lr=0.05, micro_batches=2)["losses"]},
                     LOW_PRECISION_RTOL)
