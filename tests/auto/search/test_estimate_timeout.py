"""dryrun_timeout bounds the whole candidate, its memory-estimate forward included.

Before, the timeout was checked only between dry-run steps: a forward slower than the timeout
ran its estimate, then a dry run of several such steps, before failing. The ranks share the
probes out (atorch/auto/search/share.py): the probe's seconds on the rank that ran it count.
"""

import time

from atorch.auto.config_types import MethodConfig
from atorch.auto.search.report import SearchReport
from tests.auto.search.one_method import search_with
from tests.helpers.dist import run_distributed

TIMEOUT_S = 2.0


class SlowForwardConfig(MethodConfig):
    rank: int = 1  # search_with's search space sets it; the forward sleeps on every rank
    seconds: float = 2 * TIMEOUT_S


def _slow_forward(ctx, config):
    def hook(module, args):
        time.sleep(config.seconds)

    ctx.model.register_forward_pre_hook(hook)


def _search(report_file: str):
    return search_with("_slow_forward", SlowForwardConfig, _slow_forward, "its forward sleeps",
                       report_file, TIMEOUT_S)


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
