"""The search's twin rules (prune.prune_twins): a candidate is pruned when the same strategy less
one of its methods surely fits the budget and that method cannot pay for itself, because it only
saves memory, or because the cost model says it slows the step (bf16 autocast on a CPU)."""

from atorch.auto.search.candidate import MEMORY_ONLY, SLOWER
from atorch.auto.search.prune import SLOWER_MARGIN
from atorch.auto.search.prune import prune_twins as _prune_twins
from atorch.auto.search.report import CandidateResult
from atorch.auto.strategy import Strategy

AMP = ("amp_native", "bf16")


def _candidates(**seconds):
    """(strategy, result) pairs named plain, amp, checkpoint, with the given estimated seconds."""
    methods = {"plain": ["parallel_mode"], "amp": ["parallel_mode", AMP], "zero1": ["parallel_mode", "zero1"],
               "checkpoint": ["parallel_mode", "checkpoint"], "pipeline": ["parallel_mode", "pipeline_parallel"]}
    out = {}
    for name, step in seconds.items():
        strategy = Strategy(methods[name])
        out[name] = (strategy, CandidateResult(strategy.to_dict(), estimated_peak_bytes=1,
                                               estimated_step_seconds=step))
    return out


def test_a_method_estimated_to_slow_the_step_is_pruned_when_its_twin_fits():
    c = _candidates(plain=1.0, amp=1.4)
    _prune_twins(list(c.values()), fits={id(c["plain"][0])})
    assert c["amp"][1].pruned_by == SLOWER
    assert "amp_native is estimated to make the step 1.40x slower" in c["amp"][1].reason
    assert c["plain"][1].reason is None


def test_a_method_estimated_to_speed_the_step_up_stays():
    c = _candidates(plain=1.0, amp=0.6)
    _prune_twins(list(c.values()), fits={id(c["plain"][0])})
    assert c["amp"][1].reason is None


def test_an_estimate_within_the_tie_margin_prunes_nothing():
    """A method with no time term of its own differs from its twin only by how each probe counted
    FLOPs: it must be measured, not guessed slower."""
    for step in (1.0, SLOWER_MARGIN - 0.001):
        c = _candidates(plain=1.0, amp=step)
        _prune_twins(list(c.values()), fits={id(c["plain"][0])})
        assert c["amp"][1].reason is None


def test_a_layout_method_is_never_pruned_as_slower():
    """Splitting the model is judged across layouts (dominance, dry runs), not against its twin."""
    c = _candidates(plain=1.0, pipeline=1.5)
    _prune_twins(list(c.values()), fits={id(c["plain"][0])})
    assert c["pipeline"][1].reason is None


def test_a_candidate_whose_twin_is_not_in_the_space_stays():
    c = _candidates(amp=1.4)
    _prune_twins(list(c.values()), fits=set())
    assert c["amp"][1].reason is None


def test_a_twin_that_may_not_fit_prunes_nothing():
    """Near the boundary the slower method may be what makes the candidate fit: it is dry-run."""
    c = _candidates(plain=1.0, amp=1.4, checkpoint=1.2)
    _prune_twins(list(c.values()), fits=set())
    assert all(result.reason is None for _, result in c.values())


def test_a_memory_only_method_is_pruned_whatever_its_estimate():
    c = _candidates(plain=1.0, checkpoint=0.9)
    _prune_twins(list(c.values()), fits={id(c["plain"][0])})
    assert c["checkpoint"][1].pruned_by == MEMORY_ONLY


def test_a_candidate_without_an_estimate_is_not_pruned_as_slower():
    c = _candidates(plain=1.0, amp=None)
    _prune_twins(list(c.values()), fits={id(c["plain"][0])})
    assert c["amp"][1].reason is None


def test_a_twin_measured_to_fit_prunes_a_candidate_that_has_not_run():
    """Before each dry run the rules apply again, with the twins whose dry run measured a fit:
    near the boundary the estimate could not prove it, the measurement does."""
    c = _candidates(plain=1.0, amp=1.4, checkpoint=1.2)
    results = list(c.values())
    _prune_twins(results, fits=set())  # plain near the boundary: nothing pruned before it runs
    assert all(result.reason is None for _, result in results)
    measured = {id(c["plain"][0])}  # plain's dry run measured a peak within the budget
    _prune_twins(results, measured, pending={id(c["checkpoint"][1])})
    assert c["checkpoint"][1].pruned_by == MEMORY_ONLY
    assert c["amp"][1].reason is None  # not pending: already run, or decided at its own turn
    _prune_twins(results, measured, pending={id(c["amp"][1])})
    assert c["amp"][1].pruned_by == SLOWER
    assert c["plain"][1].reason is None


def test_a_method_estimated_slower_within_the_estimates_error_is_measured():
    """zero1 on search_quality's BERT was estimated 1.16x slower than plain DDP and ran 8% faster
    side by side: a gap the estimate's error between candidates (the early stop's slack) covers is
    not a reason to skip the dry run."""
    c = _candidates(plain=1.0, amp=1.16)
    _prune_twins(list(c.values()), fits={id(c["plain"][0])})
    assert c["amp"][1].reason is None
    assert SLOWER_MARGIN >= 1.2


def test_without_a_calibration_only_a_method_whose_deciding_rate_was_measured_is_pruned_as_slower():
    """Without a calibration the search measures bf16's speedup (speedup.py), not the collectives:
    amp estimated slower on the measured speedup is pruned; zero1 estimated slower on nominal
    collective rates is left to its dry run. With a calibration (every rate measured) both go."""
    for measured, zero1_pruned in ((frozenset({"half"}), False), (None, True)):
        c = _candidates(plain=1.0, amp=1.4, zero1=1.4)
        _prune_twins(list(c.values()), fits={id(c["plain"][0])}, measured=measured)
        assert c["amp"][1].pruned_by == SLOWER
        assert (c["zero1"][1].pruned_by == SLOWER) is zero1_pruned
