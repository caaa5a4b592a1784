"""The cost model's per-operator overhead: a step's operators (counted in the probe's forward)
times the calibrated seconds per operator, the term that FLOPs miss on small models; a pipeline
stage runs its share of the operators once per microbatch. Datasheet profiles charge none."""

import dataclasses

import pytest
import torch

from atorch.auto.search import cost
from atorch.auto.search.ops import OpCounter
from atorch.auto.search.profiles import UnknownProfileError, load_profile, profile_from_data
from atorch.auto.strategy import Strategy


def test_the_counter_counts_dispatched_operators():
    x = torch.randn(4, 4)
    with OpCounter() as ops:
        (x @ x).relu().sum()
    assert ops.count == 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))


def test_the_probe_counts_the_forward_operators():
    from atorch.auto.environment import DeviceContext

    counts: list = []
    cost.activation_bytes(_model(), Strategy([("parallel_mode", {})]), torch.randn(2, 16), None, None,
                          DeviceContext.detect(), counts)
    flops, ops, profile, hooked, spans, attention, traffic, whole, recomputed, _again = counts
    assert hooked == 0 and attention == 0 and recomputed == 0  # no checkpoint: no tensor goes through its hooks
    assert traffic == whole == 0  # a Linear is a view of its weight and a matmul: nothing without FLOPs moves data
    assert profile == () and spans == ()  # no loss: the backward is not probed
    assert flops == 2 * 2 * 16 * 16 * 4  # four matmuls of a 2 x 16 batch
    assert ops >= 4  # at least a linear (addmm) per layer


def _profile(op_seconds: float):
    h100 = load_profile("h100_80gb")
    return dataclasses.replace(h100, op_seconds=op_seconds)


def test_each_operator_of_each_pass_costs_the_calibrated_overhead():
    step = cost.build_cost(_model(), Strategy([("parallel_mode", {})]), {"data": 1}, 2.0, 0, 1e6, 32, "cpu",
                           forward_ops=100)
    step.profile = _profile(0.0)
    without = step.seconds()
    step.profile = _profile(1e-5)
    assert step.seconds() - without == pytest.approx(100 * 3 * 1e-5)
    checkpointed = cost.build_cost(_model(), Strategy([("parallel_mode", {}), "checkpoint"]), {"data": 1}, 2.0, 0,
                                   1e6, 32, "cpu", forward_ops=100)
    checkpointed.profile = _profile(1e-5)
    assert checkpointed.passes == 4  # the recomputed forward dispatches its operators again


def test_a_checkpointed_block_costs_its_hooks_on_every_tensor_it_saves():
    """Beyond recomputing its forward, a checkpointed block pays the checkpoint's hooks on each
    tensor it saves (calibrated per tensor: on a CPU several times an operator's own overhead);
    without checkpoint the probe counts none."""
    def seconds(methods, hooks, saves=0):
        step = cost.build_cost(_model(), Strategy([("parallel_mode", {}), *methods]), {"data": 1}, 2.0, 0, 1e6, 32,
                               "cpu", forward_ops=100, checkpointed_saves=saves)
        step.profile = dataclasses.replace(_profile(1e-5), checkpoint_save_seconds=hooks)
        return step.seconds()

    assert seconds(["checkpoint"], 4e-5, 30) - seconds(["checkpoint"], 0.0, 30) == pytest.approx(30 * 4e-5)
    assert seconds([], 4e-5) == seconds([], 0.0)


@pytest.mark.parametrize("method, gathers", [("fsdp", 2), ("zero2", 1)])
def test_fsdp2_costs_its_host_work_on_every_collective_its_hooks_issue(method, gathers):
    """Per unit, fsdp gathers twice (forward, then backward) and zero2 once, and both
    reduce-scatter once: each of those collectives costs the profile's wrapped_call_seconds of
    host work. DDP's bucketed all-reduce costs none."""
    def seconds(methods, host):
        step = cost.build_cost(_model(), Strategy([("parallel_mode", {}), *methods]), {"data": 2}, 2.0, 0, 1e6, 32,
                               "cpu", forward_ops=100)
        step.profile = dataclasses.replace(_profile(1e-5), wrapped_call_seconds=host)
        return step, step.seconds()

    step, without = seconds([method], 0.0)
    _, with_host = seconds([method], 1e-3)
    assert step.sync_calls["all_gather"] == gathers * step.sync_calls["reduce_scatter"]
    calls = sum(step.sync_calls.values())
    assert step.sync_in_hooks and calls > 0
    assert with_host - without == pytest.approx(calls * 1e-3)
    assert seconds([], 1e-3)[1] == seconds([], 0.0)[1]


def test_on_a_gpu_the_host_overhead_overlaps_the_kernels():
    """The slower of the two counts: the kernels when they are long, the host when they are short."""
    def seconds(flops, op_seconds):
        step = cost.build_cost(_model(), Strategy([("parallel_mode", {})]), {"data": 1}, 2.0, 0, flops, 32, "cuda",
                               forward_ops=100)
        step.profile = _profile(op_seconds)
        return step.seconds()

    assert seconds(1e15, 1e-5) == pytest.approx(seconds(1e15, 0.0))  # 4.3 s of kernels hide 3 ms of launches
    assert seconds(1e6, 1e-5) == pytest.approx(100 * 3 * 1e-5)  # tiny kernels: the host's time


def test_a_named_profile_charges_no_overhead():
    assert load_profile("h100_80gb").op_seconds == 0.0


def test_a_pipeline_stage_runs_its_operators_once_per_microbatch():
    from atorch.methods.pipeline_parallel import pipeline_terms
    from atorch.pipeline.auto import PipelineFields

    step = cost.build_cost(_model(), Strategy([("parallel_mode", {})]), {"pipeline": 2}, 2.0, 0, 1e6, 32)
    pipeline_terms(step, PipelineFields(num_microbatches=4, pipeline_cuts=["1"]), 2)
    assert step.op_share == pytest.approx(0.5 * 4)


@pytest.mark.parametrize("term", ["op_seconds", "checkpoint_save_seconds", "wrapped_call_seconds"])
def test_a_negative_overhead_is_refused(term):
    data = {"matmul_flops": {"fp32": 1e9, "bf16": 2e9}, "sustained_fraction": 1.0, "memory": "1GiB", "gpus_per_node": 1,
            "intra_node": {"bandwidth": 1e9, "latency": 1e-5}, "inter_node": {"bandwidth": 1e9, "latency": 1e-5},
            "sources": {"matmul_flops": "t", "memory": "t", "intra_node.bandwidth": "t", "inter_node.bandwidth": "t"},
            term: -1.0}
    with pytest.raises(UnknownProfileError, match=term):
        profile_from_data(data)
    data[term] = 2e-6
    assert getattr(profile_from_data(data), term) == 2e-6
