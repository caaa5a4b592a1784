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
    assert {"ddp_bf16", "zero2_checkpoint", "llama_fsdp_bf16_checkpoint", "lora_fsdp_bf16"} <= names


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
