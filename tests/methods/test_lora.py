"""LoRA (peft) models through the methods: only adapters train, results match the reference."""

import pytest
import torch

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


def _gpt2_lora():
    from peft import LoraConfig, get_peft_model

    from tests.helpers.hf import tiny_gpt2

    # GPT-2's attention projection is a Conv1D (fan_in_fan_out); peft targets c_attn in each block.
    return get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))


def test_trainable_outmost_keeps_the_blocks_as_units():
    from atorch.methods.fsdp import FsdpConfig, resolve
    from atorch.sharding import fsdp2

    model = _gpt2_lora()
    config = resolve(model, FsdpConfig(wrap_trainable_outmost=True))
    # Before: no classes were detected when wrap_trainable_outmost was set, so only the 4 adapters
    # (lora_A, lora_B in 2 blocks) became units and the root held every block's weights.
    assert [name.rsplit(".", 1)[-1] for name in config.atorch_wrap_cls] == ["GPT2Block"]
    units = fsdp2.choose_units(model, config.atorch_wrap_cls, None, [], True)
    assert len(units) == 6
    assert sum(name.endswith(("h.0", "h.1")) for name in units) == 2
    assert sum(".lora_" in name for name in units) == 4
    # Named classes are kept as named; a size-based policy is not joined by detected blocks.
    assert resolve(model, FsdpConfig(atorch_wrap_cls=["GPT2MLP"], wrap_trainable_outmost=True)).atorch_wrap_cls == ["GPT2MLP"]
    assert resolve(model, FsdpConfig(atorch_size_based_min_num_params=10**9)).atorch_wrap_cls == []


def _shard_gpt2_lora() -> dict:
    import logging

    from torch.distributed.fsdp import FSDPModule

    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("atorch").addHandler(handler)
    _, result, strategy = auto_accelerate(
        _gpt2_lora(), torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss,
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
        load_strategy=["parallel_mode", ("fsdp", {"wrap_trainable_outmost": True})],
    )
    units = [name for name, m in result.model.named_modules() if name and isinstance(m, FSDPModule)]
    return {"units": units, "strategy": strategy.to_dict(), "log": [r for r in records if r.startswith("fsdp:")]}


def test_fsdp_trainable_outmost_on_gpt2_lora_shards_blocks_and_adapters_and_says_so():
    results = run_distributed(_shard_gpt2_lora, 2)
    for result in results:
        assert len(result["units"]) == 6, result["units"]
    # The returned strategy names the detected block class; the log line lists the units.
    fsdp = next(m["config"] for m in results[0]["strategy"]["methods"] if m["name"] == "fsdp")
    assert [name.rsplit(".", 1)[-1] for name in fsdp["atorch_wrap_cls"]] == ["GPT2Block"]
    assert fsdp["wrap_trainable_outmost"] is True
    assert any("6 units (4 x Linear, 2 x GPT2Block)" in line for line in results[0]["log"]), results[0]["log"]


def _lora_file_without_adapters() -> str:
    from atorch.auto import auto_accelerate
    from atorch.errors import MethodConfigError
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    try:
        auto_accelerate(TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss,
                        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                        load_strategy="strategies/lora_fsdp_bf16.json")
    except MethodConfigError as error:
        return str(error)
    return "no error"


def test_the_lora_file_refuses_a_model_without_adapters():
    """Before, it ran a full fine-tune of every parameter without a word."""
    for message in run_distributed(_lora_file_without_adapters, 2):
        assert "no adapters are applied" in message and "get_peft_model" in message, message
