"""The fully automatic search, stage by stage; docs/dev/search_internals.md is its map.

1. space (space.py): the layouts and the candidates;
2. estimates (estimate.py): each candidate's peak memory and step time, before anything runs;
3. pruning (prune.py): what the estimates rule out, each with its reason;
4. dry runs (dryruns.py): the rest, fastest estimate first, judged on what they measure;
5. the close call (closecall.py): the best and those within reach timed side by side;
5b. refinements (refine.py): torch.compile and a fused optimizer step tried on the pick alone;
6. the pick (pick.py) and the report (report.py).

Each stage reads what the stages before it left in a :class:`~atorch.auto.search.state.SearchRun`
and adds its own decisions; the types they pass are in candidate.py and state.py.
"""

import functools
import time
from collections import Counter
from collections.abc import Callable

import torch

from atorch.auto.context import ModelContext
from atorch.auto.environment import DeviceContext
from atorch.auto.plan import each_drop_once
from atorch.auto.search import cost, stop
from atorch.auto.search.agree import from_rank0, set_timeout
from atorch.auto.search.calibrate import cached_rates
from atorch.auto.search.candidate import FAILED, MEASURED, PRUNED
from atorch.auto.search.closecall import settle_close_call
from atorch.auto.search.dryrun import collector_frozen
from atorch.auto.search.dryruns import dry_run_order, run_dry_runs
from atorch.auto.search.estimate import (  # noqa: F401 - cost_candidate, estimate_candidate, layout_dims: their old home
    Prober,
    Rates,
    cost_candidate,
    estimate_all,
    estimate_candidate,
    estimate_one,
    first_micro_batch,
    ineligible_rows,
    layout_dims,
    resolved,
)
from atorch.auto.search.pick import no_winner_note, pick_winner, tied_with, unmeasured_pick
from atorch.auto.search.prune import prune_on_estimates
from atorch.auto.search.refine import refine_pick
from atorch.auto.search.report import SearchReport
from atorch.auto.search.space import candidate_space, layout_space
from atorch.auto.search.speedup import half_speedup
from atorch.auto.search.state import SearchOptions, SearchRun
from atorch.auto.strategy import Strategy
from atorch.utils.memo import kept

# How long an agreement waits for the slowest rank: AGREEMENT_TIMEOUT_FACTOR x dryrun_timeout +
# AGREEMENT_TIMEOUT_SLACK seconds (see search()).
AGREEMENT_TIMEOUT_FACTOR, AGREEMENT_TIMEOUT_SLACK = 2.0, 60.0

__all__ = ["SearchOptions", "cost_candidate", "estimate_candidate", "layout_dims", "search"]


def search(
    model: torch.nn.Module,
    device_ctx: DeviceContext,
    make_context: Callable[[torch.nn.Module], ModelContext],
    apply: Callable[[ModelContext, Strategy], None],
    options: SearchOptions,
    excluded=None,
    included=None,
    base: Strategy | None = None,
    only: list[Strategy] | None = None,
) -> tuple[Strategy | None, SearchReport]:
    """Find the fastest strategy that fits ``options.memory_budget``; see docs/search.md.

    ``only`` replaces the generated candidates (a loaded strategy checked by a dry run)."""
    # A rank that stops answering (stopped, hung, died) makes the others raise AgreementTimeout
    # instead of waiting torch's 30 minutes: a live peer reaches the next agreement within one dry
    # run (its collectives time out after dryrun_timeout; a last step may run past it).
    set_timeout(AGREEMENT_TIMEOUT_FACTOR * options.dryrun_timeout + AGREEMENT_TIMEOUT_SLACK)
    rng = torch.get_rng_state()
    try:
        with collector_frozen(), each_drop_once():
            return _search(model, device_ctx, make_context, apply, options, excluded, included, base, only)
    finally:
        torch.set_rng_state(rng)  # the search does not change the user's random stream


def _search(model, device_ctx, make_context, apply, options, excluded, included, base, only):
    probe_ctx = make_context(model)
    run = SearchRun(model, device_ctx, make_context, apply, options,
                    int(probe_ctx.dataloader_args.get("batch_size", 1)), given=only is not None)
    counts: Counter = Counter()
    candidates, ineligible = _space(run, probe_ctx, excluded, included, base, only, counts)  # 1
    run.results.extend(ineligible_rows(ineligible))
    run.lap("space")
    prober, rates = Prober(run, probe_ctx, candidates), _rates(run, probe_ctx)
    # As planned for this model, so the report names what would run, and the same run once.
    estimate_all(run, [resolved(model, strategy) for strategy in candidates], prober, rates, candidates)  # 2
    run.fits.update(id(s) for s, r in run.results if r.reason is None and run.surely_fits(r))
    if not run.given:
        prune_on_estimates(run.results, run.fits, run.measured_rates)  # 3
    run.lap("estimates")
    stopped = run_dry_runs(run, *dry_run_order(run))  # 4
    run.lap("dry runs")
    if not run.given:  # measure() and a loaded strategy's check time nothing again
        settle_close_call(run)  # 5
        run.lap("close call")
    if not run.given and base is None:  # finetune_strategy: only the loaded strategy's methods
        refine_pick(run, excluded, functools.partial(estimate_one, run, prober=prober, rates=rates))  # 5b
        run.lap("trials on the pick")
    return _answer(run, counts, stopped)  # 6


def _space(run: SearchRun, probe_ctx: ModelContext, excluded, included, base, only, counts: Counter):
    """The candidates (``only`` when given) and the layouts this model cannot run, with why."""
    if only is not None:
        counts["generated"] = len(only)
        return only, []
    layouts = ineligible = None
    with kept():  # the model's structure read once for every layout and candidate (tensor_parallel's plan)
        if base is None:
            first_batch = functools.lru_cache(None)(functools.partial(first_micro_batch, probe_ctx))
            layouts, ineligible = layout_space(run.model, run.device_ctx, run.global_batch,
                                               probe_ctx.model_input_format, excluded, included, first_batch)
        candidates = candidate_space(run.device_ctx, excluded, included, base, layouts, counts, run.model,
                                     run.global_batch)
    counts["generated"] += len(ineligible or [])
    return candidates, ineligible or []


def _rates(run: SearchRun, probe_ctx: ModelContext) -> Rates:
    """Optimizer state per parameter, the step's cost per byte on this device (sharding the
    optimizer state divides it: zero1 on a CPU), and this machine's calibrated rates when `atorch
    calibrate` has measured them, else nominal ones with bf16's speedup over fp32 measured."""
    state_factor = cost.optimizer_state_factor(probe_ctx.optim_func, probe_ctx.optim_args)
    optim_rate = from_rank0(cost.optimizer_seconds_per_byte(probe_ctx.optim_func, probe_ctx.optim_args,
                                                            run.device_ctx.device))
    fused_rate = from_rank0(_fused_optimizer_rate(probe_ctx, run.device_ctx.device))
    if run.options.profile is not None:
        run.rates_text = f"the rates given ({run.options.profile.name})"
        return Rates(state_factor, optim_rate, run.options.profile, fused_optim_rate=fused_rate)
    profile, run.rates_text = cached_rates(run.device_ctx.device, run.device_ctx.world_size)
    if profile is not None:
        return Rates(state_factor, optim_rate, profile, fused_optim_rate=fused_rate)
    # No calibration: bf16's speedup over fp32, which decides whether amp is tried, is measured.
    speedup, where = half_speedup(run.device_ctx.device, run.device_ctx.world_size)
    run.rates_text += f"; bf16's speedup over fp32 measured: {speedup:.2f}x ({where})"
    run.measured_rates = frozenset({"half"})
    return Rates(state_factor, optim_rate, None, speedup, fused_rate)


def _fused_optimizer_rate(probe_ctx: ModelContext, device: torch.device) -> float:
    """The user's optimizer's fused step (fused_optimizer), seconds per byte on this device; 0
    where it has none."""
    from atorch.errors import MethodConfigError
    from atorch.methods.fused_optimizer import optimizer_keywords

    try:
        keywords = optimizer_keywords(probe_ctx.optim_func, "fused")
    except MethodConfigError:
        return 0.0
    return cost.optimizer_seconds_per_byte(probe_ctx.optim_func, {**probe_ctx.optim_args, **keywords}, device)


def _answer(run: SearchRun, counts: Counter, stopped: int) -> tuple[Strategy | None, SearchReport]:
    """The pick and the report of every candidate."""
    results, options = run.results, run.options
    for _, result in results:
        if result.status not in (MEASURED, FAILED):
            result.status = PRUNED
    report = SearchReport(run.device_ctx.world_size, str(run.device_ctx.device.type), options.memory_budget)
    report.global_batch, report.rates = run.global_batch, run.rates_text
    report.candidates = [r for _, r in results]
    report.generated = counts["generated"] + run.trials
    pruned = Counter(r.pruned_by or "other" for r in report.candidates if r.status == PRUNED)
    pruned.update({rule: counts[rule] for rule in ("conflicting", "symmetric", "ineligible") if counts[rule]})
    report.pruned = dict(pruned.most_common())
    report.dry_run = sum(1 for r in report.candidates if r.status in (MEASURED, FAILED))
    if stopped:
        report.stopped = stop.stop_note(stopped, report.dry_run)
    winner = run.refined or pick_winner(results)
    if winner is None and run.timed_out and not any(r.throughput for _, r in results):
        winner = unmeasured_pick(results, options.memory_budget)
        if winner is not None:
            report.note = (f"time_limit of {options.time_limit:g}s reached before any candidate was measured: the "
                           f"simplest strategy estimated to fit is returned unmeasured")
    if winner is not None:
        report.winner = report.candidates.index(winner[1])
        decided = winner
        if run.refined_from is not None:  # the close call decided the pick the trials refined: its tie
            decided = run.refined_from
            report.refined_from = report.candidates.index(decided[1])
        tied = tied_with(results[:len(results) - run.trials], decided)  # among the candidates, not the trials
        report.tied = [report.candidates.index(r) for r in tied] or None
    else:
        report.note = no_winner_note(results, options, run.timed_out)
    report.search_seconds = time.perf_counter() - run.start
    report.stage_seconds = dict(run.stage_seconds)
    report.created = time.time()
    return (None if winner is None else winner[0]), report
