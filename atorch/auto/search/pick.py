"""Stage 6 of the search: the pick. The fastest measured candidate that fits wins; candidates the
readings cannot tell apart are tied, and a fixed rule picks among them, so the same readings give
the same pick. With no winner, a note says what was tried and what would make it fit."""

from collections import Counter

from atorch.auto.registry import all_methods
from atorch.auto.search import cost
from atorch.auto.search.candidate import FAILED, MEASURED, OVER_BUDGET, PRUNED
from atorch.auto.search.sidebyside import TIE as SIDE_BY_SIDE_TIE
from atorch.auto.search.sidebyside import behind_bands
from atorch.auto.search.state import SearchOptions
from atorch.utils.sizes import size_text

# Throughputs within this fraction of the best count as a tie, won by the simpler strategy (a close
# call timed side by side: sidebyside.TIE, won by the lower measured peak).
TIE_TOLERANCE = 0.03
# Where the close call could not be timed side by side (its copies do not fit the device together,
# or the time left): a candidate whose measured range (its fastest and slowest timed steps, over
# every dry run) overlaps the best's is tied with it too, if its median is within this fraction
# of the best's: the readings cannot tell them apart, so a fixed rule (below) decides, and the
# same job gets the same pick run after run. At 0.10 (until 2026-11-26), candidates within 4-10%
# of each other side by side read medians 3-20% apart over three dry runs each (4 ranks on 2
# cores), and the pick changed with which side of the cap a draw fell: search_quality.py's small (3 of 5 searches the same),
# bert (3 of 5), gpt2-tied, memory-bound and deep-narrow (4 of 5). Tying only where three readings
# a candidate overlapped did no better (deep-narrow 3 of 5, bert 3 of 5). The cost: a candidate up
# to 20% faster in the readings can lose a tie to one that is simpler or clearly estimated faster.
TIE_CAP = 0.20
# A tie goes to fewer methods among the tied candidates estimated within this fraction of the
# fastest estimate, then to the faster estimate: a candidate with more methods wins a tie only
# where the estimate clearly says it is faster. With fewer methods first alone, deep-narrow's
# pick in search_quality.py flipped (3 of 5 searches) between zero1 + gradient accumulation x2
# (estimated 201 ms, measured fastest, 7% ahead in the exhaustive run) when its three readings
# stood apart, and a 4-stage pipeline (228 ms, one method fewer) when they overlapped. Where the
# estimates are near (small's README example: zero2 estimated 5% faster than plain DDP at nominal
# rates, measured 22% slower), fewer methods still decide.
TIE_ESTIMATE = 0.10
# Measured peaks within this fraction of the lowest are as low, for the tie rule side by side: a
# candidate's peak reads up to about 1% apart from one dry run to the next (search_quality.py: of
# 22 peaks measured in two runs, 19 equal, two 0.8% apart, one 3.9%), and two strategies that
# keep the same tensors can differ by a few bytes. On search_quality.py's hidden-mlp, plain and
# amp_native [tensor=2] measured 27,131,068 and 27,131,066 bytes: 2 bytes gave amp the tie in
# one search in 3 (the others picked plain, one method fewer).
PEAK_TIE = 0.02


def pick_winner(results):
    """The winning ``(strategy, result)``, or None when no candidate was measured to fit."""
    measured = [(s, r) for s, r in results if r.status == MEASURED]
    if not measured:
        return None
    if _timed_together(results):
        return _side_by_side_tie_winner(_tied_set(results))
    tied = _clearly_faster(_tied_set(results) or measured)
    return min(tied, key=_tie_rule)  # min keeps the first of equals: the order of generation


def tied_with(results, winner) -> list:
    """The other measured candidates the winner was tied with (it won by the tie rule)."""
    return [r for s, r in _tied_set(results) if r is not winner[1]]


def unmeasured_pick(results, budget: int):
    """Out of time before any measurement: the simplest candidate that fits the budget even at the
    lowest estimated / measured ever seen is the safe answer."""
    safe = [(s, r) for s, r in results if r.status != FAILED and cost.fits_unmeasured(r.estimated_peak_bytes, budget)]
    return min(safe, key=lambda item: len(item[0]), default=None)


def _ties_with(result, best) -> bool:
    if result.throughput >= best.throughput * (1 - TIE_TOLERANCE):
        return True
    if not (result.throughput_range and best.throughput_range):
        return False
    overlap = result.throughput_range[1] >= best.throughput_range[0]
    return overlap and result.throughput >= best.throughput * (1 - TIE_CAP)


def _tie_rule(item) -> tuple:
    """Fewer methods first, then the faster estimate; the order of generation settles the rest."""
    strategy, result = item
    return len(strategy), result.estimated_step_seconds or float("inf")


def _side_by_side_tie_winner(tied: list):
    """A tie side by side goes to the lower measured peak (as fast, more memory left), peaks within
    PEAK_TIE of the lowest counting as equal; then to fewer methods; then to the faster there
    (sidebyside.TIE says why not fewer methods first). A peak not measured counts as the highest."""
    def peak(item) -> float:
        return item[1].measured_peak_bytes if item[1].measured_peak_bytes is not None else float("inf")

    lowest = min(peak(item) for item in tied)
    low = [item for item in tied if peak(item) <= lowest * (1 + PEAK_TIE)]
    return min(low, key=lambda item: (len(item[0]), -item[1].side_by_side))


def _clearly_faster(tied: list) -> list:
    """The tied candidates whose estimated step is within TIE_ESTIMATE of the fastest estimate: the
    tie rule's fewer methods choose among these only. A candidate without an estimate stays only
    when none has one (then all stay)."""
    estimates = [r.estimated_step_seconds for _, r in tied if r.estimated_step_seconds]
    if not estimates:
        return tied
    limit = min(estimates) * (1 + TIE_ESTIMATE)
    return [(s, r) for s, r in tied if r.estimated_step_seconds and r.estimated_step_seconds <= limit]


def _timed_together(results) -> list:
    """The measured candidates still taking turns when the side-by-side timing ended (the most
    turns; none when no close call was timed side by side). One that stopped taking turns was
    behind the fastest beyond the tie on the turns all had taken (sidebyside.still_open); its
    median, over fewer and earlier turns, is not compared with theirs (a change in the machine's
    load after it stopped would move theirs and not its)."""
    together = [(s, r) for s, r in results if r.status == MEASURED and r.side_by_side]
    if len(together) < 2:
        return []
    most = max(len(r.side_by_side_seconds or ()) for _, r in together)
    return [(s, r) for s, r in together if len(r.side_by_side_seconds or ()) == most]


def _tied_set(results) -> list:
    together = _timed_together(results)
    if together:  # side by side: tied where the turns cannot set it apart beyond the tie (its band)
        bands = behind_bands([r.side_by_side_seconds for _, r in together])
        return [item for item, (_, low, _) in zip(together, bands) if low <= 1 + SIDE_BY_SIDE_TIE]
    measured = [(s, r) for s, r in results if r.status == MEASURED and r.throughput]
    if not measured:
        return []
    best = max(measured, key=lambda item: item[1].throughput)[1]
    return [(s, r) for s, r in measured if _ties_with(r, best)]


def no_winner_note(results, options: SearchOptions, timed_out: bool) -> str:
    """Why nothing came back: what was tried, the smallest candidate, and what would make it fit."""
    budget = options.memory_budget
    ran = [r for _, r in results if r.status in (MEASURED, FAILED)]
    over = sum(1 for r in ran if r.measured_peak_bytes and r.measured_peak_bytes > budget)
    pruned = Counter(r.reason for _, r in results if r.status == PRUNED)
    tried = f"{len(ran)} dry-run ({over} measured over the budget), " + (
        ", ".join(f"{n} pruned ({why})" for why, n in pruned.most_common()) or "none pruned")
    over_budget = over or any(r.reason == OVER_BUDGET.format(options.estimate_ratio[1]) for _, r in results)
    if timed_out and not any(r.throughput for r in ran):
        lead = f"time_limit of {options.time_limit:g}s reached before any candidate was measured"
    elif over_budget:
        lead = f"no candidate fits the memory budget of {size_text(budget)} per rank"
    else:
        lead = f"no candidate ran within the memory budget of {size_text(budget)} per rank (see each reason)"
    peaks = [(r.measured_peak_bytes, "measured", r) for r in ran if r.measured_peak_bytes]
    if not peaks:  # nothing measured: the smallest estimate (which may be high by the estimate's error)
        peaks = [(r.estimated_peak_bytes, "estimated", r) for _, r in results if r.estimated_peak_bytes]
    if not peaks:
        return f"{lead}; tried: {tried}; no candidate could be estimated or measured (see each reason)"
    return f"{lead}; tried: {tried}; " + _smallest_text(results, options, min(peaks, key=lambda item: item[0]))


def _smallest_text(results, options: SearchOptions, smallest: tuple) -> str:
    """The smallest candidate's peak, and what would lower it: the memory-saving methods no
    candidate used (excluded, or not runnable here) could help."""
    peak, how, result = smallest
    names = " + ".join(result.names) or "(plain)"
    budget = options.memory_budget
    unused = [s.name for s in all_methods() if (s.saves_memory or s.memory_only) and s.search_space
              and not any(s.name in r.names for _, r in results)]
    helps = "more ranks or a smaller batch per rank" + (f", or allowing {', '.join(unused)}" if unused else "")
    if how == "estimated":
        how = f"estimated (up to x{options.estimate_ratio[1]:g} high)"
    fit = (f"it would fit a larger memory budget (>= {size_text(peak)})" if peak > budget
           else "that is within the budget, but it did not run (see its reason)")
    return f"the smallest is {names}, {how} peak {size_text(peak)}: {fit}; {helps} would lower the peak"
