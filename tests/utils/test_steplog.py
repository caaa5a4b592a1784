"""StepLogger: the per-step line (loss over ranks and steps, samples/s, peak memory) and its writers."""

import pytest
import torch

from atorch.utils.steplog import StepLogger, TensorBoardWriter, format_metrics, peak_memory_bytes
from tests.helpers.dist import run_distributed


def test_lines_average_the_loss_over_the_steps_since_the_last_one():
    seen = []
    log = StepLogger(every=2, samples_per_step=8, writers=[lambda metrics, step: seen.append((step, metrics))])
    returned = [log.step(torch.tensor(float(v))) for v in (1, 2, 3, 4, 5)]
    assert returned[0] is None and returned[2] is None and returned[4] is None
    last = log.flush()
    assert log.flush() is None  # nothing since the last line
    assert [(step, m["loss"]) for step, m in seen] == [(2, 1.5), (4, 3.5), (5, 5.0)]
    assert last == seen[-1][1] and returned[3] == seen[1][1]
    assert all(m["samples_per_second"] > 0 and m["peak_memory_bytes"] > 0 for _, m in seen)
    assert "samples_per_second" not in StepLogger(every=1).step(1.0)
    resumed = []  # a run resumed at step 10 numbers its lines from there
    log = StepLogger(every=2, start=10, writers=[lambda metrics, step: resumed.append(step)])
    for _ in range(3):
        log.step(1.0)
    log.flush()
    assert resumed == [12, 13]


def test_the_line_says_step_loss_rate_and_peak():
    line = format_metrics(20, {"loss": 3.21044, "samples_per_second": 812.44, "peak_memory_bytes": 3 * 2**29})
    assert line == "step   20  loss 3.2104  812.4 samples/s  peak 1.5GiB"


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_bad_every_is_refused(every):
    with pytest.raises(ValueError, match="every must be a positive int"):
        StepLogger(every=every)


def test_tensorboard_writer_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(str(tmp_path))
    log = StepLogger(every=2, samples_per_step=4, writers=[writer])
    for v in (4.0, 2.0, 1.0, 1.0):
        log.step(v)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(2, 3.0), (4, 1.0)]
    assert {"train/samples_per_second", "train/peak_memory_bytes"} <= set(events.Tags()["scalars"])


def _two_ranks():
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:  # a larger peak on rank 1 only: a block larger than the peak so far (which a
        # forked worker may inherit from its parent), so the resident size must pass it
        block = torch.ones((peak_memory_bytes(torch.device("cpu")) + 64 * 2**20) // 4)
        del block
    own_peak = peak_memory_bytes(torch.device("cpu"))
    log = StepLogger(every=3)
    metrics = [log.step(torch.tensor(float(rank + step))) for step in range(3)]
    return {"metrics": metrics[-1], "own_peak": own_peak}


def test_two_ranks_log_the_mean_loss_and_the_largest_peak():
    results = run_distributed(_two_ranks, 2)
    # rank 0 saw 0, 1, 2 and rank 1 saw 1, 2, 3: one mean over both ranks and the three steps
    assert results[0]["metrics"] == results[1]["metrics"]
    assert results[0]["metrics"]["loss"] == pytest.approx(1.5)
    assert results[0]["metrics"]["peak_memory_bytes"] >= max(r["own_peak"] for r in results)
    assert results[1]["own_peak"] > results[0]["own_peak"]


def test_under_accumulation_lines_count_optimizer_steps():
    """gradient_accumulation_steps=2 over 8 micro-batches: 4 optimizer steps, lines at 2 and 4, each
    line's loss the mean of its 4 micro-batches (the user guide's loop)."""
    from atorch.auto import auto_accelerate

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    _, result, _ = auto_accelerate(torch.nn.Linear(4, 1), torch.optim.SGD, data,
                                   lambda batch, out: torch.nn.functional.mse_loss(out, batch[1]),
                                   optim_args={"lr": 0.0}, dataloader_args={"batch_size": 2},
                                   model_input_format="input_target", gradient_accumulation_steps=2)
    seen, losses = [], []
    log = StepLogger(every=2, samples_per_step=4, writers=[lambda metrics, step: seen.append((step, metrics))])
    for batch in result.dataloader:
        loss = result.loss_func(batch, result.model(batch[0]))
        result.backward(loss)
        result.step()
        losses.append(loss.item())
        log.step(loss, stepped=result.sync_gradients)
    assert [step for step, _ in seen] == [2, 4] and log.steps == 4
    for (_, metrics), part in zip(seen, (losses[:4], losses[4:])):
        assert abs(metrics["loss"] - sum(part) / 4) < 1e-6


def test_the_global_step_loss_brings_its_own_tokens_and_samples():
    from atorch.loss import StepLoss

    seen = []
    log = StepLogger(every=2, writers=[lambda metrics, step: seen.append(metrics)])
    assert log.step(StepLoss(2.0, 100, 8)) is None
    assert log.step(None, stepped=False) is None  # an accumulation micro-batch: no step
    metrics = log.step(StepLoss(4.0, 50, 8))
    assert metrics["loss"] == 3.0 and metrics["tokens"] == 150
    # both rates share one elapsed time; their ratio is exact up to rounding
    assert abs(metrics["tokens_per_second"] / metrics["samples_per_second"] - 150 / 16) < 1e-9
    # a step that counted nothing (skipped) adds no loss
    log.step(StepLoss(None, 0, 8))
    assert log.step(StepLoss(1.0, 10, 8))["loss"] == 1.0
    assert "tokens/s" in format_metrics(2, metrics)
