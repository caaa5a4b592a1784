"""A pipeline candidate whose loss fails on the last stage's rank only, dry-run on 2 gloo ranks
(issue 38: rank 1 went to the agreement while rank 0 waited in the schedule's receive, both for over
15 minutes). The failing rank closes the candidate's groups, so rank 0 leaves its receive at once:
the candidate is recorded as failed with rank 1's error in seconds, far inside ``dryrun_timeout``."""

import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed

DRYRUN_TIMEOUT_S = 120.0


def _loss_fails_on_rank_1(batch, output):
    from tests.pipeline.models import BATCH, chain_loss

    if dist.get_rank() == 1 and output.shape[0] < BATCH:  # a microbatch on the last stage, not the probe
        raise RuntimeError("the loss broke on rank 1")
    return chain_loss(batch, output)


def _measure() -> list:
    from atorch.auto.search import measure
    from tests.pipeline.models import BATCH, ChainData, chain_model

    pipeline = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_microbatches": 2})]
    report = measure(chain_model(), [pipeline], torch.optim.SGD, ChainData(), _loss_fails_on_rank_1,
                     optim_args={"lr": 0.1}, dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict",
                     dryrun_timeout=DRYRUN_TIMEOUT_S, warmup_steps=1, timed_steps=1)
    return [(c.status, c.reason, c.seconds) for c in report.candidates]


def test_a_pipeline_candidate_failing_on_one_rank_fails_within_seconds():
    for rank, candidates in enumerate(run_distributed(_measure, 2, timeout_s=90)):
        (status, reason, seconds), = candidates
        assert status == "failed", (rank, candidates)
        assert reason.startswith("rank 1: ") and "the loss broke on rank 1" in reason, (rank, reason)
        assert seconds < 20.0 < DRYRUN_TIMEOUT_S, (rank, seconds)
