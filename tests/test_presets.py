"""Every file in strategies/ loads and trains a small Llama on 2 gloo processes."""

from pathlib import Path

import pytest

from atorch.auto import Strategy
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("peft")

PRESETS = sorted((Path(__file__).resolve().parents[1] / "strategies").glob("*.json"))


def test_there_are_presets():
    names = {p.stem for p in PRESETS}
    assert {"ddp_bf16", "zero2_checkpoint", "llama_fsdp_bf16_checkpoint", "lora_fsdp_bf16"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads(path):
    assert len(Strategy.load(path)) >= 2


def _train_all(paths):
    from tests.helpers.hf import train_hf

    return {p.stem: train_hf(str(p), steps=6, lora=p.stem.startswith("lora")) for p in paths}


def test_presets_train_on_2_ranks():
    results = run_distributed(_train_all, 2, PRESETS)
    for name, result in results[0].items():
        losses = result["losses"]
        assert losses[-1] < losses[0], (name, losses)
        assert Strategy.from_json(result["strategy"]) == Strategy.from_json(results[1][name]["strategy"])
        if name.startswith("lora"):
            assert result["frozen_unchanged"]
