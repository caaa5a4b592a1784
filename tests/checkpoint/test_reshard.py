"""Resharding: a checkpoint saved under one strategy loads under every other (and in one process),
optimizer state included: the weights are equal, and training continues as it would have."""

import pytest
import torch

import atorch.checkpoint as ckpt
from atorch.errors import NotSupportedError
from tests.checkpoint.jobs import DropoutTransformer, build, full_weights, train
from tests.helpers.compare import FP32_RTOL
from tests.helpers.dist import run_distributed

SOURCES = ("fsdp", "ddp", "zero1", "tp")
TARGETS = ("ddp", "tp", "fsdp", "zero1")


def _save_everywhere(directory):
    out = {}
    for name in SOURCES:
        result = build(name)
        out[name] = {}

        def save(name=name, result=result):
            ckpt.save(f"{directory}/{name}", result.model, result.optim, result.lr_scheduler, result.dataloader)
            out[name]["weights"] = full_weights(result)
            if name == "fsdp":
                ckpt.export(f"{directory}/export", result.model)

        out[name]["continued"] = train(result, 10, after={5: save})[5:]
    from tests.helpers.hf import tiny_llama

    llama = build_llama_fsdp(tiny_llama())
    ckpt.export(f"{directory}/llama", llama)
    out["llama"] = full_weights_of(llama)
    return out


def build_llama_fsdp(model):
    from atorch.auto import auto_accelerate

    _, result, _ = auto_accelerate(model, torch.optim.Adam, load_strategy=["parallel_mode", "fsdp"])
    return result.model


def full_weights_of(model):
    from atorch.checkpoint.export import _full_state

    return _full_state(model)


def _load_everywhere(directory, reference):
    out = {}
    for source in SOURCES:
        for target in TARGETS:
            result = build(target, seed=11)
            ckpt.load(f"{directory}/{source}", result.model, result.optim, result.lr_scheduler, result.dataloader)
            weights = full_weights(result)
            same = all(torch.equal(weights[k], v) for k, v in reference[source]["weights"].items())
            out[source, target] = {"same_weights": same and weights.keys() == reference[source]["weights"].keys(),
                                   "continued": train(result, 5)}
    fairscale = build_fairscale()
    try:
        ckpt.save(f"{directory}/fairscale", fairscale.model, fairscale.optim)
        out["fairscale"] = "saved"
    except NotSupportedError as error:
        out["fairscale"] = str(error)
    return out


def build_fairscale():
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    _, result, _ = auto_accelerate(TinyTransformer(), torch.optim.Adam, TokenDataset(), lm_loss,
                                   dataloader_args={"batch_size": 8}, model_input_format="unpack_dict",
                                   load_strategy=["parallel_mode", ("zero2", {"not_use_fsdp": True})])
    return result


def _close(actual, expected):
    return all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(actual, expected)) and len(actual) == len(expected)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of every source strategy after 5 steps, and exports, written by 2 processes."""
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("reshard")
    return directory, run_distributed(_save_everywhere, 2, str(directory))[0]


def test_checkpoints_load_under_every_strategy_and_in_one_process(saved):
    tmp_path, saved = saved
    loaded = run_distributed(_load_everywhere, 2, str(tmp_path), saved)
    failures = []
    for source in SOURCES:
        for target in TARGETS:
            for rank in range(2):
                cell = loaded[rank][source, target]
                if not cell["same_weights"] or not _close(cell["continued"], saved[source]["continued"]):
                    failures.append((source, target, rank, cell, saved[source]["continued"]))
        # The same checkpoint in a single process, no process group.
        result = build("single", seed=11)
        ckpt.load(tmp_path / source, result.model, result.optim, result.lr_scheduler, result.dataloader)
        for key, value in saved[source]["weights"].items():
            assert torch.equal(result.model.state_dict()[key], value), (source, key)
        continued = train(result, 5)
        if not _close(continued, saved[source]["continued"]):
            failures.append((source, "single", 0, continued, saved[source]["continued"]))
    assert not failures, failures
    assert "zero2 without not_use_fsdp" in loaded[0]["fairscale"]


def test_export_loads_into_serial_and_transformers_models(saved):
    tmp_path, saved = saved
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    serial = DropoutTransformer(0.0)
    serial.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"))
    for key, value in saved["fsdp"]["weights"].items():
        assert torch.equal(serial.state_dict()[key], value), key
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    assert (tmp_path / "llama" / "config.json").is_file() and (tmp_path / "llama" / "model.safetensors").is_file()
    for key, value in saved["llama"].items():
        assert torch.equal(llama.state_dict()[key], value), key
