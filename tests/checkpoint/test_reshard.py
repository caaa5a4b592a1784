"""Resharding: a checkpoint saved under one strategy loads under every other and in one process,
optimizer state included: the weights are equal, and training continues as it would have."""

import torch

import atorch.checkpoint as ckpt
from tests.checkpoint.jobs import DropoutTransformer, build, train
from tests.checkpoint.runs import SOURCES, TARGETS, build_gpt2
from tests.helpers.compare import FP32_RTOL


def _close(actual, expected):
    return len(actual) == len(expected) and all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(actual, expected))


def _assert_weights(model, expected):
    state = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_every_strategy_loads_every_other_on_2_processes(two_ranks):
    _, first, second = two_ranks
    saved = first[0]["reshard"]
    failures = [(source, target, rank, cell, saved[source]["continued"])
                for rank in range(2) for (source, target), cell in second[rank]["reshard"].items()
                if not cell["same_weights"] or not _close(cell["continued"], saved[source]["continued"])]
    assert len(second[0]["reshard"]) == len(SOURCES) * len(TARGETS) and not failures, failures


def test_every_strategy_loads_in_one_process(two_ranks):
    directory, first, _ = two_ranks
    for source in SOURCES:
        saved = first[0]["reshard"][source]
        result = build("single", seed=11)
        ckpt.load(directory / source, result.model, result.optim, result.lr_scheduler, result.dataloader)
        _assert_weights(result.model, saved["weights"])
        assert _close(train(result, 5), saved["continued"]), source


def test_tensor_parallel_gpt2_loads_as_the_serial_model(two_ranks):
    # tensor_parallel rebuilt GPT-2's Conv1D layers as transposed, regrouped Linears; the
    # checkpoint holds the Conv1D layout: the untrained model's checkpoint is tiny_gpt2() itself.
    from tests.helpers.hf import tiny_gpt2

    directory, first, _ = two_ranks
    serial = build_gpt2([])
    ckpt.load(directory / "gpt2_init", serial.model)
    _assert_weights(serial.model, tiny_gpt2().state_dict())
    serial = build_gpt2([])
    ckpt.load(directory / "gpt2", serial.model, serial.optim, dataloader=serial.dataloader)
    assert _close(train(serial, 3), first[0]["transformers"]["gpt2_continued"])


def test_export_loads_into_serial_and_transformers_models(two_ranks):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    directory, first, _ = two_ranks
    serial = DropoutTransformer(0.0)
    serial.load_state_dict(load_file(directory / "export" / "model.safetensors"))
    _assert_weights(serial, first[0]["reshard"]["fsdp"]["weights"])
    assert (directory / "llama" / "config.json").is_file()
    _assert_weights(LlamaForCausalLM.from_pretrained(directory / "llama"), first[0]["transformers"]["llama"])


def test_fairscale_is_refused_with_the_alternative(two_ranks):
    _, _, second = two_ranks
    assert "zero2 without not_use_fsdp" in second[0]["refused"]["fairscale"]
