"""What a job on one GPU does with the sharding methods, and the fully automatic search there."""

import math

import pytest

from atorch.auto.search.report import SearchReport
from tests.cuda.job import assert_tracks, small_llama, train
from tests.helpers.gpu import requires_gpu

pytest.importorskip("transformers")


@requires_gpu()
@pytest.mark.parametrize("method", ["fsdp", "zero1", "zero2"])
def test_sharding_on_one_rank_is_dropped_with_its_reason_and_the_rest_trains(method):
    """FSDP and ZeRO need more than one process: on one GPU atorch drops them and says so (the
    lent machines have one GPU, so the sharded paths themselves run on 2 gloo ranks in tests/)."""
    reference = train([("amp_native", "bf16")])
    run = train([("amp_native", "bf16"), method])
    assert run["strategy"] == ["amp_native"]
    assert any(note.startswith(f"{method}: dropped") and "more than one process" in note for note in run["notes"])
    assert_tracks(run["losses"], reference["losses"], 1e-3)


@requires_gpu()
def test_search_on_one_gpu_measures_candidates_and_its_pick_trains(tmp_path):
    import torch

    import atorch
    from atorch.auto import auto_accelerate
    from tests.cuda.job import Counting

    path = tmp_path / "report.json"
    status, result, strategy = auto_accelerate(
        small_llama(), torch.optim.AdamW, Counting(), lambda b, out: out.loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=str(path),
        dryrun_warmup_steps=1, dryrun_steps=2, use_search_cache=False)
    assert status
    report = SearchReport.load(str(path))
    measured = [c for c in report.candidates if c.status == "measured"]
    assert len(measured) >= 2 and all(c.throughput > 0 and c.measured_peak_bytes > 0 for c in measured)
    assert report.candidates[report.winner].names == strategy.opt_names
    losses, batches = [], iter(result.dataloader)
    for _ in range(6):
        data = result.prepare_input(next(batches), atorch.device())
        loss = result.loss_func(data, result.model(**data))
        result.backward(loss)
        result.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
