"""A step that fails on one stage raises on every stage within moments, not at the process groups'
timeout (30 minutes for the default group's, 300 s here), and the next call raises at once: the
failing rank records why in the store and closes its groups, so a peer blocked in a receive from it
raises "connection closed" and reports the first rank's error (atorch/pipeline/failure.py)."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.dist import run_distributed


class _Fails(nn.Module):
    """Raises on rank ``armed`` (None: never)."""

    armed: int | None = None

    def forward(self, x):
        if _Fails.armed == dist.get_rank():
            raise RuntimeError(f"a data loader handed rank {dist.get_rank()} a broken batch")
        return x


def _calls(model, failing_rank: int) -> list:
    """Three steps: the first runs; then ``failing_rank``'s stage raises."""
    from atorch.pipeline.failure import PipelineStepError

    seen = []
    for step in range(3):
        start = time.monotonic()
        try:
            model.run_train(input=torch.randn(4, 4))
            seen.append(("ran", time.monotonic() - start, ""))
        except PipelineStepError as error:
            seen.append(("PipelineStepError", time.monotonic() - start, str(error)))
        except Exception as error:  # noqa: BLE001 - anything else is what the test reports
            seen.append((type(error).__name__, time.monotonic() - start, str(error)))
        _Fails.armed = failing_rank
    return seen


def _failing_stage(stage: int, timeout: float | None) -> list:
    from atorch.distributed.topology import Topology, collective_timeout
    from atorch.pipeline import PipelineModel

    # timeout None: the pipeline spans the world over the default group (30 minutes), so the model
    # runs on a group of its own; else the dim's group has this timeout
    with collective_timeout(timeout):
        topology = Topology.build([("pipeline", 2)])
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 1)]
    layers.insert(0 if stage == 0 else 2, _Fails())
    model = PipelineModel(nn.Sequential(*layers), pipeline_cuts=["1" if stage == 0 else "0"], num_microbatches=2,
                          loss_fn=lambda batch, out: out.pow(2).mean(), topology=topology)
    _Fails.armed = None
    return _calls(model, stage)  # rank = stage on a 2-rank pipeline


def _both_cases() -> dict:
    out = {"first stage fails, default group": _failing_stage(0, None),
           "last stage fails, 300 s group": _failing_stage(1, 300.0)}
    dist.barrier()  # the default group still works after both failures
    return out


def _assert_every_rank_raises_at_once(results: list) -> None:
    for rank, cases in enumerate(results):
        for case, seen in cases.items():
            failing = 0 if case.startswith("first") else 1
            (ran, _, _), (first, seconds, message), (second, again, repeated) = seen
            assert ran == "ran", (rank, case, seen)
            assert first == "PipelineStepError" and seconds < 10.0, (rank, case, seen)
            assert f"a data loader handed rank {failing} a broken batch" in message, (rank, case, message)
            assert ("failed on rank" if rank == failing else "because another rank failed") in message, message
            assert "restart the job" in message
            assert second == "PipelineStepError" and again < 1.0 and "previous step" in repeated, (rank, case, seen)


@pytest.mark.timeout(120)
def test_a_stage_failing_stops_every_stage_at_once_and_the_next_call_raises():
    _assert_every_rank_raises_at_once(run_distributed(_both_cases, 2, timeout_s=90))
