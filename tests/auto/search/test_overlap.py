"""Communication the data-parallel methods issue early hides behind compute: DDP's gradient
buckets and FSDP2's reduce-scatters behind backward, FSDP2's prefetched all-gathers behind forward
(and backward); zero1's broadcast after the step waits. How much hides is the hardware profile's
``overlap``; the compute of the pass is the most that can hide behind it."""

import dataclasses
import json

import pytest
import torch

from atorch.auto.search import cost
from atorch.auto.search.profiles import FOLDER, UnknownProfileError, load_profile, profile_from_data
from atorch.auto.strategy import Strategy


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))


def _seconds(methods: list, data: int, overlap: float, flops: float) -> float:
    step = cost.build_cost(_model(), Strategy([("parallel_mode", {}), *methods]), {"data": data}, 2.0, 0, flops,
                           32, "cuda")
    step.profile = dataclasses.replace(load_profile("h100_80gb"), overlap=overlap)
    return step.seconds()


LONG = 1e15  # forward FLOPs: a compute far longer than any of these syncs
SHORT = 1e6  # a compute far shorter


def test_ddp_gradient_sync_hides_behind_backward_as_far_as_the_profile_says():
    alone = _seconds([], 1, 1.0, LONG)  # one rank: no sync at all
    exposed = _seconds([], 8, 0.0, LONG)
    sync = exposed - alone
    assert sync > 0
    assert _seconds([], 8, 1.0, LONG) == pytest.approx(alone)
    assert _seconds([], 8, 0.25, LONG) == pytest.approx(alone + 0.75 * sync)


def test_no_more_hides_than_the_backward_computes():
    alone = _seconds([], 1, 1.0, SHORT)
    sync = _seconds([], 8, 0.0, SHORT) - alone
    backward = alone * 2 / 3  # forward + backward are 3 forwards' FLOPs, backward two of them
    assert sync > backward
    assert _seconds([], 8, 1.0, SHORT) == pytest.approx(alone + sync - backward)


@pytest.mark.parametrize("method", ["zero2", "fsdp"])
def test_fsdp2_gathers_and_reduce_scatters_hide(method):
    alone = _seconds([method], 1, 1.0, LONG)
    assert _seconds([method], 8, 0.0, LONG) > alone
    assert _seconds([method], 8, 1.0, LONG) == pytest.approx(alone)


def test_zero1_broadcast_after_the_step_waits():
    """zero1's all-reduce runs in DDP's buckets (hidden), its broadcast of the updated parameters
    after the step does not: zero1 stays slower than DDP by that broadcast."""
    ddp = _seconds([], 8, 1.0, LONG)
    zero1, zero1_exposed = _seconds(["zero1"], 8, 1.0, LONG), _seconds(["zero1"], 8, 0.0, LONG)
    ddp_exposed = _seconds([], 8, 0.0, LONG)
    assert zero1 > ddp
    assert zero1_exposed - zero1 == pytest.approx(ddp_exposed - ddp)  # only the all-reduce hid


def test_the_profile_overlap_is_a_sourced_share():
    h100 = json.loads((FOLDER / "h100_80gb.json").read_text())
    assert 0 < load_profile("h100_80gb").overlap <= 1 and "overlap" in h100["sources"]
    with pytest.raises(UnknownProfileError, match="overlap"):
        profile_from_data({**h100, "overlap": 1.5})
    without = {k: v for k, v in h100.items() if k != "overlap"}
    assert profile_from_data(without).overlap == 0.0  # a calibrated or older profile: nothing hides


def test_under_accumulation_only_the_last_micro_batchs_backward_hides_the_all_reduce():
    """atorch/auto/loop.py turns the gradients' sync off until the last of 4 micro-batches: DDP's
    all-reduce hides behind that micro-batch's backward alone, a quarter of the step's (it had hidden
    behind all four)."""
    methods = [("gradient_accumulation", {"steps": 4})]
    sync = _seconds(methods, 8, 0.0, SHORT) - _seconds(methods, 1, 1.0, SHORT)
    # a forward whose backward takes twice that sync's time: a quarter of it hides half the sync
    flops = sync * load_profile("h100_80gb").rate("float32")
    alone = _seconds(methods, 1, 1.0, flops)
    backward = alone * 2 / 3
    assert backward == pytest.approx(2 * sync, rel=0.01)
    hidden = _seconds(methods, 8, 0.0, flops) - _seconds(methods, 8, 1.0, flops)
    assert hidden == pytest.approx(backward / 4, rel=1e-3)


def test_fsdp_reducing_every_micro_batch_hides_behind_every_backward():
    """Under accumulation FSDP2's reduce-scatter has the last micro-batch's backward as its window,
    unless fsdp reduces every micro-batch (``reduce_every_micro_batch``); its gathers run in every
    micro-batch either way."""
    def window(config: dict) -> dict:
        step = cost.build_cost(_model(), Strategy([("parallel_mode", {}), ("fsdp", config),
                                                   ("gradient_accumulation", {"steps": 4})]),
                               {"data": 8}, 2.0, 0, LONG, 32, "cuda")
        return step.sync_window

    assert window({}) == {"all_reduce": 0.25, "reduce_scatter": 0.25}
    assert window({"reduce_every_micro_batch": True}) == {"all_reduce": 0.25}


def _pipeline_seconds(schedule: str, overlap: float, whole_window: bool = False) -> float:
    strategy = Strategy([("parallel_mode", ([("pipeline", 2), ("data", 4)], None)),
                         ("pipeline_parallel", {"num_microbatches": 4, "schedule": schedule})])
    step = cost.build_cost(_model(), strategy, {"pipeline": 2, "data": 4}, 2.0, 0, LONG, 32, "cuda")
    step.profile = dataclasses.replace(load_profile("h100_80gb"), overlap=overlap)
    if whole_window:
        step.sync_window = {}
    return step.seconds()


def test_a_pipelines_sums_hide_only_behind_the_backward_after_its_last_microbatch():
    """PipelineModel starts the data ranks' sums in each stage's last backward (grad_sync.py):
    behind a long backward the sums hide whole under 1F1B (its last microbatch's backward is the
    window), and not at all under a zero-bubble schedule, whose weight pass fills the gradients
    only at its end."""
    for schedule, hides in (("1f1b", True), ("zero_bubble", False)):
        exposed = _pipeline_seconds(schedule, 0.0)
        whole = exposed - _pipeline_seconds(schedule, 1.0, whole_window=True)  # all the sums can hide
        assert whole > 0
        assert exposed - _pipeline_seconds(schedule, 1.0) == pytest.approx(whole if hides else 0.0, abs=1e-12)


def test_fsdp_beside_a_pipeline_reduce_scatters_after_the_schedule_unhidden():
    """torch's single-stage schedules reduce-scatter FSDP2's gradients after the last microbatch
    (PipelineStage.perform_reduce_grad): behind no backward, where the gathers still hide."""
    strategy = Strategy([("parallel_mode", ([("pipeline", 2), ("data", 4)], None)),
                         ("pipeline_parallel", {"num_microbatches": 4}), "fsdp"])

    def seconds(overlap: float, scatters_hide: bool = True) -> float:
        step = cost.build_cost(_model(), strategy, {"pipeline": 2, "data": 4}, 2.0, 0, LONG, 32, "cuda")
        step.profile = dataclasses.replace(load_profile("h100_80gb"), overlap=overlap)
        if not scatters_hide:
            step.sync_overlap = {k: v for k, v in step.sync_overlap.items() if k != "reduce_scatter"}
        return step.seconds()

    exposed, hidden = seconds(0.0), seconds(1.0)
    assert exposed > hidden  # the gathers hide
    assert hidden == pytest.approx(seconds(1.0, scatters_hide=False), abs=1e-12)
