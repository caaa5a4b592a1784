"""A candidate whose forward raises on one rank only, in a dry run on 2 gloo processes.

The failing rank reaches the agreement while its peer is still inside DDP's all-reduce, waiting
for it. Before, both used the default group: gloo matched the agreement against the all-reduce
and aborted the job ("Received data size doesn't match expected size", SIGABRT). Now the
agreements have a group of their own and the candidate's groups time out after dryrun_timeout:
the failure is recorded with the failing rank's message and the search goes on.
"""

import torch.distributed as dist

from atorch.auto.config_types import MethodConfig
from atorch.auto.search.report import SearchReport
from tests.auto.search.one_method import search_with
from tests.helpers.dist import run_distributed

TIMEOUT_S = 3.0


class ForwardFailsConfig(MethodConfig):
    rank: int = 1


def _fail_in_forward(ctx, config):
    rank = dist.get_rank()

    def hook(module, args):
        if rank == config.rank:
            raise RuntimeError(f"forward broke on rank {rank}")

    ctx.model.register_forward_pre_hook(hook)


def _search(report_file: str):
    return search_with("_forward_fails", ForwardFailsConfig, _fail_in_forward, "its forward raises on one rank",
                       report_file, TIMEOUT_S)


def test_a_forward_failing_on_one_rank_is_recorded_and_the_search_goes_on(tmp_path):
    path = str(tmp_path / "report.json")
    results = run_distributed(_search, 2, path, timeout_s=120)
    assert results[0] == results[1] == (True, ["parallel_mode"])
    report = SearchReport.load(path)
    failed = [c for c in report.candidates if c.status == "failed"]
    assert len(failed) == 1 and "_forward_fails" in failed[0].names, report.table()
    assert failed[0].reason == "rank 1: RuntimeError: forward broke on rank 1", failed[0].reason
    # Rank 0 waited in DDP's all-reduce until the candidate's timeout, not the job's (30 minutes).
    assert failed[0].seconds < TIMEOUT_S + 10, failed[0].seconds
    assert any(c.status == "measured" for c in report.candidates)
