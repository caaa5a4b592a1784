"""Stage 5 of the search: the close call. The best measured candidate and the runners-up within
reach of it are timed side by side (sidebyside.py); where that cannot run, each is timed again
in fresh dry runs, alternating the order, and keeps the median of its readings."""

import statistics

from atorch.auto.search.agree import all_ok, from_rank0
from atorch.auto.search.candidate import MEASURED
from atorch.auto.search.dryruns import judge, measure, reading, record
from atorch.auto.search.sidebyside import MAX_TURNS, TURN_STEPS, behind_bands, fits_together, time_side_by_side
from atorch.auto.search.state import SearchRun
from atorch.utils.log import logger, quiet

# Every runner-up whose fastest timed step is within this fraction of the best's median (up to
# RETIME_BAND candidates, the best included: the close call; a single noisy reading does not keep a
# candidate out: the README example's plain data parallelism once read 968 samples/s, 34% behind
# zero1's 1465, its fastest step 1191, where side by side it ran 5-17% ahead in four other
# searches; in test_reproducible.py's searches (1 warm-up step, 2 timed) its first dry run read
# 674-1186 samples/s, 674-681 once, against 1400-1700 side by side, and 42% behind the 2-stage
# pipeline that search picked) is timed side by side with the best (sidebyside.py); where that cannot
# run, it is timed again, and so is the best, in up to RETIME_ROUNDS more fresh dry runs each, in
# turn from the slowest to the best, then from the best to the slowest (a drift of the machine's
# load weighs on all alike); each keeps the median of its readings, and a round
# runs only while two candidates are still within the margin. 4 ranks on 2 shared cores, six dry
# runs each of plain and zero1 data parallelism on search_quality.py's small Llama, alternated,
# measured 109-133 and 110-141 samples/s (max/min 1.22 and 1.28; the slowest rank's steps within
# one run varied up to 1.5x); the search had once measured that pair at 104 and 133 and picked the
# one 4% slower side by side. Until 2026-11-26 only the best and the runner-up were timed again:
# on that model a third candidate, plain data parallelism, read once at 104-106 samples/s (its
# other readings 126-130) stayed out of the tie that its estimate wins, and 2 of 5 searches picked
# zero1 instead (benchmarks/search_repeat.py, 2026-11-26, before the change).
RETIME_MARGIN = 0.50
RETIME_ROUNDS = 2
RETIME_BAND = 5


def settle_close_call(run: SearchRun) -> None:
    """Time the close call side by side, or where it cannot be, again one by one. measure() (only)
    and a search past its time limit time nothing again."""
    if run.given or run.timed_out:
        return
    close = close_call(run.results)
    if close and _side_by_side_fits(run, close) and side_by_side(run, close):
        return
    _retime(run)


def _side_by_side_fits(run: SearchRun, close: list) -> bool:
    """Whether the close call's copies can be alive together on every rank and fit the time left."""
    options = run.options
    need = sum(r.seconds + (MAX_TURNS * TURN_STEPS - options.timed_steps) * run.global_batch / r.throughput
               for _, r in close)
    remaining = run.time_left()
    fits = all_ok(fits_together([r.measured_peak_bytes for _, r in close], run.device_ctx.device,
                                run.device_ctx.local_world_size))
    return fits and from_rank0(remaining is None or remaining >= need)


def _retime(run: SearchRun) -> None:
    """Up to RETIME_ROUNDS more dry runs of each close candidate: the slowest to the best, then
    the best to the slowest, ...; the throughput is the median of the readings, the peak their
    largest, judged again."""
    for round_ in range(RETIME_ROUNDS):
        close = close_call(run.results)
        if not close:
            return  # no close call, or the readings so far set the candidates apart
        for strategy, result in close if round_ % 2 == 0 else close[::-1]:
            remaining = run.time_left()
            if not from_rank0(remaining is None or remaining >= run.last_seconds):
                return  # out of time
            run.say(f"search: timing {result.name} again (a close call)")
            outcome = measure(run, strategy, result, run.options.timed_steps, run.options.dryrun_timeout, remaining)
            if outcome["reason"] is not None or outcome["timed_steps"] < run.options.timed_steps:
                continue  # the readings so far stand
            result.throughputs = [*(result.throughputs or [result.throughput]), reading(outcome, run.global_batch)]
            record(result, outcome, run.global_batch)
            peaks = [p for p in (result.measured_peak_bytes, outcome["measured_peak_bytes"]) if p is not None]
            result.measured_peak_bytes = max(peaks) if peaks else None
            judge(result, run.options)


def close_call(results) -> list:
    """The best measured candidate and the others whose fastest timed step is within RETIME_MARGIN
    of its median, the nearest first, at most RETIME_BAND in all; from the slowest to the best
    (they are timed again in turn); none when the best stands alone."""
    measured = sorted(((s, r) for s, r in results if r.status == MEASURED and r.throughput),
                      key=lambda item: -item[1].throughput)
    if not measured:
        return []
    best = measured[0][1].throughput
    others = sorted(measured[1:], key=lambda item: -_fastest(item[1]))[:RETIME_BAND - 1]
    close = [measured[0], *((s, r) for s, r in others if _fastest(r) >= best * (1 - RETIME_MARGIN))]
    return close[::-1] if len(close) > 1 else []


def _fastest(result) -> float:
    """A candidate's fastest timed step, as samples/s (its median where it has one reading)."""
    return max(result.throughput_range[1], result.throughput) if result.throughput_range else result.throughput


def side_by_side(run: SearchRun, close: list) -> bool:
    """Time the close call's candidates side by side (sidebyside.py): each keeps its samples/s
    there (``side_by_side``), which then decides. Whether it ran."""
    names = "; ".join(r.name for _, r in close)
    run.say(f"search: timing {names} side by side (a close call)")
    with quiet():
        outcome = time_side_by_side(run.model, [s for s, _ in close], run.make_context, run.apply,
                                    run.options.warmup_steps, run.options.dryrun_timeout)
    if outcome["reason"] is not None:
        logger.info("timing the close call side by side failed (%s); timing its candidates again one by one",
                    outcome["reason"])
        return False
    for (_, result), turns, band in zip(close, outcome["turn_seconds"], behind_bands(outcome["turn_seconds"])):
        result.side_by_side = run.global_batch / statistics.median(turns)
        result.side_by_side_seconds = turns
        result.side_by_side_behind = list(band)
    return True
