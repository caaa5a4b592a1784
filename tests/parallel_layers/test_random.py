import pytest
import torch

from atorch.parallel_layers import RNGStatesTracker, get_rng_state_tracker, model_parallel_manual_seed
from tests.helpers.dist import run_distributed


def test_fork_leaves_the_default_stream_alone():
    tracker = RNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("tp", 123)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("tp"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    with tracker.fork("tp"):
        assert not torch.equal(torch.rand(3), inside)  # the forked stream moves on
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with tracker.fork("missing"):
            pass
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("tp", 1)


def _streams():
    model_parallel_manual_seed(7)
    default = torch.rand(4)
    with get_rng_state_tracker().fork():
        forked = torch.rand(4)
    return {"default": default, "forked": forked}


def _init_tp_and_streams():
    from atorch import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return _streams()


def test_default_equal_and_forked_different_across_a_tensor_group():
    a, b = run_distributed(_init_tp_and_streams, 2)
    assert torch.equal(a["default"], b["default"])
    assert not torch.equal(a["forked"], b["forked"])


def _dropout_llama_stays_in_sync():
    from transformers import LlamaConfig, LlamaForCausalLM

    import atorch
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.5))
    _, result, _ = auto_accelerate(model, torch.optim.AdamW, CountingTokens(), lambda b, o: o.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict",
                                   load_strategy=[("parallel_mode", ([("tensor", 2), ("data", 1)], None)),
                                                  "tensor_parallel"])
    batches = iter(result.dataloader)
    for _ in range(3):
        batch = result.prepare_input(next(batches), atorch.device())
        loss = result.loss_func(batch, result.model(**batch))
        loss.backward()
        result.optim.step()
        result.optim.zero_grad()
    return {"default": torch.get_rng_state(), "loss": loss.item()}


def test_attention_dropout_draws_per_rank_and_leaves_the_default_in_step():
    pytest.importorskip("transformers")
    a, b = run_distributed(_dropout_llama_stays_in_sync, 2)
    assert torch.equal(a["default"], b["default"])
    assert a["loss"] == b["loss"]  # replicated activations stayed replicated
