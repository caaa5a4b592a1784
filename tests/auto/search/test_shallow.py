"""A plan's probe from two shallow copies (atorch.auto.search.shallow) gives the deep probe's counts."""

import pytest
import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.search import cost, shallow
from atorch.auto.strategy import Strategy

CPU = DeviceContext(1, 1, torch.device("cpu"), None, 2**30)


@pytest.mark.parametrize("methods", [[], ["checkpoint"], [("amp_native", "bf16")], [("amp_native", "bf16"), "checkpoint"]])
def test_two_shallow_probes_give_the_deep_probes_counts(methods):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    strategy = resolve_strategy(model, Strategy(methods))
    stages = cost.PROBED_STAGES
    deep: list = []
    value = cost._saved_bytes(model, strategy, batch, "unpack_dict", None, CPU, stages, deep)
    assert shallow.repeated_blocks(model) is model.model.layers
    assert cost.probe_once(model, strategy, batch, "unpack_dict", None, CPU, stages) == (value, deep)
    assert len(model.model.layers) == 6  # given back whole


def test_a_model_without_identical_blocks_is_probed_whole():
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)])
    assert shallow.repeated_blocks(torch.nn.Sequential(*blocks)) is None
    assert shallow.repeated_blocks(torch.nn.Sequential(blocks)) is None
    assert shallow.extrapolate((10, [3, ()], 2.0), (14, [5, ()], 3.0), 5) == (26, [11, ()], 6.0)


def test_blocks_that_alternate_sliding_and_full_attention_are_probed_whole():
    """Gemma3's blocks have one shape but its first five use sliding windows: two shallow probes
    stood for all of them, and under the plan's flash-attention probe the full-attention block's
    FLOPs were extrapolated as 0 (a 1B model: 0.275 TFLOP of attention a sequence, until
    2026-11-29). Such a model is probed whole; a uniform sliding window (Mistral) stays shallow."""
    transformers = pytest.importorskip("transformers")
    from atorch.auto.search.attention import FlashAttentionProbe

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=16)
    with torch.device("meta"):
        gemma = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common))
        mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    assert shallow.repeated_blocks(gemma) is None
    assert shallow.repeated_blocks(mistral) is mistral.model.layers
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    strategy = resolve_strategy(gemma, Strategy([]))
    with FlashAttentionProbe():
        deep: list = []
        value = cost._saved_bytes(gemma, strategy, batch, "unpack_dict", None, CPU, cost.PROBED_STAGES, deep)
        shallows = []
        for keep in (1, 2):  # what the first two blocks, both sliding, would have said
            with shallow.truncated(gemma.model.layers, keep):
                counted: list = []
                shallows.append((cost._saved_bytes(gemma, strategy, batch, "unpack_dict", None, CPU,
                                                   cost.PROBED_STAGES, counted), counted))
        assert shallow.extrapolate(*shallows, 6)[1][5] == 0 < deep[5]  # the attention FLOPs
        assert cost.probe_once(gemma, strategy, batch, "unpack_dict", None, CPU, cost.PROBED_STAGES) == (value, deep)
