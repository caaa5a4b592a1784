"""dryrun_timeout bounds the whole candidate, its memory-estimate forward included.

Before, the timeout was checked only between dry-run steps: a forward slower than the timeout
on one rank ran its estimate, then a dry run of several such steps, before failing.
"""

import time

import torch
import torch.distributed as dist

from atorch.auto.config_types import MethodConfig
from atorch.auto.registry import MethodSpec, Stage, get_method, register_method
from atorch.auto.search.report import SearchReport
from tests.helpers.dist import run_distributed

TIMEOUT_S = 2.0


class SlowForwardConfig(MethodConfig):
    rank: int = 1
    seconds: float = 2 * TIMEOUT_S


def _slow_forward(ctx, config):
    rank = dist.get_rank()

    def hook(module, args):
        if rank == config.rank:
            time.sleep(config.seconds)

    ctx.model.register_forward_pre_hook(hook)


def _search(report_file: str):
    from atorch.auto import auto_accelerate
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    try:
        get_method("_slow_forward")
    except ValueError:
        register_method(MethodSpec("_slow_forward", SlowForwardConfig, {Stage.REWRITE: _slow_forward},
                                   "its forward sleeps on one rank", search_space=({"rank": 1},)))
    torch.manual_seed(0)
    # Only plain DDP, with and without the slow method: two candidates.
    excluded = ["amp_native", "module_replace", "checkpoint", "zero1", "zero2", "fsdp", "pipeline_parallel",
                "tensor_parallel"]
    status, _, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=report_file,
        excluded=excluded, dryrun_warmup_steps=1, dryrun_steps=2, dryrun_timeout=TIMEOUT_S, use_search_cache=False,
    )
    return status, None if strategy is None else strategy.opt_names


def test_a_forward_slower_than_the_timeout_fails_at_its_estimate(tmp_path):
    path = str(tmp_path / "report.json")
    results = run_distributed(_search, 2, path, timeout_s=120)
    assert results[0] == results[1] == (True, ["parallel_mode"])
    report = SearchReport.load(path)
    slow = [c for c in report.candidates if "_slow_forward" in c.names]
    assert len(slow) == 1 and slow[0].status == "failed", report.table()
    assert "memory-estimate forward took" in slow[0].reason and "dryrun_timeout=2s" in slow[0].reason, slow[0].reason
    # One slow forward, not a dry run of several: the candidate cost about the sleep, no more.
    assert 2 * TIMEOUT_S <= slow[0].seconds < 2 * TIMEOUT_S + 3, slow[0].seconds
    assert any(c.status == "measured" for c in report.candidates)
