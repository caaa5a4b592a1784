"""Stage 4 of the search: dry runs, fastest estimate first, each judged on its measured peak; the
early stop (stop.py) and the twin rules prune what the measurements so far rule out, and
max_dryruns and time_limit bound the stage."""

import statistics

from atorch.auto.search import cost, stop
from atorch.auto.search.agree import from_rank0
from atorch.auto.search.candidate import FAILED, MAX_DRYRUNS, MEASURED, TIME_LIMIT
from atorch.auto.search.dryrun import dry_run
from atorch.auto.search.estimate import layout_dims
from atorch.auto.search.prune import prune_twins
from atorch.auto.search.state import SearchOptions, SearchRun
from atorch.auto.strategy import Strategy
from atorch.distributed.topology import DATA_PARALLEL_DIMS
from atorch.utils.log import quiet
from atorch.utils.sizes import size_text


def dry_run_order(run: SearchRun) -> tuple[list, list]:
    """The candidates to dry-run, and the reserve that takes the place of one the dry runs so far
    prune (cannot fit, cannot win, a twin measured to fit): max_dryruns counts dry runs, not places.

    Fastest estimate first (the simpler on a tie; those with no estimate last, since their probe
    failed), so max_dryruns and time_limit cut the least promising candidates."""
    runnable = [(s, r) for s, r in run.results if r.reason is None]
    runnable.sort(key=lambda item: (item[1].estimated_step_seconds is None,
                                    round(item[1].estimated_step_seconds or 0.0, 9), len(item[0])))
    to_run = runnable[: run.options.max_dryruns]
    kept = 0  # slots at the end of to_run kept for a candidate sure to fit
    if to_run and not any(run.surely_fits(r) for _, r in to_run):
        # Near-boundary candidates may all measure over the budget: the last slot goes to the
        # fastest candidate sure to fit, when there is one, so max_dryruns never leaves the
        # search without an answer that was there.
        safe = next(((s, r) for s, r in runnable[len(to_run):] if run.surely_fits(r)), None)
        if safe is not None:
            to_run = to_run[:-1] + [safe]
            kept = 1
    baseline = next(((s, r) for s, r in runnable if is_baseline(s, run.device_ctx.world_size)), None)
    if not run.given and baseline is not None and baseline not in to_run and len(to_run) - kept >= 2 \
            and run.surely_fits(baseline[1]):
        # Plain data parallelism, the job as the user wrote it, is measured whenever it surely
        # fits, so an estimate alone never makes the answer slower than it (on search_quality's
        # small Llama it was estimated 14% slower than zero1 and measured as fast). It takes the
        # last slot not kept for a candidate sure to fit.
        last = len(to_run) - 1 - kept
        to_run = to_run[:last] + [baseline] + to_run[last + 1:]
    return to_run, [item for item in runnable if item not in to_run]


def is_baseline(strategy: Strategy, world_size: int) -> bool:
    """Plain data parallelism over every rank (or the plain model on one): no other method."""
    return all(name == "parallel_mode" for name in strategy.opt_names) and all(
        name in DATA_PARALLEL_DIMS for name in layout_dims(strategy, world_size))


def measure(run: SearchRun, strategy: Strategy, result, steps: int, timeout: float, remaining: float | None) -> dict:
    """One dry run of ``steps`` timed steps, stopped at the time limit; its seconds are added to
    the candidate's, and the next candidate starts only if one as long fits the time left."""
    options = run.options
    with quiet():
        outcome = dry_run(run.model, strategy, run.make_context, run.apply, options.warmup_steps, steps, timeout,
                          run.global_batch, stop_after_s=None if remaining is None else from_rank0(remaining))
    run.last_seconds = outcome["seconds"]
    result.seconds = (result.seconds or 0.0) + outcome["seconds"]
    return outcome


def run_dry_runs(run: SearchRun, to_run: list, reserve: list) -> int:
    """Dry-run ``to_run``, then ``reserve`` in place of the pruned, up to max_dryruns; returns how
    many candidates the early stop said cannot win."""
    options, stopped, ran = run.options, 0, 0
    for strategy, result in [*to_run, *reserve]:
        if ran >= options.max_dryruns:
            result.reason, result.pruned_by = f"not dry-run: max_dryruns={options.max_dryruns} reached", MAX_DRYRUNS
            continue
        if not run.given and _pruned_before_running(run, result):
            stopped += result.pruned_by == stop.CANNOT_WIN
            continue
        # Rank 0's clock decides for everyone. A candidate starts only if one like the last fits
        # in the time left, and its timed steps stop at the limit: time_limit is a promise.
        remaining = run.time_left()
        if not from_rank0(remaining is None or remaining >= run.last_seconds):
            run.timed_out = True
            result.reason = f"not dry-run: time_limit of {options.time_limit:g}s would be exceeded"
            result.pruned_by = TIME_LIMIT
            continue
        ran += 1
        slots = min(options.max_dryruns, len(to_run) + len(reserve))
        bar = "#" * ran + "-" * max(0, slots - ran)
        run.say(f"search [{bar}] {ran}/{slots}: dry-running {result.name}")
        outcome = measure(run, strategy, result, options.timed_steps,
                          options.dryrun_timeout - run.estimate_seconds.get(id(strategy), 0.0), remaining)
        _take(run, strategy, result, outcome)
    return stopped


def _pruned_before_running(run: SearchRun, result) -> bool:
    """Whether the measurements so far prune ``result``: a twin measured to fit proves what its
    estimate could not (the twin rules apply again), and the estimate's error as the dry runs so
    far measured it says it cannot fit the budget or cannot beat the best measured step."""
    prune_twins(run.results, run.fits, pending={id(result)}, measured=run.measured_rates)
    if result.reason is not None:
        return True
    so_far = [r for _, r in run.results]
    why = None if run.options.budget_is_device_memory else stop.check_fit(result, so_far, run.options.memory_budget)
    if why is not None:
        result.reason, result.pruned_by = why, stop.CANNOT_FIT
        return True
    why = stop.check(result, so_far, run.global_batch)
    if why is not None:
        result.reason, result.pruned_by = why, stop.CANNOT_WIN
        return True
    return False


def _take(run: SearchRun, strategy: Strategy, result, outcome: dict) -> None:
    """A first dry run's outcome recorded and judged; a measured fit joins ``run.fits``."""
    if outcome["reason"] is not None:
        result.status, result.reason = FAILED, outcome["reason"]
        return
    record(result, outcome, run.global_batch)
    if outcome["timed_steps"] < run.options.timed_steps:
        run.timed_out = True
        result.reason = f"time_limit: measured over {outcome['timed_steps']} of {run.options.timed_steps} steps"
    result.measured_peak_bytes = outcome["measured_peak_bytes"]
    judge(result, run.options)
    if result.status == MEASURED and result.measured_peak_bytes is not None:
        run.fits.add(id(strategy))


def record(result, outcome: dict, global_batch: int) -> None:
    """A dry run's timed steps added to the candidate's readings: its throughput is the median
    step's, its range the fastest and slowest step's (a slow step, a collector pause, weighs on
    the range, not on the median)."""
    steps = [*(result.step_seconds or []), *(t for t in outcome.get("step_seconds") or () if t > 0)]
    if not steps:
        result.throughput = outcome["throughput"]
        return
    result.step_seconds = steps
    result.throughput = global_batch / statistics.median(steps)
    result.throughput_range = [global_batch / max(steps), global_batch / min(steps)]


def reading(outcome: dict, global_batch: int) -> float:
    """One dry run's throughput as :func:`record` reads a candidate's first: its median step's."""
    steps = [t for t in outcome.get("step_seconds") or () if t > 0]
    return global_batch / statistics.median(steps) if steps else outcome["throughput"]


def judge(result, options: SearchOptions) -> None:
    """Set a dry-run candidate's status, MEASURED or FAILED (with why), from its measured peak: the
    winner must fit the budget. An unmeasured peak fits the device's own memory (the run did not
    run out of it), or a budget its estimate fits even at the lowest estimated / measured ever
    seen (cost.ESTIMATE_FLOOR)."""
    peak, estimate, budget = result.measured_peak_bytes, result.estimated_peak_bytes, options.memory_budget
    result.status = FAILED
    if peak is not None and peak > budget:
        result.reason = f"measured peak memory {size_text(peak)} is over the memory budget"
    elif peak is None and not (options.budget_is_device_memory or cost.fits_unmeasured(estimate, budget)):
        result.reason = (f"peak memory not measured (time ran out before the tracked step, or the tracker failed) "
                         f"and its estimate ({size_text(estimate)}) is not {cost.ESTIMATE_FLOOR:g} of the budget or "
                         "less, the lowest estimated / measured ever seen")
    else:
        result.status = MEASURED
