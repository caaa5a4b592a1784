"""The search's readings and its tie rule: each candidate's throughput is its median timed step's
(one slow step moves the range, not the pick), and candidates whose step ranges overlap the
best's with medians within TIE_CAP are tied, the tie going to fewer methods among those
estimated within TIE_ESTIMATE of the fastest estimate, then the faster estimate, so that noisy
readings give the same pick run after run."""

from atorch.auto.search.dryruns import record as _record
from atorch.auto.search.pick import TIE_CAP, TIE_ESTIMATE
from atorch.auto.search.pick import pick_winner as _pick_winner
from atorch.auto.search.pick import tied_with as _tied
from atorch.auto.search.report import MEASURED, CandidateResult, SearchReport

BATCH = 16


def _candidate(steps: list[float], methods: int, estimate: float | None = None):
    result = CandidateResult(strategy={"methods": [{"name": f"m{i}", "config": {}} for i in range(methods)]},
                             status=MEASURED, estimated_step_seconds=estimate)
    _record(result, {"throughput": 0.0, "step_seconds": steps}, BATCH)
    return (tuple(range(methods)), result)


def test_the_median_step_decides_and_one_slow_step_only_widens_the_range():
    _, result = _candidate([0.1, 0.1, 0.9], 1)  # a collector pause in the last step
    assert result.throughput == BATCH / 0.1 and result.throughput_range == [BATCH / 0.9, BATCH / 0.1]
    _record(result, {"throughput": 0.0, "step_seconds": [0.1, 0.12, 0.11]}, BATCH)  # timed again
    assert len(result.step_seconds) == 6 and abs(result.throughput - BATCH / 0.105) < 1e-9


def test_overlapping_ranges_tie_and_the_simpler_candidate_wins_every_time():
    # Two readings of the same pair, the order of the medians flipped by noise: the same pick.
    for plain_steps, zero_steps in (([0.10, 0.11, 0.12], [0.095, 0.10, 0.115]),
                                    ([0.095, 0.10, 0.115], [0.10, 0.11, 0.12])):
        # estimated within TIE_ESTIMATE of each other: fewer methods decide
        plain, zero = _candidate(plain_steps, 1, 0.2), _candidate(zero_steps, 2, 0.2 / (1 + TIE_ESTIMATE / 2))
        results = [zero, plain]
        winner = _pick_winner(results)
        assert winner[1] is plain[1]
        assert _tied(results, winner) == [zero[1]]


def test_a_tie_goes_to_more_methods_only_where_the_estimate_is_clearly_faster():
    # deep-narrow: zero1 + gradient accumulation (estimated 201 ms, measured fastest) against a
    # pipeline with one method fewer (228 ms); their readings overlap in some searches, not others
    zero_ga, pipeline = _read([28.1, 27.1, 27.0], 3, 0.201), _read([27.5, 26.2, 25.2], 2, 0.228)
    assert _tied([zero_ga, pipeline], zero_ga) == [pipeline[1]]  # the readings overlap
    assert _pick_winner([pipeline, zero_ga])[1] is zero_ga[1]
    apart = _read([25.2, 26.2, 21.6], 2, 0.228)  # apart: measured, the same pick
    assert _tied([zero_ga, apart], zero_ga) == [] and _pick_winner([apart, zero_ga])[1] is zero_ga[1]


def test_a_tie_between_equals_in_methods_goes_to_the_faster_estimate():
    slow_estimate, fast_estimate = _candidate([0.10, 0.11], 2, 0.3), _candidate([0.105, 0.11], 2, 0.1)
    assert _pick_winner([slow_estimate, fast_estimate])[1] is fast_estimate[1]


def test_apart_ranges_or_a_gap_past_the_cap_are_no_tie():
    fast, slow = _candidate([0.10, 0.10, 0.101], 2), _candidate([0.13, 0.13, 0.14], 1)
    assert _pick_winner([slow, fast])[1] is fast[1] and _tied([slow, fast], fast) == []
    # overlapping only through a wild step, but the medians 30% apart: the faster wins
    fast, slow = _candidate([0.10, 0.10, 0.5], 2), _candidate([0.13, 0.13, 0.13], 1)
    assert _pick_winner([slow, fast])[1] is fast[1]


def _read(readings: list[float], methods: int, estimate: float):
    """A candidate timed in several dry runs (a close call), each reading its median step."""
    item = _candidate([BATCH / readings[0]], methods, estimate)
    item[1].throughputs = list(readings)
    for value in readings[1:]:
        _record(item[1], {"throughput": value, "step_seconds": [BATCH / value]}, BATCH)
    return item


def test_overlapping_ranges_tie_up_to_the_cap_past_the_old_10_percent():
    # small's plain data parallelism beside a 4-stage pipeline, within 4-10% side by side: three
    # readings each, the medians 12% apart, the ranges overlapping: a tie, the faster estimate wins
    # it, as it does when the medians read 2% apart
    best, plain = _read([140.0, 134.0, 150.0], 1, 0.057), _read([136.0, 118.0, 123.0], 1, 0.047)
    assert 1 - plain[1].throughput / best[1].throughput > 0.10 and TIE_CAP >= 0.12
    assert _pick_winner([best, plain])[1] is plain[1] and _tied([best, plain], plain) == [best[1]]


def test_ranges_apart_are_no_tie_however_close_the_medians():
    best, other = _read([100.0, 101.0, 102.0], 1, 0.2), _read([95.0, 96.0, 97.0], 1, 0.1)
    assert _pick_winner([best, other])[1] is best[1] and _tied([best, other], best) == []


def test_the_report_says_who_was_tied_and_shows_each_range():
    plain, zero = _candidate([0.10, 0.11, 0.12], 1), _candidate([0.095, 0.10, 0.115], 2)
    report = SearchReport(world_size=2, device="cpu", memory_budget_bytes=2**30,
                          candidates=[zero[1], plain[1]], winner=1, tied=[0])
    text = report.table()
    assert "winner m0: tied with m0 + m1" in text
    assert "145 (133-160)" in text  # 16 samples in a median step of 0.11 s, the slowest 0.12 s, the fastest 0.10 s
    assert SearchReport.from_dict(report.to_dict()).tied == [0]
    assert max(len(line) for line in text.splitlines()) <= 120


def test_a_cached_report_says_so_first_with_its_age():
    import time

    plain = _candidate([0.10, 0.11, 0.12], 1)
    report = SearchReport(world_size=2, device="cpu", memory_budget_bytes=2**30, candidates=[plain[1]], winner=0,
                          search_seconds=42.0, created=time.time() - 7200,
                          note="(from the search cache; pass use_search_cache=False to search again)")
    first = report.table().splitlines()[0]
    assert first.startswith("from the search cache (searched, 2h ago in 42.0s): atorch search: 1 candidates"), first


def test_the_report_says_where_the_time_went_stage_by_stage():
    plain = _candidate([0.10, 0.11, 0.12], 1)
    stages = {"space": 3.5, "estimates": 2.0, "dry runs": 15.0, "close call": 14.1, "trials on the pick": 93.7}
    report = SearchReport(world_size=2, device="cpu", memory_budget_bytes=2**30, candidates=[plain[1]], winner=0,
                          search_seconds=128.3, stage_seconds=stages)
    lines = report.table(width=80).splitlines()
    assert lines[1:3] == ["time: space 3.5s, estimates 2.0s, dry runs 15.0s, close call 14.1s,",
                          "    trials on the pick 93.7s"], lines  # folded between stages, not inside one
    assert SearchReport.from_dict(report.to_dict()).stage_seconds == stages
    report.stage_seconds = None  # a report from before: no such line
    assert not any(line.startswith("time:") for line in report.table().splitlines())
