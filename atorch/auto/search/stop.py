"""Early stop: the search dry-runs candidates fastest estimate first, and stops when the estimate's
error, as this job's own dry runs measured it, says that no candidate left can win.

Each dry run gives one reading of the estimate's error on this job and machine: measured step /
estimated step. A candidate not yet run would step at least ``estimate x the lowest ratio seen x
STOP_SLACK``; when that is slower than the best measured step, it cannot win and is not dry-run.
The bound needs ``MIN_MEASURED`` readings first: one ratio says little about the spread.

    >>> cannot_win(0.05, [(0.02, 0.03), (0.03, 0.04)], 0.03) is not None   # 0.05 x 1.33 x 0.8 > 0.03
    True
"""

# Readings of the estimate's error (measured candidates) before the bound is trusted.
MIN_MEASURED = 2
# How much faster than the lowest measured / estimated ratio seen a candidate may still run. On
# search_quality.py's small Llama (4 ranks on 2 cores, calibrated rates, 56 candidates) the ratio
# spans 0.9-2.2 over the candidates; the fastest-estimated few, which the search runs first, read
# within 25% of one another's ratio.
STOP_SLACK = 0.8
CANNOT_WIN = "cannot_win"
# The same for memory: a candidate not yet run peaks at least at its estimate x the lowest measured
# / estimated peak seen x PEAK_SLACK. On search_quality's boundary scenario (budget 3% over the
# smallest peak of 204 candidates) the 8 dry runs, fastest estimate first, all measured 0.99-1.09
# of their estimates and over the budget, and the one candidate that fits (estimated 0.92 of the
# budget) was never run: the search returned nothing. Over the whole space the ratio spans
# 0.80-1.30, the fastest-estimated near-boundary few within 10% of one another.
PEAK_SLACK = 0.9
CANNOT_FIT = "cannot_fit"


def _lowest_bound(estimated: float | None, readings: list, slack: float) -> tuple[float, float | None]:
    """The lowest measured / estimated ratio of ``readings`` and the least ``estimated`` can come
    to at it less ``slack``: (0, None) with no estimate or fewer than MIN_MEASURED readings."""
    if estimated is None or len(readings) < MIN_MEASURED:
        return 0.0, None
    low = min(measured / est for est, measured in readings if est > 0)
    return low, estimated * low * slack


def cannot_win(estimated: float | None, readings: list[tuple[float, float]], best_seconds: float | None) -> str | None:
    """Why a candidate estimated at ``estimated`` seconds a step cannot beat the best measured step
    (``best_seconds``, a candidate that fits), given ``readings`` of (estimated, measured) step
    seconds of the candidates measured so far; None when it may win (or too little is known)."""
    if best_seconds is None:
        return None
    low, bound = _lowest_bound(estimated, readings, STOP_SLACK)
    if bound is None or bound <= best_seconds:
        return None
    return (f"cannot win: estimated {estimated * 1e3:.1f} ms a step, so at least {bound * 1e3:.1f} ms at the lowest "
            f"measured / estimated ratio of the {len(readings)} dry runs ({low:.2f}, less {1 - STOP_SLACK:.0%}); "
            f"the best measured {best_seconds * 1e3:.1f} ms")


def cannot_fit(estimated: int | None, readings: list[tuple[int, int]], budget: int) -> str | None:
    """Why a candidate whose peak is estimated at ``estimated`` bytes cannot fit ``budget``, given
    ``readings`` of (estimated, measured) peaks of the candidates dry-run so far; None when it may
    fit (or too little is known).

        >>> cannot_fit(120, [(100, 110), (100, 105)], 100) is not None   # 120 x 1.05 x 0.9 > 100
        True
        >>> cannot_fit(100, [(100, 110), (100, 105)], 100) is None
        True
    """
    low, bound = _lowest_bound(estimated, readings, PEAK_SLACK)
    if bound is None or bound <= budget:
        return None
    mib = 2**20
    return (f"cannot fit: estimated peak {estimated / mib:.2f} MiB, so at least {bound / mib:.2f} MiB at the lowest "
            f"measured / estimated peak of the {len(readings)} dry runs ({low:.2f}, less {1 - PEAK_SLACK:.0%}); "
            f"the budget {budget / mib:.2f} MiB")


def check_fit(result, results: list, budget: int) -> str | None:
    """:func:`cannot_fit` for ``result`` (not yet run) against ``results``' dry runs that measured
    their peak."""
    readings = [(r.estimated_peak_bytes, r.measured_peak_bytes) for r in results
                if r.estimated_peak_bytes and r.measured_peak_bytes]
    return cannot_fit(result.estimated_peak_bytes, readings, budget)


def check(result, results: list, global_batch: int) -> str | None:
    """:func:`cannot_win` for ``result`` (a CandidateResult not yet run) against ``results``' dry
    runs: every timed one is a reading of the estimate's error, the best is the fastest that fits."""
    timed = [r for r in results if r.throughput and r.estimated_step_seconds]
    readings = [(r.estimated_step_seconds, global_batch / r.throughput) for r in timed]
    best = min((global_batch / r.throughput for r in timed if r.status == "measured"), default=None)
    return cannot_win(result.estimated_step_seconds, readings, best)


def stop_note(stopped: int, ran: int) -> str:
    """The report's line for an early stop."""
    return (f"stopped early after {ran} dry runs: the estimate's error as measured on them says none of the "
            f"{stopped} candidates left can win (pruned, cannot win)")
