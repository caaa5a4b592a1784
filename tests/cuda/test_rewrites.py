"""module_replace (SDPA attention, fused RMSNorm), native_dynamo (torch.compile with inductor) and
checkpoint on a CUDA GPU, each against the eager fp32 run of the same job (tests/cuda/job.py)."""

import pytest
import torch

from tests.cuda.job import assert_tracks, small_llama, train
from tests.helpers.gpu import requires_gpu

pytest.importorskip("transformers")

# fp32 with other kernels (SDPA's, inductor's fusions, a fused norm): only the order of sums
# differs, orders of magnitude below bf16's rounding.
FP32_KERNELS_SHARE = 1e-3


@requires_gpu()
def test_module_replace_puts_sdpa_and_the_fused_norm_on_and_matches_eager():
    from atorch.modules import FusedRMSNorm

    ids = torch.randint(0, 128, (4, 32), device="cuda")
    eager = small_llama(attention="eager").cuda()
    expected = eager(input_ids=ids).logits
    replaced = train(["module_replace"], steps=0, model=small_llama(attention="eager"))["result"].model
    assert replaced.config._attn_implementation == "sdpa"
    assert sum(isinstance(m, FusedRMSNorm) for m in replaced.modules()) == 2 * 2 + 1  # 2 a layer + the final
    torch.testing.assert_close(replaced(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    reference = train([], model=small_llama(attention="eager"))
    run = train(["module_replace"], model=small_llama(attention="eager"))
    assert_tracks(run["losses"], reference["losses"], FP32_KERNELS_SHARE)


@requires_gpu()
def test_native_dynamo_compiles_with_inductor_and_matches_eager():
    reference, run = train([]), train(["native_dynamo"])
    assert run["strategy"] == ["native_dynamo"]
    assert run["result"].model._compiled_call_impl is not None
    assert_tracks(run["losses"], reference["losses"], FP32_KERNELS_SHARE)


@requires_gpu()
def test_checkpoint_matches_the_plain_run():
    reference, run = train([]), train(["checkpoint"])
    assert run["strategy"] == ["checkpoint"]
    assert_tracks(run["losses"], reference["losses"], FP32_KERNELS_SHARE)


def _peak_of_one_step(strategy) -> int:
    # activations dominate here: 8 x 1024 tokens through 4 layers of width 256 (weights: 13 MB)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    train(strategy, steps=1, model=small_llama(hidden=256, layers=4, seq=1024), seq=1024)
    return torch.cuda.max_memory_allocated()


@requires_gpu()
def test_checkpoint_lowers_the_peak_memory():
    plain, checkpointed = _peak_of_one_step([]), _peak_of_one_step(["checkpoint"])
    assert checkpointed < 0.7 * plain, f"checkpointed peak {checkpointed / 2**20:.0f} MiB, plain {plain / 2**20:.0f} MiB"
