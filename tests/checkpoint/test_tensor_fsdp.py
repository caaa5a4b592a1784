"""tensor_parallel with fsdp over the data dim (tensor 2 x data 2): each weight is a tensor slice
that FSDP2 shards again. Its checkpoint resumes exactly on 4 processes and loads in one, where
training continues as on 4."""

import torch

import atorch.checkpoint as ckpt
from tests.checkpoint import jobs
from tests.helpers.compare import FP32_RTOL
from tests.helpers.dist import run_distributed

TP2_FSDP2 = [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel", "fsdp"]


def _save_and_resume(directory):
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


def test_tensor_parallel_under_fsdp_resumes_and_loads_in_one_process(tmp_path):
    results = run_distributed(_save_and_resume, 4, str(tmp_path), timeout_s=400)
    for result in results:
        assert result["same_weights"] and result["resumed"] == result["continued"], result
    serial = jobs.build("single", seed=9, dropout=0.0)
    ckpt.load(tmp_path / "c", serial.model, serial.optim, serial.lr_scheduler, serial.dataloader)
    for key, value in results[0]["weights"].items():
        assert torch.equal(serial.model.state_dict()[key], value), key
    continued = jobs.train(serial, 3)  # Adam's state came along: the same steps as on 4 ranks
    assert all(abs(a - e) <= FP32_RTOL * abs(e) for a, e in zip(continued, results[0]["continued"])), continued
