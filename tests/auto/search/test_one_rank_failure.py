"""A candidate whose forward raises on one rank only, in a dry run on 2 gloo processes.

The failing rank reaches the agreement while its peer is still inside DDP's all-reduce, waiting
for it. Before, both used the default group: gloo matched the agreement against the all-reduce
and aborted the job ("Received data size doesn't match expected size", SIGABRT). Now the
agreements have a group of their own and the candidate's groups time out after dryrun_timeout:
the failure is recorded with the failing rank's message and the search goes on.
"""

import torch
import torch.distributed as dist

from atorch.auto.config_types import MethodConfig
from atorch.auto.registry import MethodSpec, Stage, get_method, register_method
from atorch.auto.search.report import SearchReport
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
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    try:
        get_method("_forward_fails")
    except ValueError:
        register_method(MethodSpec("_forward_fails", ForwardFailsConfig, {Stage.REWRITE: _fail_in_forward},
                                   "its forward raises on one rank", search_space=({"rank": 1},)))
    torch.manual_seed(0)
    # Only plain DDP, with and without the failing method: two dry runs.
    excluded = ["amp_native", "module_replace", "checkpoint", "zero1", "zero2", "fsdp", "pipeline_parallel",
                "tensor_parallel"]
    status, _, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=report_file,
        excluded=excluded, dryrun_warmup_steps=1, dryrun_steps=2, dryrun_timeout=TIMEOUT_S, use_search_cache=False,
    )
    return status, None if strategy is None else strategy.opt_names


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
