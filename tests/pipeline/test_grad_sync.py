"""The data ranks' gradient sum of a pipeline (atorch/pipeline/grad_sync.py) on pipeline 2 x data 2
gloo ranks: started inside the schedule, bucket by bucket, under every schedule, and still the
serial model's step."""

import pytest
import torch

from atorch.pipeline.grad_sync import bucket_layout, packed_bytes
from tests.helpers.compare import FP32_RTOL, assert_losses_close
from tests.helpers.dist import run_distributed
from tests.pipeline.models import batches, chain_loss, chain_model, serial_losses

LAYERS = 6
# (schedule, virtual stages, bucket bytes): 256 bytes sums each 16 x 16 weight (1 KiB) alone and
# packs the biases; the default packs a stage's whole gradient into one bucket
RUNS = [("1f1b", 1, 256), ("1f1b", 1, None), ("gpipe", 1, 256), ("zero_bubble", 1, 256),
        ("interleaved", 2, 256), ("zbv", 2, 256)]
TIED_CUTS = ["model.embed_tokens", "model.layers.0", "model.layers.1"]


def _run(schedule: str, virtual: int, bucket_bytes: int | None, topology) -> dict:
    from atorch.pipeline import PipelineModel
    from tests.helpers.comms import Collectives

    model = PipelineModel(chain_model(LAYERS), num_microbatches=4, virtual_pipeline_size=virtual,
                          auto_partition=True, broadcast_and_average_loss=True, loss_fn=chain_loss,
                          schedule=schedule, topology=topology)
    if bucket_bytes is not None:
        model.grad_bucket_bytes = bucket_bytes
    optim = torch.optim.SGD(model.local_parameters(), lr=0.1)
    share = slice(topology.data_parallel_rank * 4, topology.data_parallel_rank * 4 + 4)
    losses, seen = [], None
    for step, (x, y) in enumerate(batches()):
        if step == 2:
            with Collectives() as seen:
                losses.append(model.run_train(input=x[share], target=y[share]).item())
        else:
            losses.append(model.run_train(input=x[share], target=y[share]).item())
        optim.step()
        optim.zero_grad()
    sync = model._grad_sync[1]
    buckets = [b.params for stage in sync.order for b in sync.buckets[stage]]
    return {"losses": losses, "data": seen.by_dim(topology).get("data", {}), "buckets": len(buckets),
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.local_parameters()),
            "early": sync.early, "hooked": sync.hooked}


def _four_ranks() -> dict:
    from atorch.distributed.topology import Topology
    from tests.pipeline.test_tied_on_one_rank import tied_llama_steps

    topology = Topology.build([("pipeline", 2), ("data", 2)])
    out = {run: _run(*run, topology) for run in RUNS}
    from tests.loss import jobs

    torch.manual_seed(0)
    out["padded"] = jobs.train([("parallel_mode", {"dims": [("pipeline", 2), ("data", 2)]}),
                                ("pipeline_parallel", {"num_microbatches": 2})], mask=True)
    from benchmarks.pipeline_grad_sync import run  # the benchmark's measurement on toy sizes

    out["bench"] = run([8], layers=4, micro=2, m=2, pipeline=2, data=2, repeats=1, steps=1)
    out["tied"] = tied_llama_steps([("parallel_mode", ([("pipeline", 2), ("data", 2)], None)),
                                    ("pipeline_parallel", {"num_microbatches": 2, "schedule": "zbv",
                                                           "virtual_pipeline_size": 2, "pipeline_cuts": TIED_CUTS})])
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_four_ranks, 4, timeout_s=400)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-v{r[1]}-{r[2] or 'default'}")
def test_every_schedule_sums_over_the_data_ranks_as_serial(four_ranks, run):
    reference = serial_losses(LAYERS)
    for rank in four_ranks:
        assert_losses_close(rank[run]["losses"], reference, FP32_RTOL)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-v{r[1]}-{r[2] or 'default'}")
def test_every_bucket_starts_inside_the_schedule_one_collective_each(four_ranks, run):
    """A step's all-reduces over the data ranks: one a bucket, plus the step's loss totals (3
    float64); every bucket started before the schedule returned; under a full backward (not
    zero-bubble's split one) backward's hooks start some while it runs."""
    for rank in four_ranks:
        got = rank[run]
        calls, payload = got["data"]["all_reduce"]
        assert calls == got["buckets"] + 1, got
        assert payload == got["grad_bytes"] + 24, got
        assert got["early"] == got["buckets"], got
        if run[0] in ("1f1b", "gpipe", "interleaved") and run[2] == 256:
            assert got["hooked"] > 0, got
        if run[2] is None:  # the default packs each of the rank's stages into one bucket
            assert got["buckets"] == 1, got


def test_small_gradients_are_packed_and_large_ones_summed_alone():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 300, 4, 4, 300)]  # fp32: 16 and 1200 bytes
    buckets = bucket_layout(params, bucket_bytes=1024)
    # backward reaches the last first; the small ones are all final with the first parameter's
    assert [[p.numel() for p in b] for b in buckets] == [[300], [300], [4, 4, 4]]
    assert packed_bytes(buckets) == 48
    assert [[p.numel() for p in b] for b in bucket_layout(params, bucket_bytes=20)] == [[300], [4], [4], [300], [4]]
    # each dtype packs apart; a bucket is placed where its last member becomes final
    mixed = [torch.nn.Parameter(torch.zeros(4, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16)] * 2
    assert [[p.dtype for p in b] for b in bucket_layout(mixed, 1024)] == [[torch.bfloat16] * 2, [torch.float32] * 2]


def test_a_tie_held_twice_on_a_rank_is_summed_once_after_the_schedule(four_ranks):
    """zbv over pipeline 2 x data 2: rank 0 holds the tied embedding and head in two stages; the
    tie's gradient waits for both (summed after the schedule), and the run is the serial one."""
    from tests.pipeline.test_tied_on_one_rank import tied_llama_steps

    serial = run_distributed(tied_llama_steps, 1, [])[0]
    for rank in four_ranks:
        assert rank["tied"]["listed_once"]
        assert rank["tied"]["losses"] == pytest.approx(serial["losses"], rel=1e-5)


def test_the_benchmark_times_both_sums(four_ranks):
    (row,) = four_ranks[0]["bench"]
    assert row["after"]["median"] > 0 and row["inside"]["median"] > 0 and row["inside_over_after"] > 0


@pytest.mark.parametrize("run", [r for r in RUNS if r[2] is None], ids=lambda r: f"{r[0]}-v{r[1]}")
def test_the_cost_charges_the_collectives_the_sum_makes(four_ranks, run):
    """The cost model's data-parallel sync of the same pipeline: the busiest rank's collectives
    and bytes, as counted (less the step's loss totals, charged apart)."""
    from atorch.auto.plan import resolve_strategy
    from atorch.auto.search.cost import build_cost
    from atorch.auto.strategy import Strategy

    model = chain_model(LAYERS)
    strategy = resolve_strategy(model, Strategy([
        ("parallel_mode", ([("pipeline", 2), ("data", 2)], None)),
        ("pipeline_parallel", {"num_microbatches": 4, "schedule": run[0], "virtual_pipeline_size": run[1]})]))
    cost = build_cost(model, strategy, {"pipeline": 2, "data": 2}, 2.0, 0, 1e6, 4)
    (kind, payload, calls), = cost.data_sync_collectives()
    counted = max((rank[run]["data"]["all_reduce"] for rank in four_ranks), key=lambda c: c[1])
    assert (kind, calls) == ("all_reduce", counted[0] - 1)
    assert payload == pytest.approx(counted[1] - 24, rel=0.01)


def test_right_padded_batches_train_as_the_whole_batch(four_ranks):
    """A tiny Llama on right-padded batches (2 to 16 label tokens a sequence), pipeline 2 x data 2,
    3 SGD steps: every step's loss is the whole global batch's token mean, as the serial run's
    (tests/loss/test_exact.py's bound)."""
    from tests.loss import jobs
    from tests.loss.test_exact import LOSS_RTOL, gaps

    reference = jobs.serial(mask=True)
    for rank in four_ranks:
        loss_gap, _ = gaps(rank["padded"], reference)
        assert loss_gap <= LOSS_RTOL, loss_gap
