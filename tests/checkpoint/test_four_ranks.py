"""Four ranks, one spawn: tensor_parallel with fsdp over the data dim (tensor 2 x data 2: each
weight is a tensor slice that FSDP2 shards again), and mixed_parallel (tensor 2 x pipeline 2).
Their checkpoints resume exactly on 4 processes and load in one, where training continues as on 4."""

import pytest
import torch

import atorch.checkpoint as ckpt
from tests.checkpoint import jobs
from tests.helpers.compare import FP32_RTOL
from tests.helpers.dist import run_distributed

TP2_FSDP2 = [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel", "fsdp"]


def _four_ranks(directory):
    return {"tp_fsdp": _tensor_fsdp(directory), "mixed": _mixed(directory)}


def _mixed(directory):
    from tests.checkpoint.runs import build_llama

    result, out = build_llama([("mixed_parallel", {"num_microbatches": 2})]), {}

    def save():
        ckpt.save(f"{directory}/mixed", result.model, result.optim, dataloader=result.dataloader)
        out["weights"] = jobs.full_weights(result)

    out["continued"] = jobs.train(result, 6, after={3: save})[3:]
    return out


def _tensor_fsdp(directory):
    jobs.STRATEGIES["tp_fsdp"] = TP2_FSDP2
    result, out = jobs.build("tp_fsdp", dropout=0.0), {}

    def save():
        ckpt.save(f"{directory}/c", result.model, result.optim, result.lr_scheduler, result.dataloader)
        out["weights"] = jobs.full_weights(result)

    out["continued"] = jobs.train(result, 6, after={3: save})[3:]
    resumed = jobs.build("tp_fsdp", seed=4, dropout=0.0)
    ckpt.load(f"{directory}/c", resumed.model, resumed.optim, resumed.lr_scheduler, resumed.dataloader)
    weights = jobs.full_weights(resumed)
    out["same_weights"] = all(torch.equal(weights[k], v) for k, v in out["weights"].items())
    out["resumed"] = jobs.train(resumed, 3)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("four")
    return directory, run_distributed(_four_ranks, 4, str(directory), timeout_s=400)


def test_tensor_parallel_under_fsdp_resumes_and_loads_in_one_process(four_ranks):
    tmp_path, runs = four_ranks
    results = [run["tp_fsdp"] for run in runs]
    for result in results:
        assert result["same_weights"] and result["resumed"] == result["continued"], result
    serial = jobs.build("single", seed=9, dropout=0.0)
    ckpt.load(tmp_path / "c", serial.model, serial.optim, serial.lr_scheduler, serial.dataloader)
    for key, value in results[0]["weights"].items():
        assert torch.equal(serial.model.state_dict()[key], value), key
    continued = jobs.train(serial, 3)  # Adam's state came along: the same steps as on 4 ranks
    assert all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(continued, results[0]["continued"])), continued


def test_mixed_parallel_loads_in_one_process(four_ranks):
    from tests.checkpoint.runs import build_llama

    directory, runs = four_ranks
    saved = runs[0]["mixed"]
    serial = build_llama([])
    ckpt.load(directory / "mixed", serial.model, serial.optim, dataloader=serial.dataloader)
    for key, value in saved["weights"].items():
        assert torch.equal(serial.model.state_dict()[key], value), key
    continued = jobs.train(serial, 3)
    assert all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(continued, saved["continued"])), continued
