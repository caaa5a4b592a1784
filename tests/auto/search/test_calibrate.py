"""Calibration: this machine's rates measured once, cached per device type and world size, and
used by the search's step-time estimate."""

import json
import math
from pathlib import Path

import pytest
import torch

from atorch.auto import Strategy
from atorch.auto.search import calibrate as calib
from atorch.auto.search import cost
from tests.helpers.dist import run_distributed


def _calibrate_three_times(directory: str) -> dict:
    from atorch.auto.search.calibrate import cache_path, cached_rates, calibrate

    path = cache_path(torch.device("cpu"), 2, directory)
    first = calibrate(directory=directory)
    written = path.read_text()
    again = calibrate(directory=directory)
    unchanged = path.read_text() == written
    rates, text = cached_rates(torch.device("cpu"), 2, directory)
    other_world, other_text = cached_rates(torch.device("cpu"), 4, directory)
    return {"first": first, "again": again, "unchanged": unchanged,
            "path": str(path), "cached": rates, "text": text, "other_world": other_world, "other_text": other_text}


def test_calibration_measures_caches_and_reuses_on_2_ranks(tmp_path):
    results = run_distributed(_calibrate_three_times, 2, str(tmp_path))
    result = results[0]
    first = result["first"]
    assert result["path"].endswith("cpu-world2.json")
    assert all(math.isfinite(v) and v > 0 for v in first.matmul_flops.values())
    assert set(first.matmul_flops) == {"fp32", "bf16"}
    # on a CPU bf16 is charged no faster than autocast made a model's step (see _autocast_speedup)
    data = json.loads(Path(result["path"]).read_text())
    speedup = data["calibration"]["autocast_step_speedup"]
    rates = result["cached"]  # the profile that file holds
    assert rates.matmul_flops["bf16"] <= rates.matmul_flops["fp32"] * speedup * (1 + 1e-9)
    # and attention runs at rates of its own, per dtype
    assert set(rates.attention_flops) == {"fp32", "bf16"} and all(v > 0 for v in rates.attention_flops.values())
    assert set(first.collectives) == set(calib.KINDS)
    assert 1e-8 < first.op_seconds < 1e-2  # microseconds of Python and dispatch per operator
    assert 0 <= first.wrapped_call_seconds < 1e-1  # FSDP2's host work per collective (beyond its latency)
    assert 0 < first.checkpoint_save_seconds < 1e-2  # the checkpoint's hooks per tensor a block saves
    for kind, by_size in first.collectives.items():
        link = by_size[2]
        assert math.isfinite(link.bandwidth) and link.bandwidth > 0, kind
        assert math.isfinite(link.latency) and link.latency > 0, kind
    # The second call reads the cache (the same rates, the file untouched); refresh measures again
    # (tests/test_cli_calibrate.py, on one rank).
    assert result["again"] == first and result["unchanged"]
    assert result["cached"] == first and result["text"].startswith("calibrated rates")
    # Every rank got the same rates; another world size has no calibration yet.
    assert results[1]["first"] == first
    assert result["other_world"] is None and "cpu-world4.json" in result["other_text"]
    assert "atorch calibrate --nproc 4" in result["other_text"]
    # The file is a hardware profile: `atorch plan --search --profile FILE` reads it.
    from atorch.auto.search.profiles import load_profile

    assert load_profile(result["path"]) == result["cached"]


def _write_calibration(directory, world: int, flops: float, links: dict[str, tuple[float, float]]) -> None:
    """A calibration as `calibrate` writes it, with chosen rates, for this process's setting."""
    setting = calib._setting(torch.device("cpu"))
    link = {"bandwidth": 1e9, "latency": 1e-4}
    data = {
        "name": "test", "matmul_flops": {"fp32": flops, "bf16": flops / 2}, "sustained_fraction": 1.0,
        "memory": "1GiB", "gpus_per_node": setting["local_world_size"], "intra_node": link, "inter_node": link,
        "collectives": {kind: {str(world): {"bandwidth": bw, "latency": lat}} for kind, (bw, lat) in links.items()},
        "op_seconds": 0.0,
        "checkpoint_save_seconds": 0.0,
        "wrapped_call_seconds": 0.0,
        "method_seconds": {},
        "ranks_per_core": 1.0,
        "attention_flops": {"fp32": flops, "bf16": flops / 2},
        "calibration": {"device": "cpu", "world_size": world, **setting, "autocast_step_speedup": 1.0},
        "sources": {"matmul_flops": "test", "memory": "test", "intra_node.bandwidth": "test",
                    "inter_node.bandwidth": "test"},
    }
    path = calib.cache_path(torch.device("cpu"), world, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_cost_model_uses_calibrated_rates_per_collective(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    grads = sum(p.numel() * 4 for p in model.parameters())
    links = {"all_reduce": (2e8, 3e-4), "all_gather": (4e8, 5e-5), "reduce_scatter": (1e8, 7e-5),
             "send_recv": (5e8, 2e-5)}
    _write_calibration(tmp_path, 2, 1e9, links)
    rates, text = calib.cached_rates(torch.device("cpu"), 2, tmp_path)
    assert rates is not None and text.startswith("calibrated rates") and str(tmp_path) in text

    ddp = cost.build_cost(model, Strategy([("parallel_mode", {})]), {"data": 2}, 2.0, 0, 1e9, 64, "cpu")
    nominal = ddp.seconds()
    ddp.profile = rates
    # compute at the measured fp32 rate; the gradients all-reduced at the all-reduce's rate, and
    # the loss count's all-reduce (3 float64, atorch/loss) too
    assert ddp.seconds() == pytest.approx(3e9 / 1e9 + 2 * grads / 2 / 2e8 + 3e-4 + 2 * 24 / 2 / 2e8 + 3e-4)
    assert ddp.seconds() != pytest.approx(nominal)

    fsdp = cost.build_cost(model, Strategy([("parallel_mode", {}), ("fsdp", {"atorch_wrap_cls": ["Linear"]})]),
                           {"data": 2}, 2.0, 0, 1e9, 64, "cpu")
    fsdp.profile = rates
    # parameters all-gathered twice, gradients reduce-scattered, each at its own rate; unit by
    # unit (the two Linear units and the root), each collective paying the latency
    assert fsdp.seconds() == pytest.approx(3e9 / 1e9 + 2 * grads / 2 / 4e8 + 6 * 5e-5 + grads / 2 / 1e8 + 3 * 7e-5
                                           + 2 * 24 / 2 / 2e8 + 3e-4)


def test_a_calibration_taken_with_another_setting_is_not_used(tmp_path, monkeypatch):
    _write_calibration(tmp_path, 2, 1e9, {"all_reduce": (1e8, 1e-4)})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the cached one was taken with 1 rank per node
    rates, text = calib.cached_rates(torch.device("cpu"), 2, tmp_path)
    assert rates is None and text.startswith("nominal rates") and "local_world_size" in text


@pytest.mark.parametrize("term", ["op_seconds", "checkpoint_save_seconds", "wrapped_call_seconds", "method_seconds",
                                  "ranks_per_core"])
def test_a_calibration_from_before_an_overhead_was_measured_is_measured_again(tmp_path, term):
    _write_calibration(tmp_path, 2, 1e9, {"all_reduce": (1e8, 1e-4)})
    path = calib.cache_path(torch.device("cpu"), 2, tmp_path)
    data = json.loads(path.read_text())
    del data[term]
    path.write_text(json.dumps(data))
    rates, text = calib.cached_rates(torch.device("cpu"), 2, tmp_path)
    assert rates is None and "atorch calibrate --refresh" in text


def test_a_cpu_calibration_from_before_its_bf16_and_attention_rates_is_measured_again(tmp_path):
    _write_calibration(tmp_path, 2, 1e9, {"all_reduce": (1e8, 1e-4)})
    path = calib.cache_path(torch.device("cpu"), 2, tmp_path)
    assert calib.cached_rates(torch.device("cpu"), 2, tmp_path)[0] is not None
    data = json.loads(path.read_text())
    for forget in (lambda d: d["calibration"].pop("autocast_step_speedup"), lambda d: d.pop("attention_flops")):
        stale = json.loads(json.dumps(data))
        forget(stale)
        path.write_text(json.dumps(stale))
        rates, text = calib.cached_rates(torch.device("cpu"), 2, tmp_path)
        assert rates is None and "autocast" in text and "atorch calibrate --refresh" in text


def test_what_autocast_gains_on_a_model_step_is_measured():
    # square bf16 matmuls can run 4x fp32's on a CPU where a model steps no faster under amp
    speedup = calib._autocast_speedup(torch.device("cpu"))
    assert 0.01 < speedup < 20


def _step_estimate() -> tuple[float, str]:
    from atorch.auto.search import measure
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    torch.manual_seed(0)
    report = measure(TinyTransformer(), [[]], torch.optim.AdamW, TokenDataset(n=32), lm_loss, optim_args={"lr": 1e-3},
                     dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", timed_steps=1)
    return report.candidates[0].estimated_step_seconds, report.rates


def test_the_search_reports_and_uses_the_calibration_of_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    # the optimizer's step is timed afresh by each search (not a rate of the profile): left out here
    monkeypatch.setattr(cost, "optimizer_seconds_per_byte", lambda *args: 0.0)
    nominal, text = _step_estimate()
    assert text.startswith("nominal rates (no calibration at") and "atorch calibrate --nproc 1" in text
    # A machine calibrated 1000x slower than the nominal CPU rate: the estimate follows.
    slow = cost._FLOPS["cpu"]["fp32"] / 1000
    _write_calibration(calib.default_dir(), 1, slow, {})
    calibrated, text = _step_estimate()
    assert text.startswith("calibrated rates") and "cpu-world1.json" in text
    assert calibrated == pytest.approx(nominal * 1000, rel=1e-6)


def test_a_calibration_without_its_bf16_rate_is_not_used(tmp_path, caplog):
    # Issue 56: accepted, then a KeyError at the first amp candidate's estimate.
    import logging

    _write_calibration(tmp_path, 2, 1e9, {"all_reduce": (1e8, 1e-4)})
    path = calib.cache_path(torch.device("cpu"), 2, tmp_path)
    data = json.loads(path.read_text())
    del data["matmul_flops"]["bf16"]
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="atorch"):
        rates, text = calib.cached_rates(torch.device("cpu"), 2, tmp_path)
    assert rates is None and "needs both 'fp32' and 'bf16' rates" in text
