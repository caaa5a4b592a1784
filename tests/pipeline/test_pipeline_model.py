"""PipelineModel on real gloo processes against the serial model (several schedules per spawn)."""

import pytest
import torch

from atorch.errors import MethodConfigError, NotSupportedError, WorldSizeError
from atorch.pipeline.loss import pick_loss, split_batch
from atorch.pipeline.partition import balanced_ranges, ranges_from_cuts
from atorch.pipeline.schedules import check_schedule
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed
from tests.pipeline.models import Block, batches, chain_loss, chain_model, pipeline_losses, serial_losses

# (schedule, virtual_pipeline_size, cuts); None cuts: auto_partition
TWO_RANK_RUNS = [
    ("1f1b", 1, ["2"]),
    ("gpipe", 1, None),
    ("zero_bubble", 1, None),
    ("interleaved", 2, ["1", "2", "4"]),
    ("zbv", 2, None),
]
# The torch class each run must step: every schedule here gives the serial losses, so the losses
# alone cannot tell which one ran (docs/dev/negative_controls.md).
SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "zero_bubble": "ScheduleInterleavedZeroBubble",
                    "interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}


def _two_rank_runs():
    from atorch.pipeline import PipelineModel

    out = {}
    for schedule, virtual, cuts in TWO_RANK_RUNS:
        model = PipelineModel(chain_model(), num_microbatches=4, virtual_pipeline_size=virtual, pipeline_cuts=cuts,
                              auto_partition=cuts is None, broadcast_and_average_loss=True, loss_fn=chain_loss,
                              schedule=schedule)
        out[(schedule, virtual)] = {"losses": pipeline_losses(model), "units": model.local_units,
                                    "numel": sum(p.numel() for p in model.local_parameters()),
                                    "schedule_class": type(model._schedule).__name__}
    # atorch.auto.clip_grad_norm over a pipelined model: the whole model's norm
    from atorch.auto import clip_grad_norm

    model = PipelineModel(chain_model(), num_microbatches=2, auto_partition=True, loss_fn=chain_loss)
    x, y = batches()[0]
    model.run_train(input=x, target=y)
    out["norm"] = clip_grad_norm(model, 1e9).item()
    # A model built on the meta device: each rank materializes only its stage.
    reference = chain_model().state_dict()
    meta = chain_model(device="meta")
    names = {id(m): n for n, m in meta.named_modules()}

    def init(unit):
        prefix = names[id(unit)] + "."
        unit.load_state_dict({k[len(prefix):]: v for k, v in reference.items() if k.startswith(prefix)})

    model = PipelineModel(meta, num_microbatches=2, auto_partition=True, transformer_layer_cls=Block,
                          param_init_fn=init, return_mb_loss=True, loss_fn=chain_loss)
    out["meta_units"] = model.local_units
    out["meta_still_meta"] = sorted({n.split(".")[0] for n, p in meta.named_parameters() if p.is_meta})
    x, y = batches()[0]
    out["mb_losses"] = model.run_train(input=x, target=y)
    out["eval"] = model.run_eval(input=x, target=y)
    with pytest.raises(WorldSizeError, match="multiple of num_microbatches"):
        model.run_train(input=x[:3], target=y[:3])
    with pytest.raises(MethodConfigError, match="'1f1b' with 1 microbatches"):
        PipelineModel(chain_model(), num_microbatches=1, auto_partition=True, loss_fn=chain_loss)
    # The bubble benchmark's measurement on toy sizes (its timings are not checked here).
    from benchmarks.pipeline_bubble import run

    out["bubble_rows"] = run([2], width=8, layers=4, micro=2, repeats=1, steps=1)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    # One spawn for every 2-rank check of this file: spawning costs more than the runs.
    return run_distributed(_two_rank_runs, 2)


def test_schedules_on_2_ranks_match_serial(two_ranks):
    reference = serial_losses()
    results = two_ranks
    for schedule, virtual, _ in TWO_RANK_RUNS:
        runs = [r[(schedule, virtual)] for r in results]
        assert runs[0]["losses"] == runs[1]["losses"]  # broadcast_and_average_loss: every rank has it
        assert [r["schedule_class"] for r in runs] == [SCHEDULE_CLASSES[schedule]] * 2, (schedule, virtual)
        assert_losses_close(runs[0]["losses"], reference, FP32_RTOL)
        # each rank holds only its own stages
        assert set(runs[0]["units"]).isdisjoint(runs[1]["units"])
        assert runs[0]["numel"] + runs[1]["numel"] == sum(p.numel() for p in chain_model().parameters())
    serial = chain_model()
    x, y = batches()[0]
    chain_loss({"target": y}, serial(x)).backward()
    serial_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9).item()
    assert results[0]["norm"] == pytest.approx(serial_norm, rel=1e-5) == results[1]["norm"]
    first, last = results
    assert first["meta_units"] == ["0", "1", "2"] and last["meta_units"] == ["3", "4", "5"]
    assert first["meta_still_meta"] == ["3", "4", "5"] and last["meta_still_meta"] == ["0", "1", "2"]
    # return_mb_loss: a list on the last stage, None elsewhere (no broadcast asked)
    assert first["mb_losses"] is None and len(last["mb_losses"]) == 2
    serial_first = serial_losses()[0]
    assert abs(sum(last["mb_losses"]).item() / 2 - serial_first) <= FP32_RTOL * serial_first
    assert [e.item() for e in last["eval"]] == pytest.approx([m.item() for m in last["mb_losses"]], rel=1e-6)


# PipelineModel on 4 ranks (interleaved, pipeline x data) shares the 4-process spawn of
# tests/methods/test_mixed_parallel.py: spawning 4 processes costs more than what they run.


def test_bubble_benchmark_reports_its_measurements(two_ranks, tmp_path):
    from argparse import Namespace

    from benchmarks.pipeline_bubble import report

    rows = two_ranks[0]["bubble_rows"]
    assert [r["microbatches"] for r in rows] == [2] and rows[0]["theory_1f1b"] == 1.5
    assert all(rows[0][k]["median"] > 0 for k in ("ideal", "1f1b", "interleaved"))
    args = Namespace(out=str(tmp_path / "bubble"), plot=str(tmp_path / "bubble.png"), nproc=2, width=8, layers=4,
                     micro=2, repeats=1, steps=1)
    markdown = report(rows, args)
    assert "| 2 |" in markdown and (tmp_path / "bubble.json").is_file() and (tmp_path / "bubble.png").is_file()


def test_cuts_are_checked():
    units = ["embed", "layers.0", "layers.1", "head"]
    assert ranges_from_cuts(units, ["layers.0"], 2) == [["embed", "layers.0"], ["layers.1", "head"]]
    with pytest.raises(MethodConfigError, match="make 2 stages but the pipeline has 4"):
        ranges_from_cuts(units, ["layers.0"], 4)
    with pytest.raises(MethodConfigError, match="'layers.7' is not a unit"):
        ranges_from_cuts(units, ["layers.7"], 2)
    with pytest.raises(MethodConfigError, match="in forward order"):
        ranges_from_cuts(units, ["layers.1", "layers.0"], 3)
    with pytest.raises(MethodConfigError, match="at least one module after"):
        ranges_from_cuts(units, ["head"], 2)


def test_auto_partition_balances_parameters_over_layers():
    model = chain_model(4)
    units = [n for n, _ in model.named_children()]
    # boundaries only before the blocks: the input layer stays with block 1, the head with block 4
    assert balanced_ranges(model, units, units[1:5], 2) == [["0", "1", "2"], ["3", "4", "5"]]
    with pytest.raises(WorldSizeError, match="has 4 layers"):
        balanced_ranges(model, units, units[1:5], 6)


def test_schedules_and_batches_are_checked():
    assert check_schedule("1f1b", 2) == "interleaved"
    with pytest.raises(MethodConfigError, match="unknown pipeline schedule 'pipedream'"):
        check_schedule("pipedream", 1)
    with pytest.raises(MethodConfigError, match="gpipe' runs one stage per rank"):
        check_schedule("gpipe", 2)
    with pytest.raises(MethodConfigError, match="exactly two stages per rank"):
        check_schedule("zbv", 3)
    with pytest.raises(WorldSizeError, match="batch size 6, which does not split into 4"):
        split_batch({"x": torch.zeros(6, 2)}, 4)
    assert [len(mb["x"]) for mb in split_batch({"x": torch.zeros(8, 2), "flag": True}, 4)] == [2] * 4
    assert pick_loss((torch.tensor(1.0), torch.tensor(2.0)), (False, True)).item() == 2.0
    with pytest.raises(MethodConfigError, match="exactly one item True"):
        pick_loss((torch.tensor(1.0),), (False,))


def test_missing_process_group_and_unsplittable_model_raise():
    from atorch.pipeline import PipelineModel

    with pytest.raises(WorldSizeError, match="needs a process group"):
        PipelineModel(chain_model())
    with pytest.raises(NotSupportedError, match="does not know how Linear's forward flows"):
        from atorch.pipeline.layouts import layout_for

        layout_for(torch.nn.Linear(2, 2))
