"""Each tensor-parallel model draws its split-head dropout from a tracker of its own.

With one process-wide tracker, the first model sharded in a process seeded it for its tensor
group, and every later model reused that stream: after a tensor=2 model, a tensor=4 model's
ranks 0 and 2 (tensor ranks 0 and 2 now, both 0 before) drew the same dropout masks for
different heads. The search dry-runs several layouts in one process, so this is the common case.
"""

import pytest
import torch

from tests.helpers.dist import run_distributed


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                         attention_dropout=0.1)
    return LlamaForCausalLM(config)


def _draws_per_layout():
    import torch.distributed as dist

    from atorch.auto import auto_accelerate
    from atorch.parallel_layers.random import MODEL_PARALLEL_RNG, get_rng_state_tracker, tracker_of

    out = {}
    for tp in (2, 4):
        strategy = [("parallel_mode", ([("tensor", tp), ("data", 4 // tp)], None)), "tensor_parallel"]
        status, result, _ = auto_accelerate(_llama(), load_strategy=strategy)
        assert status
        with tracker_of(result.model).fork(MODEL_PARALLEL_RNG):
            draw = torch.rand(4)
        gathered = [torch.empty(4) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, draw)
        out[tp] = [g.tolist() for g in gathered]
    out["process_wide_untouched"] = MODEL_PARALLEL_RNG not in get_rng_state_tracker().states
    return out


@pytest.mark.slow  # the default suite stays under 15 minutes; run with -m slow
def test_a_second_layout_in_one_process_gets_streams_of_its_own():
    draws = run_distributed(_draws_per_layout, 4)[0]
    # tensor 2 x data 2: ranks 0 and 1 form a tensor group (rank = tensor rank + 2 x data rank),
    # ranks 0 and 2 are the same tensor rank of two groups: equal streams, by design
    assert draws[2][0] == draws[2][2] and draws[2][1] == draws[2][3] and draws[2][0] != draws[2][1]
    # tensor 4: four different heads' shards, four different streams
    assert len({tuple(d) for d in draws[4]}) == 4, draws[4]
    assert draws["process_wide_untouched"]
