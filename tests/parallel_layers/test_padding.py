import pytest
import torch

from atorch.parallel_layers import get_number_of_extra_heads, move_model_to_device, pad_model
from tests.helpers.compare import FP32_RTOL, assert_losses_close, assert_ranks_agree
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")


def test_extra_heads():
    assert get_number_of_extra_heads(32, 8) == 0
    assert get_number_of_extra_heads(3, 2) == 1
    assert get_number_of_extra_heads(25, 8) == 7
    with pytest.raises(ValueError):
        get_number_of_extra_heads(0, 2)


def three_head_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64, head_dim=16)
    return LlamaForCausalLM(config)


def three_head_bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                      intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("build", [three_head_llama, three_head_bert], ids=["llama", "bert"])
def test_padding_leaves_outputs_unchanged(build):
    model = build().eval()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids).logits
    calls = []
    pad_model(model, tp_degree=2, n_heads=3, pad_hook_fn=lambda m, extra: calls.append(extra))
    assert calls == [1, 1]
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_is_refused():
    from tests.helpers.hf import tiny_llama

    with pytest.raises(ValueError, match="grouped-query"):
        pad_model(tiny_llama(), tp_degree=3, n_heads=4)


def _padded_tp2():
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens
    from tests.helpers.models import replicated_params, run_steps

    model = pad_model(three_head_llama(), tp_degree=2, n_heads=3)
    _, result, _ = auto_accelerate(model, torch.optim.AdamW, CountingTokens(), lambda b, o: o.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict",
                                   load_strategy=[("parallel_mode", ([("tensor", 2), ("data", 1)], None)),
                                                  "tensor_parallel"])
    return {"losses": run_steps(result, 5)[0], "replicated": replicated_params(result.model)}


def test_padded_heads_split_over_2_ranks_train_like_the_original():
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens
    from tests.helpers.models import run_steps

    _, result, _ = auto_accelerate(three_head_llama(), torch.optim.AdamW, CountingTokens(), lambda b, o: o.loss,
                                   optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=[])
    reference, _ = run_steps(result, 5)
    results = run_distributed(_padded_tp2, 2)
    assert_ranks_agree(results)
    # The added heads get zero gradients (their output projection columns are zero), so they stay
    # zero through training and the padded, split model trains exactly like the original.
    assert_losses_close(results[0]["losses"], reference, FP32_RTOL)


def test_move_model_to_device_keeps_attributes():
    linear = torch.nn.Linear(2, 2)
    linear.weight.tensor_model_parallel = True
    linear.weight.partition_dim = 0
    move_model_to_device(linear, "cpu")
    assert linear.weight.tensor_model_parallel and linear.weight.partition_dim == 0
