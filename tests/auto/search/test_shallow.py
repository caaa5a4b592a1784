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
