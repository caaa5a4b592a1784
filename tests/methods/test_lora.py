"""LoRA (peft) models through the methods: only adapters train, results match the reference."""

import pytest

from tests.helpers.compare import (
    FP32_RTOL,
    LOW_PRECISION_RTOL,
    assert_losses_close,
    assert_ranks_agree,
    assert_sensitive,
)
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.helpers.hf import train_hf  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    return train_hf([], lora=True)


@pytest.fixture(scope="module")
def micro_reference():
    """The same run on the 2 ranks' micro-batches: each rank's own loss is one of them."""
    return train_hf([], lora=True, micro_batches=2)


def test_reference_trains_only_the_adapters(reference):
    assert reference["n_frozen"] > 0 and reference["frozen_unchanged"]
    assert reference["losses"][-1] < reference["losses"][0]
    # AdamW keeps two moments per trainable element, none for frozen weights.
    assert reference["state_numel"] == 2 * reference["trainable_numel"]


@pytest.mark.parametrize(
    "strategy",
    [
        ["parallel_mode", ("fsdp", {"wrap_trainable_outmost": True})],
        ["parallel_mode", "fsdp", "checkpoint"],
        ["parallel_mode", "zero1"],
        ["parallel_mode", "zero2"],
    ],
    ids=["fsdp-trainable-outmost", "fsdp-checkpoint", "zero1", "zero2"],
)
def test_lora_on_2_ranks_matches_single_process(strategy, reference, micro_reference):
    results = run_distributed(train_hf, 2, strategy, lora=True)
    assert_ranks_agree(results, micro_reference, FP32_RTOL)
    assert all(r["frozen_unchanged"] for r in results)
    assert_losses_close(results[0]["losses"], reference["losses"], FP32_RTOL)
    held = [r["state_numel"] for r in results]
    assert sum(held) <= 2 * reference["trainable_numel"] * 1.05  # state only for adapters, sharded


def test_lora_with_amp_and_checkpoint_single_process(reference):
    result = train_hf([("amp_native", "bf16"), "checkpoint"], lora=True)
    assert result["frozen_unchanged"]
    assert result["linear_dtypes"] == ["torch.bfloat16"]
    # Recomputing the blocks in backward repeats the same bf16 forward: equal to amp alone.
    amp_alone = train_hf([("amp_native", "bf16")], lora=True)
    assert_losses_close(result["losses"], amp_alone["losses"], LOW_PRECISION_RTOL)
    # Negative controls: without training, or in fp32 (the module fixture), the check fails.
    lr0 = train_hf([("amp_native", "bf16")], lora=True, lr=0.0)
    assert_sensitive(result["losses"], {"lr=0": lr0["losses"], "fp32": reference["losses"]}, LOW_PRECISION_RTOL)
