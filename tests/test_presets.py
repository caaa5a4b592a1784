"""Every file in strategies/ loads and trains a small Llama on 2 gloo processes like its serial reference."""

from pathlib import Path

import pytest
import torch

from atorch.auto import Strategy
from tests.helpers.compare import LOW_PRECISION_RTOL, assert_losses_close, assert_ranks_agree, assert_sensitive
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("peft")

PRESETS = sorted((Path(__file__).resolve().parents[1] / "strategies").glob("*.json"))
STEPS = 6
SHARDING = ("fsdp", "zero2")


def test_there_are_presets():
    names = {p.stem for p in PRESETS}
    assert {"ddp_bf16", "zero2_checkpoint", "fsdp_bf16_checkpoint", "llama_fsdp_bf16_checkpoint",
            "lora_fsdp_bf16"} <= names


FAMILIES = ("gpt2", "bert", "llama")
BLOCKS = {"gpt2": "GPT2Block", "bert": "BertLayer", "llama": "LlamaDecoderLayer"}
LORA_TARGETS = {"gpt2": ["c_attn"], "bert": ["query", "value"], "llama": ["q_proj", "v_proj"]}


def _specific_to(path: Path) -> str | None:
    """The model family a file is written for: its name starts with it (llama_...); else None."""
    family = path.stem.split("_")[0]
    return family if family in FAMILIES else None


def test_every_preset_says_what_it_is_for():
    for path in PRESETS:
        description = Strategy.load(path).description
        assert description, f"{path.name} has no description"
        family = _specific_to(path)
        if family is not None:
            assert f"{BLOCKS[family][:5]}-family models only" in description, path.name


def _apply_on_every_family(paths) -> dict:
    """Each file applied by auto_accelerate to a tiny GPT-2, BERT and Llama (built from configs)
    and trained 2 steps; or the config error it raised."""
    from atorch.errors import MethodConfigError
    from tests.helpers.hf import BUILDERS, CountingTokens
    from tests.helpers.models import train_steps

    out = {}
    for path in paths:
        for family in FAMILIES:
            model = BUILDERS[family]()
            if path.stem.startswith("lora"):
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS[family],
                                                         fan_in_fan_out=family == "gpt2"))
            try:
                _, result, strategy = auto_accelerate_quiet(model, CountingTokens(), str(path))
            except MethodConfigError as error:
                out[path.stem, family] = {"error": str(error)}
                continue
            losses = train_steps(result, 2)["losses"]
            out[path.stem, family] = {"losses": losses, "strategy": strategy.to_dict()}
    return out


def auto_accelerate_quiet(model, dataset, load_strategy):
    from atorch.auto import auto_accelerate
    from atorch.utils.log import quiet

    with quiet():
        return auto_accelerate(model, torch.optim.AdamW, dataset, lambda batch, out: out.loss,
                               dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                               load_strategy=load_strategy)


@pytest.mark.slow  # -m slow; by default: the presets train on 2 ranks below
def test_every_preset_on_gpt2_bert_and_llama():
    """Before, ddp_bf16_checkpoint and lora_fsdp_bf16 named LlamaDecoderLayer and failed on GPT-2
    and BERT; now the generic files detect the blocks, and the Llama file says how to fix it."""
    results = run_distributed(_apply_on_every_family, 2, PRESETS)[0]
    for path in PRESETS:
        specific = _specific_to(path)
        for family in FAMILIES:
            result = results[path.stem, family]
            if specific is not None and family != specific:
                assert "[] to use the model's repeated blocks" in result["error"]  # wrap_class or atorch_wrap_cls
                assert f"(here ['{BLOCKS[family]}'])" in result["error"]
                continue
            assert "error" not in result, (path.name, family, result)
            assert all(torch.isfinite(torch.tensor(result["losses"]))), (path.name, family)
            for method in result["strategy"]["methods"]:
                # The classes checkpointed and sharded are this model's blocks, found by structure.
                classes = method["config"].get("wrap_class", method["config"].get("atorch_wrap_cls"))
                if classes is not None:
                    assert [c.rsplit(".", 1)[-1] for c in classes] == [BLOCKS[family]], (path.name, family)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads(path):
    assert len(Strategy.load(path)) >= 2


def serial_reference(path: Path, lr: float = 1e-2, precision: bool = True) -> dict:
    """The preset's serial twin: the same computation in one process, on the ranks' micro-batches.

    Data parallelism and sharding go (they must not change the numbers); under fsdp/zero2,
    amp_native is FSDP2's parameter cast, so the twin casts the parameters instead of autocasting.
    ``precision=False`` drops the low precision altogether (the fp32 control).
    """
    from tests.helpers.hf import train_hf

    strategy = Strategy.load(path)
    amp = strategy.get("amp_native")
    param_dtype = None
    for name in ("parallel_mode", *SHARDING):
        if name in strategy:
            strategy = strategy.without(name)
    if amp is not None and (any(name in Strategy.load(path) for name in SHARDING) or not precision):
        strategy = strategy.without("amp_native")
        param_dtype = amp.dtype if precision else None
    return train_hf(strategy, steps=STEPS, lora=path.stem.startswith("lora"), lr=lr, micro_batches=2,
                    param_dtype=param_dtype)


def _train_all(paths):
    from tests.helpers.hf import train_hf

    return {p.stem: train_hf(str(p), steps=STEPS, lora=p.stem.startswith("lora")) for p in paths}


def test_presets_on_2_ranks_train_like_their_serial_reference():
    results = run_distributed(_train_all, 2, PRESETS)
    for path in PRESETS:
        name = path.stem
        ranks = [rank[name] for rank in results]
        reference = serial_reference(path)
        # Every preset computes in bf16 (autocast under DDP, FSDP2's parameter cast when sharded).
        assert ranks[0]["linear_dtypes"] == reference["linear_dtypes"] == ["torch.bfloat16"], name
        assert_ranks_agree(ranks, reference, LOW_PRECISION_RTOL)
        assert_losses_close(ranks[0]["losses"], reference["losses"], LOW_PRECISION_RTOL)
        # Negative controls: no training at all, or fp32 in place of bf16, would fail this check.
        assert_sensitive(ranks[0]["losses"], {"lr=0": serial_reference(path, lr=0.0)["losses"],
                                              "fp32": serial_reference(path, precision=False)["losses"]},
                         LOW_PRECISION_RTOL)
        assert Strategy.from_json(ranks[0]["strategy"]) == Strategy.from_json(ranks[1]["strategy"])
        if name.startswith("lora"):
            assert all(r["frozen_unchanged"] for r in ranks)


def test_the_reference_twin_of_a_sharded_preset_casts_parameters_instead_of_autocasting():
    path = next(p for p in PRESETS if p.stem == "zero2_checkpoint")
    reference = serial_reference(path)
    assert Strategy.from_json(reference["strategy"]).opt_names == ["checkpoint"]
    assert reference["linear_dtypes"] == ["torch.bfloat16"]
    assert torch.tensor(reference["losses"]).isfinite().all()
