"""A method that would change nothing on this model is dropped before anything runs, with the
reason logged, instead of staying in the returned strategy as if it had done something."""

import pytest

from atorch.auto import auto_accelerate
from tests.conftest import messages

pytest.importorskip("transformers")

from tests.helpers.hf import tiny_llama  # noqa: E402


def test_module_replace_with_nothing_to_replace_is_dropped_and_says_why(atorch_logs):
    model = tiny_llama()  # transformers picks sdpa already; fused RMSNorm is for CUDA only
    assert model.config._attn_implementation == "sdpa"
    _, _, strategy = auto_accelerate(model, load_strategy=["module_replace"])
    assert "module_replace" not in strategy
    logged = messages(atorch_logs)
    assert "module_replace: dropped because it would change nothing" in logged
    assert "attention set to" not in logged and "->" not in logged


def test_module_replace_that_changes_the_attention_stays_and_logs_what_it_did(atorch_logs):
    model = tiny_llama()
    model.set_attn_implementation("eager")
    _, result, strategy = auto_accelerate(model, load_strategy=["module_replace"])
    assert strategy.opt_names == ["module_replace"]
    assert result.model.config._attn_implementation == "sdpa"
    assert "module_replace: transformers attention eager -> sdpa" in messages(atorch_logs)
