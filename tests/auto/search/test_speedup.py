"""Without a calibration the search measures bf16's speedup over fp32 (atorch/auto/search/speedup.py)
before deciding anything on it: cached per machine and world size, used by the nominal estimate,
said in the report, and amp is pruned as slower only where the measured speedup says so."""

import json

import torch

from atorch.auto.search import speedup
from atorch.auto.step_cost import _FLOPS, StepCost

CPU = torch.device("cpu")


def test_the_speedup_is_measured_once_then_read_from_its_cache(tmp_path, monkeypatch):
    value, where = speedup.half_speedup(CPU, 1, tmp_path)
    assert 0 < value < 100 and "measured now" in where
    assert json.loads(speedup.speedup_path(CPU, 1, tmp_path).read_text())["half_speedup"] == value

    def not_again(device):
        raise AssertionError("measured again though cached")

    monkeypatch.setattr(speedup, "measure_speedup", not_again)
    again, where = speedup.half_speedup(CPU, 1, tmp_path)
    assert again == value and str(speedup.speedup_path(CPU, 1, tmp_path)) in where


def test_a_damaged_or_foreign_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(speedup, "measure_speedup", lambda device: 1.7)
    path = speedup.speedup_path(CPU, 2, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for text in ("{not json", json.dumps({"half_speedup": "fast"}), json.dumps({"half_speedup": float("nan")}),
                 json.dumps({"half_speedup": 3.0, "setting": {"threads": -1}, "torch": torch.__version__})):
        path.write_text(text)
        assert speedup.half_speedup(CPU, 2, tmp_path)[0] == 1.7


def test_the_nominal_estimate_computes_bf16_at_the_measured_speedup():
    cost = StepCost(model=torch.nn.Linear(2, 2), dims={"data": 1}, state_factor=2.0, compute_dtype="half")
    assert cost.nominal_rate() == _FLOPS["cpu"]["half"]  # not measured: the nominal half rate
    cost.half_speedup = 1.5
    assert cost.nominal_rate() == _FLOPS["cpu"]["fp32"] * 1.5
    cost.compute_dtype = "fp32"
    assert cost.nominal_rate() == _FLOPS["cpu"]["fp32"]


def _amp_pruned_as_slower(tmp_path, measured: float, monkeypatch) -> tuple[int, str]:
    from tests.auto.search import replay

    monkeypatch.setattr(replay, "REPLAY_SPEEDUP", measured)
    report = replay.replay("tests-tiny", tmp_path)["report"]
    slower = [c for c in report["candidates"] if c["pruned_by"] == "slower"
              and any(m["name"] == "amp_native" for m in c["strategy"]["methods"])]
    return len(slower), report["rates"]


def test_amp_is_pruned_as_slower_only_where_the_measured_speedup_says_so(tmp_path, monkeypatch):
    faster, rates = _amp_pruned_as_slower(tmp_path, 1.3, monkeypatch)
    assert faster == 0 and "speedup over fp32 measured: 1.30x" in rates
    slower, rates = _amp_pruned_as_slower(tmp_path, 0.4, monkeypatch)
    assert slower > 0 and "0.40x" in rates
