"""Issue 55, point 4: tensor_parallel on a mixture-of-experts model says what it leaves whole (the
routed experts, 79% of a tiny Mixtral's parameters) at WARNING and in the result's notes; it
was silent."""

import pytest
import torch

from tests.helpers.dist import run_distributed

TP2 = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]


def tiny_moe(kind: str):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4, **common))
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                              shared_expert_intermediate_size=32, **common))


def _notes_under_tensor_parallel(kind: str) -> list[str]:
    from atorch.auto import auto_accelerate

    _, result, _ = auto_accelerate(tiny_moe(kind), torch.optim.AdamW, load_strategy=TP2)
    return list(result.notes)


def test_the_routed_experts_are_recognized_by_structure():
    pytest.importorskip("transformers")
    from atorch.parallel_layers.experts import experts_summary, routed_experts
    from tests.helpers.hf import tiny_llama

    mixtral = tiny_moe("mixtral")
    assert list(routed_experts(mixtral)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert experts_summary(mixtral)[0] == 2 and 0.75 < experts_summary(mixtral)[1] < 0.85  # 79%
    qwen = tiny_moe("qwen2_moe")  # the shared expert is not routed
    assert all(not name.endswith("shared_expert") for name in routed_experts(qwen))
    assert experts_summary(tiny_llama()) is None


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_tensor_parallel_on_a_moe_model_says_the_experts_stay_whole(kind):
    pytest.importorskip("transformers")
    notes = run_distributed(_notes_under_tensor_parallel, 2, kind)[0]
    said = [note for note in notes if "routed experts" in note]
    assert len(said) == 1 and "stay whole on every tensor rank" in said[0] and "fsdp" in said[0] and "expert_parallel" in said[0], notes
