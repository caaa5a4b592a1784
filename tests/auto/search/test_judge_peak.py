"""A dry run's peak decides whether its candidate can win (engine._judge). An unmeasured peak
(the time limit cut the run before its tracked step, or the tracker failed) is trusted to fit an
explicit budget only if the estimate fits it even at the lowest estimated / measured ratio ever
seen (cost.ESTIMATE_FLOOR: 0.35 on checkpointed candidates), never at the usual 0.8."""

from atorch.auto.search import cost
from atorch.auto.search.dryruns import judge as _judge
from atorch.auto.search.engine import SearchOptions
from atorch.auto.search.report import FAILED, MEASURED, CandidateResult

BUDGET = 1000


def _judge_peak(peak, estimate, options) -> tuple:
    """(status, reason) of a dry-run candidate with this measured peak and estimate."""
    result = CandidateResult({"methods": []}, estimated_peak_bytes=estimate, measured_peak_bytes=peak)
    _judge(result, options)
    return result.status, result.reason


def test_a_measured_peak_decides():
    options = SearchOptions(memory_budget=BUDGET)
    assert _judge_peak(900, 10, options)[0] == MEASURED
    status, why = _judge_peak(1100, 10, options)
    assert status == FAILED and "over the memory budget" in why


def test_an_unmeasured_peak_needs_an_estimate_far_under_the_budget():
    options = SearchOptions(memory_budget=BUDGET)
    # 0.7 of the budget would do at the usual 0.8 bound, not at the floor: checkpointed estimates
    # have measured at 0.35 of the peak
    assert cost.surely_fits(700, BUDGET)
    status, why = _judge_peak(None, 700, options)
    assert status == FAILED and "peak memory not measured" in why
    assert _judge_peak(None, int(BUDGET * cost.ESTIMATE_FLOOR), options)[0] == MEASURED
    assert _judge_peak(None, None, options)[0] == FAILED


def test_without_a_budget_a_run_that_ran_fits_the_device():
    options = SearchOptions(memory_budget=BUDGET, budget_is_device_memory=True)
    assert _judge_peak(None, None, options)[0] == MEASURED
