"""Stage 5b of the search: refinements of the pick. A method that changes how a strategy runs, not
what a rank holds (torch.compile, a fused optimizer step: ``MethodSpec.tried_on_pick``; a
config of another method, ``MethodSpec.pick_trials``: liger's kernels through module_replace),
is not crossed with every candidate, which would double the space and the dry runs; it is tried
on the pick alone:

1. planned with the pick (a conflict, or a method that would change nothing, is a reason);
2. skipped where it cannot pay over the job's ``planned_steps`` (``MethodSpec.cannot_pay``: a
   compile longer than the most it could save);
3. built beside the pick and timed side by side with it (sidebyside.py); its warm-up's extra
   seconds over the pick's (the compile) are spread over ``planned_steps`` and added to each of
   its turns;
4. kept where the pick's turns are behind its own beyond the tie (sidebyside.TIE, the band of the
   ratio as the close call reads it), or, for a method that costs nothing where it is as fast
   (``MethodSpec.kept_unless_slower``: the fused step), unless they are ahead of its own beyond
   the tie; then dry-run for its peak, which must fit the budget.

Each trial is a row of the report: kept (measured), or pruned with the figures that decided.
"""

import statistics

from atorch.auto.plan import plan_strategy
from atorch.auto.registry import all_methods, get_method
from atorch.auto.search.agree import all_ok, from_rank0
from atorch.auto.search.candidate import FAILED, MEASURED, CandidateResult
from atorch.auto.search.dryruns import judge, measure, record
from atorch.auto.search.estimate import resolved
from atorch.auto.search.pick import pick_winner
from atorch.auto.search.sidebyside import TIE, fits_together, median_band, time_side_by_side
from atorch.auto.search.state import SearchRun
from atorch.auto.strategy import Strategy
from atorch.errors import AtorchConfigError
from atorch.utils.log import quiet

# Why a trial was not kept, as counted in the report (SearchReport.pruned).
NOT_FASTER, SLOWER_THAN_PICK, CANNOT_PAY = "not_faster", "slower_than_pick", "cannot_pay"


def refine_pick(run: SearchRun, excluded=None, estimate=None) -> None:
    """Try each ``tried_on_pick`` method on the pick (see the module docstring); ``run.refined``
    is the pick with those kept, when one was. ``estimate(strategy)`` gives a trial's record with
    its estimate (estimate.estimate_one; without it the record has none)."""
    if run.given or run.timed_out:
        return
    winner = pick_winner(run.results)
    if winner is None:
        return
    kept = winner
    for spec in all_methods():
        for config in _trial_configs(run, spec, kept[0], set(excluded or ())):
            trial = _trial(run, kept, spec.name, config, estimate)
            if trial is not None:
                kept = trial
                break
    if kept is not winner:
        run.refined, run.refined_from = kept, winner


def _trial_configs(run: SearchRun, spec, pick: Strategy, excluded: set) -> list[dict]:
    """The configs of ``spec`` to try on ``pick``: a ``tried_on_pick`` method's search space (when
    the pick lacks it), or its ``pick_trials``; none that this device or this job cannot run
    (liger's kernels on a CPU, a fused step for an optimizer without one) or that the user excluded."""
    if spec.name in excluded or (spec.applies_to is not None and not spec.applies_to(run.model)):
        return []
    configs = (spec.search_space if spec.name not in pick else ()) if spec.tried_on_pick else spec.pick_trials
    configs = [c for c in configs if spec.unsupported is None or spec.unsupported(run.device_ctx, spec.config_cls(**c)) is None]
    if spec.job_unsupported is not None and configs:
        job = run.make_context(run.model)
        configs = [c for c in configs if spec.job_unsupported(job, spec.config_cls(**c)) is None]
    return configs


def _with(pick: Strategy, name: str, config: dict) -> Strategy:
    """``pick`` with ``name`` added, or with its config replaced where the pick has it already."""
    return pick.replace(name, config) if name in pick else pick.with_method(name, config)


def _trial(run: SearchRun, pick: tuple, name: str, config: dict, estimate) -> tuple | None:
    """The pick with ``name`` added, as a report row; returned when it is kept."""
    strategy = _planned(run, pick[0], name, config)
    if isinstance(strategy, Strategy) and estimate is not None:
        row = estimate(strategy)  # a config error or over the budget: pruned there, by its own rule
    else:
        row = CandidateResult(_with(pick[0], name, config).to_dict(), layout=pick[1].layout)
    run.results.append((strategy if isinstance(strategy, Strategy) else _with(pick[0], name, config), row))
    run.trials += 1
    if not isinstance(strategy, Strategy):
        row.reason, row.pruned_by = strategy or f"not tried: {name} changes nothing on this job", CANNOT_PAY
        return None
    if row.reason is not None:
        return None
    step = run.global_batch / (pick[1].side_by_side or pick[1].throughput)
    spec = get_method(name)
    why = spec.cannot_pay(spec.config_cls(**config), step, run.options.planned_steps,
                          run.device_ctx.device.type) if spec.cannot_pay else None
    if why is not None:
        row.reason, row.pruned_by = why, CANNOT_PAY
        return None
    if not _room(run, pick[1]):
        row.reason, row.pruned_by = "not tried: it and the pick do not fit the device together, or the time left", \
            CANNOT_PAY
        return None
    return _timed_trial(run, pick, strategy, row, spec.kept_unless_slower)


def _planned(run: SearchRun, base: Strategy, name: str, config: dict) -> Strategy | str | None:
    """The pick with ``name`` as planned for this job; a refusal's reason, or None where planning
    dropped the method (it cannot run here, or changes nothing)."""
    try:
        with quiet():
            planned, _ = plan_strategy(_with(base, name, config), run.device_ctx)
    except AtorchConfigError as error:
        return f"not tried: {error}"
    planned = resolved(run.model, planned)
    return planned if name in planned else None


def _room(run: SearchRun, pick) -> bool:
    """Whether two copies of the pick fit every rank together, and a side-by-side timing the time left."""
    remaining = run.time_left()
    fits = all_ok(fits_together([pick.measured_peak_bytes] * 2, run.device_ctx.device,
                                run.device_ctx.local_world_size))
    return fits and from_rank0(remaining is None or remaining >= 4 * (pick.seconds or 0.0))


def _timed_trial(run: SearchRun, pick: tuple, strategy: Strategy, row: CandidateResult,
                 unless_slower: bool = False) -> tuple | None:
    """Time the trial beside the pick; kept (dry-run for its peak) where it is ahead beyond the tie,
    or, ``unless_slower``, where it is not behind beyond the tie."""
    run.say(f"search: trying {row.name} on the pick, side by side")
    with quiet():
        outcome = time_side_by_side(run.model, [pick[0], strategy], run.make_context, run.apply,
                                    max(run.options.warmup_steps, 1), run.options.dryrun_timeout)
    row.seconds = outcome["seconds"]
    if outcome["reason"] is not None:
        row.status, row.reason = FAILED, f"tried on the pick side by side, failed: {outcome['reason']}"
        return None
    picks, trials = outcome["turn_seconds"]  # the pick was built first
    warmup = outcome.get("warmup_seconds") or [0.0, 0.0]
    once = max(0.0, warmup[1] - warmup[0])
    spread = once / run.options.planned_steps
    charged = [t + spread for t in trials[:len(picks)]]
    pick_band = pick_behind(picks, charged)
    figures = (f"side by side the pick ran {pick_band[0]:.3f}x the trial's step (band {pick_band[1]:.3f}-"
               f"{pick_band[2]:.3f}), the trial's warm-up {once:.1f}s longer, spread over "
               f"{run.options.planned_steps} planned steps")
    refused = _refused(pick_band, unless_slower, figures)
    if refused is not None:
        row.reason, row.pruned_by = refused
        return None
    outcome = measure(run, strategy, row, run.options.timed_steps, run.options.dryrun_timeout, run.time_left())
    if outcome["reason"] is not None:
        row.status, row.reason = FAILED, f"faster side by side ({figures}), then its dry run failed: {outcome['reason']}"
        return None
    record(row, outcome, run.global_batch)
    row.measured_peak_bytes = outcome["measured_peak_bytes"]
    judge(row, run.options)  # FAILED, with why, where its measured peak is over the budget
    if row.status != MEASURED:
        return None
    row.reason = f"kept on the pick{' (not slower beyond the tie)' if unless_slower else ''}: {figures}"
    return strategy, row


def _refused(pick_band: tuple, unless_slower: bool, figures: str) -> tuple[str, str] | None:
    """Why a trial timed beside the pick is not kept, and the report's name for it; None where it is.

    >>> _refused((1.01, 0.99, 1.03), False, "f")[1], _refused((1.01, 0.99, 1.03), True, "f")
    ('not_faster', None)
    >>> _refused((0.95, 0.94, 0.96), True, "f")[1]
    'slower_than_pick'
    """
    if unless_slower and pick_band[2] < 1 - TIE:
        return f"slower than the pick beyond the tie ({TIE:.1%}): {figures}", SLOWER_THAN_PICK
    if not unless_slower and pick_band[1] <= 1 + TIE:
        return f"not faster than the pick beyond the tie ({TIE:.1%}): {figures}", NOT_FASTER
    return None


def pick_behind(pick_turns: list[float], trial_turns: list[float]) -> tuple[float, float, float]:
    """The pick's turns over the trial's, round by round: the median ratio and its band
    (sidebyside.median_band); above 1 where the trial runs faster.

    >>> pick_behind([1.1, 1.2, 1.1, 1.1, 1.0, 1.1], [1.0] * 6)
    (1.1, 1.0, 1.2)
    """
    ratios = sorted(p / t for p, t in zip(pick_turns, trial_turns))
    low, high = median_band(ratios)
    return statistics.median(ratios), low, high

