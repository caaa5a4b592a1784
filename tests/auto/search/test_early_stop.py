"""Early stop: once the dry runs have measured the estimate's error on this job, a candidate whose
estimate, even at the lowest measured / estimated ratio seen (less a slack), is slower than the
best measured step is not dry-run, and the report says why (atorch/auto/search/stop.py)."""

import pytest

from atorch.auto.search import stop
from atorch.auto.search.report import SearchReport
from tests.helpers.dist import run_distributed


def test_a_candidate_that_cannot_beat_the_best_measured_step_is_named_with_its_bound():
    readings = [(0.02, 0.03), (0.025, 0.04)]  # measured / estimated: 1.5 and 1.6
    why = stop.cannot_win(0.05, readings, 0.03)  # at least 0.05 x 1.5 x 0.8 = 60 ms > 30 ms
    assert why is not None and "60.0 ms" in why and "30.0 ms" in why
    assert stop.cannot_win(0.024, readings, 0.03) is None  # 28.8 ms: it may win
    assert stop.cannot_win(0.05, readings[:1], 0.03) is None  # one reading: the error is not known yet
    assert stop.cannot_win(0.05, readings, None) is None  # nothing measured fits: no best to beat


def _search_with_a_slow_method(report_file: str):
    """plain and zero1, each with and without ``_slow_estimate`` (a method that changes nothing
    and is estimated 20x slower); the twin and dominance rules, which would prune it first, are
    off, so only the early stop can keep it from a dry run."""
    import torch

    from atorch.auto import auto_accelerate
    from atorch.auto.config_types import MethodConfig
    from atorch.auto.registry import MethodSpec, Stage, all_methods, get_method, register_method
    from atorch.auto.search import dryruns, prune
    from tests.auto.search.one_method import OTHERS
    from tests.helpers.models import TinyTransformer, TokenDataset, lm_loss

    class SlowConfig(MethodConfig):
        pass

    def cost_term(config, cost):
        cost.passes *= 20

    try:
        get_method("_slow_estimate")
    except ValueError:
        register_method(MethodSpec("_slow_estimate", SlowConfig, {Stage.REWRITE: lambda ctx, config: None},
                                   "estimated slow, changes nothing", search_space=({},), cost_term=cost_term))
    prune.prune_twins = prune.prune_dominated = dryruns.prune_twins = lambda *args, **kwargs: None
    torch.manual_seed(0)
    status, _, strategy = auto_accelerate(
        TinyTransformer(), torch.optim.AdamW, TokenDataset(), lm_loss, optim_args={"lr": 1e-2},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_file=report_file,
        excluded=sorted({*OTHERS, *(m.name for m in all_methods() if m.search_space)} - {"zero1", "_slow_estimate"}),
        dryrun_warmup_steps=1, dryrun_steps=2,
        use_search_cache=False,
    )
    return status, strategy.opt_names


def test_the_search_stops_when_no_candidate_left_can_win(tmp_path):
    path = str(tmp_path / "report.json")
    results = run_distributed(_search_with_a_slow_method, 2, path)
    assert results[0] == results[1] and results[0][0]
    assert "_slow_estimate" not in results[0][1]
    report = SearchReport.load(path)
    slow = [c for c in report.candidates if "_slow_estimate" in c.names]
    assert len(slow) == 2 and all(c.pruned_by == stop.CANNOT_WIN for c in slow), [c.reason for c in slow]
    assert all(c.reason.startswith("cannot win") for c in slow)
    assert report.dry_run == 2
    assert report.stopped is not None and "2 candidates left" in report.stopped
    assert "stopped early after 2 dry runs" in report.table()


@pytest.mark.parametrize("slack", [stop.STOP_SLACK])
def test_the_slack_keeps_candidates_near_the_bound(slack):
    # estimated 1.2x the best's estimate, with the best's own ratio: within the slack, it is run
    readings = [(0.02, 0.03), (0.02, 0.03)]
    assert stop.cannot_win(0.02 * 1.2, readings, 0.03) is None
    assert stop.cannot_win(0.02 / slack * 1.01, readings, 0.03) is not None


def test_a_candidate_that_cannot_fit_the_budget_is_named_with_its_bound():
    """The memory side: once two dry runs measured their peaks, a candidate whose estimated peak, at
    the lowest measured / estimated seen less PEAK_SLACK, is over the budget is not dry-run (on
    search_quality's boundary scenario 8 such runs took every slot and the one that fits never ran)."""
    mib = 2**20
    readings = [(6 * mib, int(6.3 * mib)), (5 * mib, int(5.4 * mib))]  # 1.05 and 1.08
    why = stop.cannot_fit(6 * mib, readings, int(5.37 * mib))  # at least 6 x 1.05 x 0.9 = 5.67 MiB
    assert why is not None and "5.67 MiB" in why and "5.37 MiB" in why
    assert stop.cannot_fit(int(4.93 * mib), readings, int(5.37 * mib)) is None  # the one that fits: run it
    assert stop.cannot_fit(int(5.5 * mib), readings, int(5.37 * mib)) is None  # within the slack: run it
    assert stop.cannot_fit(6 * mib, readings[:1], int(5.37 * mib)) is None  # one reading says little
