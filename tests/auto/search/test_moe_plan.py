"""Planning a mixture-of-experts model (issue 55): on the meta device the routed experts cannot
route (the choice is data), so the probe runs them at their expected load; a plan, with and
without --search, works on a Mixtral config and weighs expert_parallel. Before, `atorch plan
--search` ended in a RuntimeError from transformers' grouped_mm on meta."""

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from atorch.cli.main import main
from tests.methods.test_tensor_parallel_moe import tiny_moe

MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 128}


def _matmul_flops(model, ids) -> int:
    # aten.mm only: on meta, attention is counted as the math path's bmm, which CPU's fused
    # attention kernel is not (the experts, the router, the projections and the head are all mm)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    return counter.get_flop_counts()["Global"][torch.ops.aten.mm]


def test_the_experts_expected_load_on_meta_counts_the_flops_real_routing_does():
    # Each (token, choice) pair costs one expert MLP whichever expert it picks: the count is exact.
    from atorch.parallel_layers.experts import expected_load

    real = tiny_moe("mixtral")
    real.set_experts_implementation("eager")  # one F.linear per expert: the counter sees them
    ids = torch.randint(0, 96, (2, 16))
    with torch.device("meta"):
        meta = tiny_moe("mixtral")
    with expected_load(meta):
        assert _matmul_flops(meta, ids.to("meta")) == _matmul_flops(real, ids)
    assert "forward" not in meta.model.layers[0].mlp.experts.__dict__  # its own forward is back


def test_plan_and_plan_search_on_a_mixtral_config_weigh_expert_parallel(tmp_path, capsys):
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(MIXTRAL))
    common = ["plan", "--hf-config", str(path), "--world-size", "4", "--batch-size", "8", "--seq-len", "64"]
    assert main(common) == 0
    capsys.readouterr()
    assert main([*common, "--search", "--profile", "h100_80gb", "--top", "50"]) == 0
    assert "expert_parallel" in capsys.readouterr().out
