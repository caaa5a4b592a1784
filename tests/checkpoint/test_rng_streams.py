"""Issue 56: a checkpoint saved under a strategy without tensor-parallel random streams (ddp)
loads into a tensor-parallel job, in new processes, and trains: the streams the new strategy
seeded stay where the checkpoint has none (they were replaced by the saved, empty set, and the
first forward raised KeyError 'model-parallel-rng' is not set)."""

import math

import pytest
import torch

from tests.helpers.dist import run_distributed

TP2 = [("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]


def _llama_with_dropout():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_dropout=0.1))


def _job(strategy):
    from atorch.auto import auto_accelerate
    from tests.helpers.hf import CountingTokens

    _, result, _ = auto_accelerate(_llama_with_dropout(), torch.optim.AdamW, CountingTokens(), lambda b, out: out.loss,
                                   optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8},
                                   model_input_format="unpack_dict", load_strategy=strategy)
    return result


def _step(result) -> float:
    batch = result.prepare_input(next(iter(result.dataloader)), torch.device("cpu"))
    loss = result.loss_func(batch, result.model(**batch))
    result.backward(loss)
    result.step()
    return float(loss)


def save_under_ddp(directory: str) -> float:
    import atorch.checkpoint as ckpt

    result = _job(["parallel_mode"])
    loss = _step(result)
    ckpt.save(directory, result.model, result.optim)
    return loss


def load_under_tensor_parallel(directory: str) -> dict:
    import atorch.checkpoint as ckpt
    from atorch.parallel_layers.random import MODEL_PARALLEL_RNG, tracker_of

    result = _job(TP2)
    ckpt.load(directory, result.model, result.optim)
    streams = sorted(tracker_of(result.model).states)
    return {"loss": _step(result), "streams": streams, "expected": [MODEL_PARALLEL_RNG]}


@pytest.mark.slow  # -m slow; by default: the resume matrix loads dropout runs under tensor_parallel
def test_a_ddp_checkpoint_loads_into_tensor_parallel_in_new_processes(tmp_path):
    run_distributed(save_under_ddp, 2, str(tmp_path / "ckpt"), fresh=True)
    out = run_distributed(load_under_tensor_parallel, 2, str(tmp_path / "ckpt"), fresh=True)
    for rank in out:
        assert math.isfinite(rank["loss"])
        assert rank["streams"] == rank["expected"]
