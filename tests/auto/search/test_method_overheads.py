"""The methods' calibrated host overheads (atorch/auto/search/overheads.py): each method's cost term
charges units of its own overhead, calibration measures the seconds per unit from dry runs, and
with them the estimate comes within a band of the measured step and ranks a toy space as the dry
runs do, on this CPU."""

import dataclasses
import math

import pytest
import torch

from atorch.auto.search import cost
from atorch.auto.search.overheads import fit_seconds
from atorch.auto.search.profiles import UnknownProfileError, load_profile, profile_from_data
from atorch.auto.strategy import Strategy
from tests.helpers.dist import run_distributed


def test_the_fit_recovers_seconds_per_unit_and_leaves_out_a_negative_one():
    rows = [({"step": 1.0}, 0.020), ({"step": 1.0, "fsdp": 9.0}, 0.047), ({"step": 1.0, "zero1": 1.0}, 0.050)]
    assert fit_seconds(rows) == pytest.approx({"step": 0.02, "fsdp": 0.003, "zero1": 0.03})
    # amp measured faster than its estimate: no negative overhead, the rest fit without it
    fit = fit_seconds([*rows, ({"step": 1.0, "amp_native": 1.0}, 0.010)])
    assert "amp_native" not in fit and fit["zero1"] > 0 and fit["step"] > 0
    assert fit_seconds([]) == {}


def _llama(layers: int = 2, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=16))


def _units(strategy: list, dims: dict, **kw) -> dict:
    return cost.build_cost(_llama(), Strategy(strategy), dims, 2.0, 0, 1e6, 32, "cpu", **kw).overhead_units()


def test_each_method_charges_its_own_units():
    ddp = [("parallel_mode", {})]
    assert _units(ddp, {"data": 2}) == {"step": 1.0, "parallel_mode": 1.0}
    assert _units(ddp, {"data": 1}) == {"step": 1.0}  # one rank: no DDP
    # a sharding wrapper replaces DDP: one unit per collective its hooks issue
    fsdp = cost.build_cost(_llama(), Strategy([*ddp, "fsdp"]), {"data": 2}, 2.0, 0, 1e6, 32, "cpu")
    assert fsdp.overhead_units() == {"step": 1.0, "fsdp": sum(fsdp.sync_calls.values())}
    assert _units([*ddp, "zero1"], {"data": 2}) == {"step": 1.0, "parallel_mode": 1.0, "zero1": 1.0}
    # a checkpoint: per tensor its hooks pack, each micro-batch
    assert _units([*ddp, "checkpoint"], {"data": 2}, checkpointed_saves=40)["checkpoint"] == 40
    assert _units([*ddp, "checkpoint", ("gradient_accumulation", {"steps": 2})], {"data": 2},
                  checkpointed_saves=40)["checkpoint"] == 80
    # a tensor layout: one unit per message it launches
    tensor = cost.build_cost(_llama(), Strategy([("parallel_mode", {"dims": [("tensor", 2)]}), "tensor_parallel"]),
                             {"tensor": 2}, 2.0, 0, 1e6, 32, "cpu")
    launched = sum(c.messages for c in tensor.comms if c.dim == "tensor")
    assert launched > 0 and tensor.overhead_units() == {"step": 1.0, "tensor_parallel": launched}
    pipe = cost.build_cost(_llama(), Strategy([("parallel_mode", {"dims": [("pipeline", 2)]}),
                                               ("pipeline_parallel", {"num_microbatches": 4})]),
                           {"pipeline": 2}, 2.0, 0, 1e6, 32, "cpu")
    assert pipe.overhead_units() == {"step": 1.0, "pipeline_parallel": 4}  # per microbatch a rank's stage runs
    # gradient accumulation: per micro-batch past the first
    assert _units([*ddp, ("gradient_accumulation", {"steps": 4})], {"data": 2})["gradient_accumulation"] == 3
    # autocast: per forward operator
    amp = cost.build_cost(_llama(), Strategy([*ddp, "amp_native"]), {"data": 2}, 2.0, 0, 1e6, 32, "cpu",
                          forward_ops=120)
    assert amp.overhead_units()["amp_native"] == 120


def test_the_estimate_charges_units_times_the_calibrated_seconds():
    h100 = dataclasses.replace(load_profile("h100_80gb"), overlap=0.0)  # no collective hides behind it
    step = cost.build_cost(_llama(), Strategy([("parallel_mode", {}), "zero1"]), {"data": 2}, 2.0, 0, 1e6, 32, "cpu")
    step.profile = h100
    without = step.seconds()
    step.profile = dataclasses.replace(h100, method_seconds={"step": 0.01, "parallel_mode": 0.002, "zero1": 0.003,
                                                             "fsdp": 1.0})
    assert step.seconds() - without == pytest.approx(0.015)  # fsdp is not in it
    # fit to whole steps, the overheads are not scaled by a pipeline's bubble (idle compute)
    pipe = cost.build_cost(_llama(), Strategy([("parallel_mode", {"dims": [("pipeline", 2)]}),
                                               ("pipeline_parallel", {"num_microbatches": 2})]),
                           {"pipeline": 2}, 2.0, 0, 1e6, 32, "cpu")
    pipe.profile = h100
    without = pipe.seconds()
    pipe.profile = dataclasses.replace(h100, method_seconds={"step": 0.01, "pipeline_parallel": 0.002})
    assert pipe.bubble > 0 and pipe.seconds() - without == pytest.approx(0.01 + 2 * 0.002)


def _pipeline(microbatches: int, profile):
    step = cost.build_cost(_llama(4), Strategy([("parallel_mode", {"dims": [("pipeline", 4)]}),
                                                ("pipeline_parallel", {"num_microbatches": microbatches})]),
                           {"pipeline": 4}, 2.0, 0, 1e6, 32, "cpu")
    step.profile = profile
    return step


def test_a_bubble_on_shared_cores_costs_only_past_what_the_idle_ranks_give_back():
    """4 stages: bubble 3/m. With a core per rank the step's compute is (1 + bubble) x a rank's; on
    cores 2 ranks share (rates measured with every rank busy) a rank waiting in the bubble gives
    its share away, and the critical path, at a whole core, is (1 + bubble) / 2 x: the larger of
    that and the rank's own compute counts. On a GPU every rank has its device."""
    own = dataclasses.replace(load_profile("h100_80gb"), overlap=0.0)
    shared = dataclasses.replace(own, ranks_per_core=2.0)
    for m, on_shared in ((4, 1.0), (2, 1.25), (1, 2.0)):
        assert _pipeline(m, own).bubble == pytest.approx(3 / m)
        assert _pipeline(m, own).bubble_factor() == pytest.approx(1 + 3 / m)  # device "cpu", a core a rank
        assert _pipeline(m, shared).bubble_factor() == pytest.approx(on_shared)
    gpu = _pipeline(4, shared)
    gpu.device_type = "cuda"
    assert gpu.bubble_factor() == pytest.approx(1.75)
    assert _pipeline(4, None).bubble_factor() == pytest.approx(1.75)  # nominal rates
    # the step time follows: with the bubble free, pipeline=4's compute is a rank's own
    free, whole = _pipeline(4, shared), _pipeline(4, own)
    assert free.seconds() < whole.seconds()


def test_ranks_per_core_is_read_checked_and_measured_from_this_machine(monkeypatch):
    from atorch.auto.search import calibrate as calib

    data = {"matmul_flops": {"fp32": 1e9, "bf16": 2e9}, "sustained_fraction": 1.0, "memory": 2**30, "gpus_per_node": 1,
            "intra_node": {"bandwidth": 1e9, "latency": 1e-5}, "inter_node": {"bandwidth": 1e9, "latency": 1e-5},
            "sources": {"matmul_flops": "t", "memory": "t", "intra_node.bandwidth": "t", "inter_node.bandwidth": "t"}}
    assert profile_from_data(data).ranks_per_core == 1.0
    assert profile_from_data({**data, "ranks_per_core": 2}).ranks_per_core == 2.0
    with pytest.raises(UnknownProfileError, match="ranks_per_core"):
        profile_from_data({**data, "ranks_per_core": 0.5})
    monkeypatch.setattr(calib.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert calib._ranks_per_core({"local_world_size": 4, "threads": 1}) == 2.0
    assert calib._ranks_per_core({"local_world_size": 2, "threads": 4}) == 4.0
    assert calib._ranks_per_core({"local_world_size": 1, "threads": 1}) == 1.0  # a core to spare: 1


def test_a_negative_method_overhead_is_refused():
    data = {"matmul_flops": {"fp32": 1e9, "bf16": 2e9}, "sustained_fraction": 1.0, "memory": 2**30, "gpus_per_node": 1,
            "intra_node": {"bandwidth": 1e9, "latency": 1e-5}, "inter_node": {"bandwidth": 1e9, "latency": 1e-5},
            "sources": {"matmul_flops": "t", "memory": "t", "intra_node.bandwidth": "t", "inter_node.bandwidth": "t"}}
    assert profile_from_data({**data, "method_seconds": {"zero1": 0.01}}).method_seconds == {"zero1": 0.01}
    with pytest.raises(UnknownProfileError, match="method_seconds"):
        profile_from_data({**data, "method_seconds": {"zero1": -0.01}})


# The band the calibrated estimate holds a step to, estimated / measured, on 2 gloo ranks of this
# shared 2-core machine; without the overheads the estimate was 0.4-0.6 of the measured step.
BAND = (0.67, 1.5)


def _toy(layers: int):
    """A Llama other than calibration's (3 blocks of hidden 48 on 16 tokens), its tokens and loss."""
    model = _llama(layers, hidden=48)
    tokens = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": t, "labels": t} for t in tokens], lambda batch, output: output.loss


def _calibrate_then_measure(directory: str, which: list) -> dict:
    """Calibrate 2 ranks, then dry-run a toy Llama's ``which`` candidates (indexes into
    overheads.wanted) at the calibrated rates: estimated with and without the methods' overheads,
    and measured."""
    from atorch.auto.environment import DeviceContext
    from atorch.auto.search import measure
    from atorch.auto.search.calibrate import calibrate
    from atorch.auto.search.overheads import candidates

    rates = calibrate(refresh=True, directory=directory)
    model, dataset, loss = _toy(3)
    chosen = [candidates(model, DeviceContext.detect(), 4)[i] for i in which]
    report = measure(model, chosen, torch.optim.AdamW, dataset, loss, profile=rates, timed_steps=5,
                     max_dryruns=len(chosen), optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 4},
                     model_input_format="unpack_dict")
    rows = []
    for c in report.candidates:
        charged = sum(n * rates.method_seconds.get(m, 0.0) for m, n in (c.estimate_overheads or {}).items())
        rows.append({"names": c.names, "layout": c.layout, "estimated": c.estimated_step_seconds,
                     "without": c.estimated_step_seconds - charged, "measured": 4 / c.throughput})
    return {"rows": rows, "method_seconds": rates.method_seconds}


def _assert_within_band(rows: list) -> None:
    for row in rows:
        ratio, before = row["estimated"] / row["measured"], row["without"] / row["measured"]
        assert BAND[0] <= ratio <= BAND[1], (row, ratio)
        # the overhead term is what brings it there: without it the estimate is further off (by
        # more than this machine's run-to-run noise, about 10%, once seen the other way round)
        assert abs(math.log(ratio)) < abs(math.log(before)) + 0.1, (row, ratio, before)


@pytest.mark.slow  # a calibration and timed steps on 2 shared cores: 14-20 s, and noisy
def test_ddp_and_checkpoint_steps_are_estimated_within_the_band_after_calibration(tmp_path):
    """A toy Llama's plain data parallel and checkpointed steps on 2 ranks, measured, against the
    estimate at this machine's calibration: within the band, and closer than without the term."""
    result = run_distributed(_calibrate_then_measure, 2, str(tmp_path), [0, 4], timeout_s=300)[0]
    # The fit shares a step's fixed cost between "step" and the methods every candidate has (two
    # calibrations here put it on either): some unit must carry it, which one is not fixed.
    assert sum(result["method_seconds"].values()) > 0, result
    _assert_within_band(result["rows"])


@pytest.mark.slow
def test_the_estimate_ranks_a_toy_space_as_the_dry_runs_measure_it(tmp_path):
    """Every calibrated kind of candidate on a toy Llama (2 ranks): Spearman of estimated with
    measured throughput at least 0.8."""
    from benchmarks.harness import spearman

    result = run_distributed(_calibrate_then_measure, 2, str(tmp_path), list(range(9)), timeout_s=600)[0]
    rows = result["rows"]
    assert len(rows) >= 8, rows
    rho = spearman([1 / r["estimated"] for r in rows], [1 / r["measured"] for r in rows])
    before = spearman([1 / r["without"] for r in rows], [1 / r["measured"] for r in rows])
    print(f"Spearman {rho:.2f} (without the overheads {before:.2f})")
    for r in rows:
        print(f"{' + '.join(r['names'][1:]) or 'plain'} [{r['layout']}]: measured {r['measured'] * 1e3:.1f} ms, "
              f"estimated {r['estimated'] * 1e3:.1f} ms ({r['without'] * 1e3:.1f} without the overheads)")
    assert rho >= 0.8, (rho, before, rows)
