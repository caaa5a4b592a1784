"""Interleaved pipelines with 4 virtual stages a rank (issue 54, point 5: the search tried 1 and
2): an 8-layer Llama in 2 stages x 4 trains as the single process does, and its memory estimate
is within 10% of the measured peak, as with 1 and 2."""

import pytest
import torch

from tests.helpers.dist import run_distributed


def _llama8():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.hf import VOCAB

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _pipeline(virtual: int) -> list:
    config = {"num_microbatches": 4, **({"virtual_pipeline_size": virtual} if virtual > 1 else {})}
    return [("parallel_mode", ([("pipeline", 2), ("data", 1)], None)), ("pipeline_parallel", config)]


def _train(strategy: list) -> list[float]:
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens
    from tests.helpers.models import global_step_losses

    _, result, _ = auto_accelerate(_llama8(), torch.optim.AdamW, CountingTokens(), lambda batch, out: out.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=strategy)
    return global_step_losses(result, 3)


def test_four_virtual_stages_a_rank_train_as_the_single_process():
    pytest.importorskip("transformers")
    serial = run_distributed(_train, 1, [])[0]
    assert run_distributed(_train, 2, _pipeline(4))[0] == pytest.approx(serial, rel=1e-5)


def _ratios() -> dict:
    from atorch.auto.search import measure
    from tests.helpers.hf import CountingTokens

    cases = {virtual: _pipeline(virtual) for virtual in (1, 2, 4)}
    report = measure(_llama8(), list(cases.values()), torch.optim.AdamW, CountingTokens(),
                     lambda batch, out: out.loss, optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8},
                     model_input_format="unpack_dict", timed_steps=1)
    return {virtual: c.estimated_peak_bytes / c.measured_peak_bytes for virtual, c in zip(cases, report.candidates)}


@pytest.mark.slow  # the default run has the 2-stage grid's estimates (test_mixed_parallel_virtual.py)
def test_the_memory_estimate_with_4_virtual_stages_is_within_10_percent():
    """Estimated / measured peak, 2026-11-28: 0.98 (1 virtual stage), 0.97 (2), 0.94 (4)."""
    pytest.importorskip("transformers")
    ratios = run_distributed(_ratios, 2)[0]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
