"""Attention kernels at a rate of their own: the probe counts the FLOPs a forward spends in
scaled_dot_product_attention, a CPU calibration measures attention's forward + backward per dtype,
and the step-time estimate charges those FLOPs at that rate. On an EPYC with bf16 instructions,
bf16 matmuls ran 4.3x the fp32 rate and bf16 attention's backward 5x slower than fp32's: a small
Llama's amp step was no faster than fp32's, while the estimate had put it 38% faster."""

import dataclasses
import json

import pytest
import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.search import cost
from atorch.auto.search.profiles import UnknownProfileError, load_profile
from atorch.auto.strategy import Strategy


def _llama():
    from benchmarks.workload import TINY, Tokens, build_llama

    model, data = build_llama(TINY), Tokens(TINY, n=4)
    batch = torch.utils.data.default_collate([data[i] for i in range(2)])
    return model, batch


def _counts(model, batch, input_format="unpack_dict") -> list:
    counts: list = []
    cost.activation_bytes(model, resolve_strategy(model, Strategy([("parallel_mode", {})])), batch, input_format,
                          None, DeviceContext.detect(), counts)
    return counts


def test_the_probe_counts_the_forwards_flops_in_attention():
    model, batch = _llama()
    flops, *_, attention, _traffic, _whole, _recomputed, _again = _counts(model, batch)
    # causal attention over 2 x 16 tokens, 2 heads of 16: q @ k^T and p @ v, 2 FLOPs per multiply-add
    layers, heads, seq, head = model.config.num_hidden_layers, 2, 16, 16
    assert attention == pytest.approx(layers * 2 * (2 * 2 * heads * seq * seq * head))
    assert 0 < attention < flops
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    assert _counts(mlp, torch.randn(4, 8), None)[5] == 0


def test_the_step_estimate_charges_attention_at_its_own_rate(tmp_path):
    model, batch = _llama()
    flops, _, profile, hooked, spans, attention, _traffic, _whole, _recomputed, _again = _counts(model, batch)
    h100 = dataclasses.replace(load_profile("h100_80gb"), attention_flops={})  # attention at the matmul rate
    slow = dataclasses.replace(h100, attention_flops={"fp32": h100.rate("fp32") / 10, "bf16": h100.rate("half") / 10})

    def seconds(rates) -> float:
        step = cost.build_cost(model, Strategy([("parallel_mode", {})]), {"data": 1}, 2.0, 0, flops, 32, "cuda",
                               attention_flops=attention)
        step.profile = rates
        return step.seconds()

    # 3 passes of the attention FLOPs at a tenth of the rate: 9 x their time at the matmul rate more
    assert seconds(slow) - seconds(h100) == pytest.approx(9 * 3 * attention / h100.rate("fp32"), rel=1e-6)
    assert h100.attention_rate("half") == h100.rate("half")  # a profile without attention rates: the matmul rate
    calibrated = load_profile("h100_80gb")  # fitted to published and measured runs (benchmarks/fit_profile.py)
    assert calibrated.attention_rate("half") == pytest.approx(0.36 * calibrated.peak("half"), rel=1e-3)

    data = json.loads(load_profile.__globals__["FOLDER"].joinpath("h100_80gb.json").read_text())
    data["attention_flops"] = {"bf16": -1.0}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UnknownProfileError, match="attention_flops"):
        load_profile(str(path))
