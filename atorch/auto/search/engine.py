"""The fully automatic search: candidates -> cost model -> dry runs -> the winner."""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atorch.auto.context import ModelContext
from atorch.auto.environment import DeviceContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.registry import get_method
from atorch.auto.search import cost
from atorch.auto.search.agree import from_rank0, max_over_ranks
from atorch.auto.search.dryrun import dry_run
from atorch.auto.search.report import FAILED, MEASURED, PRUNED, CandidateResult, SearchReport
from atorch.auto.search.space import candidate_space
from atorch.auto.strategy import Strategy
from atorch.errors import AtorchConfigError
from atorch.utils.log import logger, quiet

# Throughputs within this fraction of the best count as a tie, won by the simpler strategy.
TIE_TOLERANCE = 0.03


@dataclass
class SearchOptions:
    memory_budget: int
    time_limit: float | None = None
    warmup_steps: int = 1
    timed_steps: int = 3
    dryrun_timeout: float = 300.0
    max_dryruns: int = 8
    verbose: bool = False


def estimate_candidate(model, strategy, dp_size, state_factor, probe) -> tuple[cost.MemoryEstimate | None, str | None]:
    """The estimate, or the config error that rules the candidate out. Any other failure leaves
    the estimate unknown: the dry run will meet the failure and record it properly.
    ``probe(strategy, flops)`` returns activation bytes and appends the forward's FLOPs."""
    try:
        strategy = resolve_strategy(model, strategy)
    except AtorchConfigError as error:
        return None, str(error)
    try:
        flops: list = []
        estimate = cost.estimate_memory(model, strategy, dp_size, state_factor, probe(strategy, flops))
        estimate.forward_flops = flops[0] if flops else 0
        return estimate, None
    except Exception as error:  # noqa: BLE001
        logger.debug("no memory estimate for %s: %s", strategy.opt_names, error)
        return None, None


def _say(options: SearchOptions, message: str) -> None:
    if options.verbose:
        logger.info(message)


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
    start = time.perf_counter()
    report = SearchReport(device_ctx.world_size, str(device_ctx.device.type), options.memory_budget)
    rng = torch.get_rng_state()
    candidates = only if only is not None else candidate_space(device_ctx, excluded, included, base)

    probe_ctx = make_context(model)
    dp_size = device_ctx.world_size  # the search's candidates are data parallel over every rank
    global_batch = int(probe_ctx.dataloader_args.get("batch_size", 1))
    micro = _first_micro_batch(probe_ctx, dp_size)
    state_factor = cost.optimizer_state_factor(probe_ctx.optim_func, probe_ctx.optim_args)

    def probe(strategy: Strategy, flops: list) -> int:
        with quiet():
            return cost.activation_bytes(model, strategy, micro, probe_ctx.model_input_format, probe_ctx.loss_func,
                                         device_ctx, flops)

    results: list[tuple[Strategy, CandidateResult]] = []
    def out_of_time() -> bool:
        late = options.time_limit is not None and time.perf_counter() - start >= options.time_limit
        return from_rank0(late)

    for strategy in candidates:
        if results and out_of_time():
            results.append((strategy, CandidateResult(strategy.to_dict(), reason="not estimated: time_limit reached")))
            continue
        estimate, reason = estimate_candidate(model, strategy, dp_size, state_factor, probe)
        # Decisions use agreed values only, so every rank prunes and runs the same candidates.
        result = CandidateResult(strategy.to_dict(), reason=from_rank0(reason))
        total = max_over_ranks(None if estimate is None else estimate.total)
        if total is not None:
            result.estimated_peak_bytes = int(total)
            result.estimate_breakdown = estimate.as_dict()
            step = cost.estimate_step_seconds(model, strategy, dp_size, estimate.forward_flops, device_ctx.device.type)
            result.estimated_step_seconds = max_over_ranks(step)
            if result.reason is None and result.estimated_peak_bytes > options.memory_budget:
                result.reason = "estimated peak memory is over the memory budget"
        results.append((strategy, result))

    fits = {id(s) for s, r in results if r.reason is None}
    for strategy, result in results:
        if result.reason is not None or only is not None:
            continue
        for name in strategy.opt_names:
            twin = strategy.without(name)
            twin_entry = next(((s, r) for s, r in results if s == twin), None)
            if get_method(name).memory_only and twin_entry is not None and id(twin_entry[0]) in fits:
                result.reason = f"{name} only saves memory, and the same strategy without it fits the budget"
                break

    # Dry runs go in order of estimated step time (fastest first, the simpler on a tie), so a
    # time_limit cuts the least promising candidates.
    runnable = [(s, r) for s, r in results if r.reason is None]
    runnable.sort(key=lambda item: (round(item[1].estimated_step_seconds or 0.0, 9), len(item[0])))
    to_run = runnable[: options.max_dryruns]
    for s, r in results:
        if r.reason is None and (s, r) not in to_run:
            r.reason = f"not dry-run: max_dryruns={options.max_dryruns} reached"
    last_seconds = 0.0
    for index, (strategy, result) in enumerate(to_run, 1):
        # Rank 0's clock decides for everyone. A candidate starts only if one like the last fits
        # in the time left, and its timed steps stop at the limit: time_limit is a promise.
        remaining = None if options.time_limit is None else options.time_limit - (time.perf_counter() - start)
        go = from_rank0(remaining is None or remaining >= last_seconds)
        if not go:
            result.reason = f"not dry-run: time_limit of {options.time_limit:g}s would be exceeded"
            continue
        stop_after = None if remaining is None else from_rank0(remaining)
        bar = "#" * index + "-" * (len(to_run) - index)
        _say(options, f"search [{bar}] {index}/{len(to_run)}: dry-running {' + '.join(strategy.opt_names) or '(plain)'}")
        with quiet():
            outcome = dry_run(model, strategy, make_context, apply, options.warmup_steps, options.timed_steps,
                              options.dryrun_timeout, global_batch, stop_after_s=stop_after)
        last_seconds = outcome["seconds"]
        result.seconds = outcome["seconds"]
        if outcome["reason"] is not None:
            result.status, result.reason = FAILED, outcome["reason"]
            continue
        result.throughput = outcome["throughput"]
        if outcome["timed_steps"] < options.timed_steps:
            result.reason = f"time_limit: measured over {outcome['timed_steps']} of {options.timed_steps} steps"
        result.measured_peak_bytes = outcome["measured_peak_bytes"]
        if result.measured_peak_bytes is not None and result.measured_peak_bytes > options.memory_budget:
            result.status, result.reason = FAILED, "measured peak memory is over the memory budget"
        else:
            result.status = MEASURED
    for _, result in results:
        if result.status not in (MEASURED, FAILED):
            result.status = PRUNED

    report.candidates = [r for _, r in results]
    winner = _pick_winner(results)
    if winner is None and options.time_limit is not None and results and results[0][1].status != FAILED:
        # Out of time before any measurement: the simplest candidate (plain data parallel) is
        # the safe answer, and the report says it was not measured.
        winner = results[0]
        report.note = "time_limit reached before any candidate was measured: the simplest strategy is returned unmeasured"
    report.winner = None if winner is None else [r for _, r in results].index(winner[1])
    report.search_seconds = time.perf_counter() - start
    if winner is None:
        report.note = "no candidate could be measured within the limits"
    torch.set_rng_state(rng)  # the search does not change the user's random stream
    return (None if winner is None else winner[0]), report


def _first_micro_batch(ctx: ModelContext, dp_size: int):
    from atorch.data.loader import build_dataloader

    loader = build_dataloader(ctx.dataset, ctx.dataloader_args, dp_size, 0, ctx.distributed_sampler_cls, ctx.sampler_seed)
    return next(iter(loader))


def _pick_winner(results):
    measured = [(s, r) for s, r in results if r.status == MEASURED]
    if not measured:
        return None
    best = max(r.throughput for _, r in measured)
    # Simplest first: candidates are generated in order of size, so the first near-best is simplest.
    close = [(s, r) for s, r in measured if r.throughput >= best * (1 - TIE_TOLERANCE)]
    return min(close, key=lambda item: len(item[0]))
