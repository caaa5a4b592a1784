"""The fully automatic search: candidates -> cost model -> dry runs -> the winner."""

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atorch.auto.context import ModelContext
from atorch.auto.environment import DeviceContext
from atorch.auto.plan import each_drop_once, resolve_strategy
from atorch.auto.registry import all_methods, get_method
from atorch.auto.search import cost, stop
from atorch.auto.search.agree import agreed, all_ok, from_rank0, set_timeout
from atorch.auto.search.calibrate import cached_rates
from atorch.auto.search.dryrun import collector_frozen, dry_run
from atorch.auto.search.report import FAILED, MEASURED, PRUNED, CandidateResult, SearchReport, size_text
from atorch.auto.search.share import run_shared
from atorch.auto.search.sidebyside import MAX_TURNS, TURN_STEPS, behind, fits_together, time_side_by_side
from atorch.auto.search.sidebyside import TIE as SIDE_BY_SIDE_TIE
from atorch.auto.search.space import candidate_space, layout_space, layout_text
from atorch.auto.strategy import Strategy
from atorch.distributed.topology import DATA_PARALLEL_DIMS, data_parallel_size
from atorch.errors import AtorchConfigError
from atorch.utils.log import logger, quiet

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
# A candidate is dominated by one that needs no more memory and is estimated this many times
# faster. The step-time estimate (nominal or calibrated rates) orders candidates, it does not
# predict seconds well, so only a wide gap prunes.
DOMINANCE = 2.0
# How long an agreement waits for the slowest rank: AGREEMENT_TIMEOUT_FACTOR x dryrun_timeout +
# AGREEMENT_TIMEOUT_SLACK seconds (see search()).
AGREEMENT_TIMEOUT_FACTOR, AGREEMENT_TIMEOUT_SLACK = 2.0, 60.0
# A method is "slower" than its twin without it when estimated more than this many times slower:
# the estimate's own error between candidates, the early stop's slack (stop.STOP_SLACK: a candidate
# may run 1/0.8 = 1.25x faster than its estimate says, relative to another). At 1.03 (the winner's
# tie tolerance, until 2026-11-26) zero1 on search_quality's BERT, estimated 1.16x slower than plain
# DDP, was pruned unmeasured; side by side it ran 8% faster (picked/best 0.918).
SLOWER_MARGIN = 1 / stop.STOP_SLACK
# Why a candidate was pruned, as counted in the report (SearchReport.pruned).
INELIGIBLE, SYMMETRIC, CONFIG_ERROR, OVER_BUDGET_RULE = "ineligible", "symmetric", "config_error", "over_budget"
MEMORY_ONLY, SLOWER, DOMINATED = "memory_only", "slower", "dominated"
MAX_DRYRUNS, TIME_LIMIT = "max_dryruns", "time_limit"
DUPLICATE = "the same as another candidate on this model (a method in it would change nothing)"
OVER_BUDGET = "estimated peak memory is over the memory budget beyond the estimate's error (x{:g})"


@dataclass
class SearchOptions:
    memory_budget: int
    time_limit: float | None = None
    # A fresh copy's first steps run slow (DDP's buckets, the optimizer's state and fresh pages are
    # allocated): its steps on search_quality's small Llama took 100, 100, 64 and 57 ms.
    warmup_steps: int = 2
    timed_steps: int = 3
    dryrun_timeout: float = 300.0
    max_dryruns: int = 8
    verbose: bool = False
    # The budget is the device's own memory (the user gave none): a dry run that did not run out
    # of memory fits it, even where the peak tracker cannot follow the strategy.
    budget_is_device_memory: bool = False
    # estimated / measured peak memory, lowest and highest (see cost.ESTIMATE_RATIO)
    estimate_ratio: tuple[float, float] = cost.ESTIMATE_RATIO
    # rates to estimate with in place of this machine's cached calibration (calibration itself
    # measures the methods' overheads against estimates at the rates it has just measured)
    profile: Any = None


def estimate_candidate(model, strategy, dp_size, state_factor, probe,
                       device_type: str = "cpu") -> tuple[cost.MemoryEstimate | None, str | None]:
    """The memory estimate of a data-parallel candidate over ``dp_size`` ranks, or the config
    error that rules it out (see :func:`cost_candidate`); ``probe(strategy, flops)`` returns
    activation bytes and appends the forward's FLOPs. ``atorch plan`` uses it."""
    estimate, reason = cost_candidate(model, strategy, {"data": dp_size}, state_factor,
                                      lambda s, flops, dims: (probe(s, flops), 0), device_type)
    return (None if estimate is None else estimate.memory()), reason


def cost_candidate(model, strategy, dims, state_factor, probe, device_type: str = "cpu",
                   optim_seconds_per_byte: float = 0.0, accumulation: int = 1) -> tuple[cost.StepCost | None, str | None]:
    """The candidate's cost (memory and step time), or the config error that rules it out. Any
    other failure leaves the cost unknown: the dry run will meet the failure and record it
    properly. ``probe(strategy, counts, dims)`` returns activation bytes of one forward on a
    per-data-rank batch of the layout ``dims`` and its tokens, and appends its FLOPs (then, when
    counted, its operator count, activation profile, tensors saved through checkpoints and units'
    spans) to ``counts``."""
    try:
        strategy = resolve_strategy(model, strategy)
    except AtorchConfigError as error:
        return None, str(error)
    try:
        counts: list = []
        activations, tokens = probe(strategy, counts, dims)
        # FLOPs, operators, activation profile, tensors through checkpoints, units' spans, FLOPs in
        # attention, bytes the operators without FLOPs move; a probe may count only the FLOPs
        flops, ops, profile, hooked, spans, attention, traffic = (
            counts + [0.0, 0.0, (), 0, (), 0.0, 0.0][len(counts):])
        return cost.build_cost(model, strategy, dims, state_factor, activations, flops, tokens, device_type, ops,
                               optim_seconds_per_byte, profile, hooked, spans, attention, accumulation, traffic), None
    except Exception as error:  # noqa: BLE001
        logger.debug("no estimate for %s: %s", strategy.opt_names, error)
        return None, None


def layout_dims(strategy: Strategy, world_size: int) -> dict[str, int]:
    """parallel_mode's dims of a planned strategy (data over every rank when it has none)."""
    mode = strategy.get("parallel_mode")
    if mode is None or not mode.dims:
        return {"data": world_size}
    return dict(mode.dims)


def _resolved(model: torch.nn.Module, strategy: Strategy) -> Strategy:
    try:
        with quiet():
            return resolve_strategy(model, strategy)
    except Exception:  # noqa: BLE001 - estimate_candidate records a config error; a dry run any other
        return strategy


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
    # A rank that stops answering (stopped, hung, died) makes the others raise AgreementTimeout
    # instead of waiting torch's 30 minutes: a live peer reaches the next agreement within one dry
    # run (its collectives time out after dryrun_timeout; a last step may run past it).
    set_timeout(AGREEMENT_TIMEOUT_FACTOR * options.dryrun_timeout + AGREEMENT_TIMEOUT_SLACK)
    with collector_frozen(), each_drop_once():
        return _search(model, device_ctx, make_context, apply, options, excluded, included, base, only)


def _search(model, device_ctx, make_context, apply, options, excluded, included, base, only):
    start = time.perf_counter()
    report = SearchReport(device_ctx.world_size, str(device_ctx.device.type), options.memory_budget)
    rng = torch.get_rng_state()
    probe_ctx = make_context(model)
    global_batch = int(probe_ctx.dataloader_args.get("batch_size", 1))
    report.global_batch = global_batch
    counts: Counter = Counter()
    ineligible: list = []
    if only is not None:
        candidates = only
        counts["generated"] = len(only)
    else:
        layouts = None
        if base is None:
            layouts, ineligible = layout_space(model, device_ctx, global_batch, probe_ctx.model_input_format,
                                               excluded, included, functools.lru_cache(None)(
                                                   functools.partial(_first_micro_batch, probe_ctx)))
        candidates = candidate_space(device_ctx, excluded, included, base, layouts, counts, model, global_batch)
        counts["generated"] += len(ineligible)
    state_factor = cost.optimizer_state_factor(probe_ctx.optim_func, probe_ctx.optim_args)
    # The step's cost per byte on this device: sharding the optimizer state divides it (zero1 on a CPU).
    optim_rate = from_rank0(cost.optimizer_seconds_per_byte(probe_ctx.optim_func, probe_ctx.optim_args,
                                                            device_ctx.device))
    # This machine's calibrated rates when `atorch calibrate` has measured them, nominal otherwise.
    if options.profile is not None:
        rates, report.rates = options.profile, f"the rates given ({options.profile.name})"
    else:
        rates, report.rates = cached_rates(device_ctx.device, device_ctx.world_size)
    micro_batches: dict[int, object] = {}  # per data-parallel size: the batch one data rank gets

    probes: dict = {}  # cost._probe's memo: one forward per distinct probe (micro_batches keeps the batches)

    def micro_batch(dp_size: int):
        if dp_size not in micro_batches:
            micro_batches[dp_size] = _first_micro_batch(probe_ctx, dp_size)
        return micro_batches[dp_size]

    # Every layout is probed on the smallest per-data-rank batch of the space (the most data
    # ranks), its activations and FLOPs scaled to the layout's batch: what a step keeps per sample
    # grows with the samples, and a layout search probes each method combination once, not once per
    # data-parallel size (search_quality's tensor-best: 12 s of search before, 7 s after).
    probed_dp = max((data_parallel_size(layout_dims(s, device_ctx.world_size)) for s in candidates), default=1)

    def probed_batch(dims: dict[str, int]):
        return micro_batch(max(probed_dp, data_parallel_size(dims)))

    def probe(strategy: Strategy, counts: list, dims: dict[str, int]) -> tuple[int, int]:
        tokens = cost.batch_tokens(micro_batch(data_parallel_size(dims)))
        batch = probed_batch(dims)
        scale = tokens / max(cost.batch_tokens(batch), 1)
        # From the probes the ranks shared out below; one left out there (time_limit) runs here, on every rank.
        counted: list = []
        with quiet():
            saved = cost.activation_bytes(model, strategy, batch, probe_ctx.model_input_format, probe_ctx.loss_func,
                                          device_ctx, counted, memo=probes)
        counts.extend(cost.scaled_counts(counted, scale))
        return int(saved * scale), tokens

    budget, ratio = options.memory_budget, options.estimate_ratio
    results: list[tuple[Strategy, CandidateResult]] = []
    for layout, why in ineligible:
        results.append((layout.strategy(), CandidateResult(layout.strategy().to_dict(), reason=why,
                                                           layout=layout.text, pruned_by=INELIGIBLE)))
    timed_out = False  # the time_limit cut something short (the report's note says so only then)
    estimate_seconds: dict[int, float] = {}  # id(strategy) -> seconds its estimate took (agreed)
    ratios: dict[int, tuple[float, float]] = {}  # id(result) -> its estimate's error bounds

    def past_limit() -> bool:  # on this rank's clock: rank 0's decides, through an agreement
        return options.time_limit is not None and time.perf_counter() - start >= options.time_limit

    def out_of_time() -> bool:
        return from_rank0(past_limit())

    # As planned for this model (a method that would change nothing on it is dropped), so the
    # report names what would run, and candidates that are the same here run once.
    candidates = [_resolved(model, strategy) for strategy in candidates]
    # The ranks share the probes out (each probe gives the same answer on every rank), candidates
    # in order; a probe slower than dryrun_timeout on the rank that ran it fails its candidates.
    probe_keys, probe_seconds = _share_probes(model, candidates, probed_batch, probe_ctx, device_ctx, probes,
                                              out_of_time)
    late = out_of_time()  # then learnt with each candidate's agreement (one collective a candidate)

    for strategy in candidates:
        dims = layout_dims(strategy, device_ctx.world_size)
        text = layout_text(dims.items(), _layout_config(strategy))
        if any(s == strategy for s, _ in results):
            results.append((strategy, CandidateResult(strategy.to_dict(), reason=DUPLICATE, layout=text,
                                                      pruned_by=SYMMETRIC)))
            continue
        saver = None if only is not None else _memory_only_twin_fits(strategy, results, ratios, budget, ratio)
        if saver is not None:  # what _prune_twins would prune, not estimated (nor probed) at all
            results.append((strategy, CandidateResult(strategy.to_dict(), reason=_memory_only_reason(saver),
                                                      layout=text, pruned_by=MEMORY_ONLY)))
            continue
        if results and late:
            timed_out = True
            results.append((strategy, CandidateResult(strategy.to_dict(), reason="not estimated: time_limit reached",
                                                      layout=text, pruned_by=TIME_LIMIT)))
            continue
        began = time.perf_counter()
        estimate, reason = cost_candidate(model, strategy, dims, state_factor, probe, device_ctx.device.type,
                                          optim_rate)
        if estimate is not None:
            estimate.profile = rates
        memory = None if estimate is None else estimate.memory()
        # Decisions use agreed values only, so every rank prunes and runs the same candidates: rank
        # 0's reason and whether its clock is past the time limit, the largest peak and step time
        # (none where a rank has no estimate), the slowest rank's seconds, all in one agreement.
        (reason, late), total, step_seconds, estimate_seconds[id(strategy)] = agreed(
            (reason, past_limit()), None if memory is None else memory.total,
            None if estimate is None else estimate.seconds(),
            time.perf_counter() - began + sum(probe_seconds.get(key, 0.0) for key in probe_keys.get(id(strategy), ())))
        result = CandidateResult(strategy.to_dict(), reason=reason, layout=text)
        if result.reason is not None:
            result.pruned_by = CONFIG_ERROR
        ratios[id(result)] = cost.candidate_ratio(ratio, estimate)
        if result.reason is None and estimate_seconds[id(strategy)] > options.dryrun_timeout:
            # dryrun_timeout bounds the whole candidate: a forward this slow cannot finish a dry run.
            result.status, result.seconds = FAILED, estimate_seconds[id(strategy)]
            result.reason = (f"its memory-estimate forward took {result.seconds:.1f}s, over dryrun_timeout="
                             f"{options.dryrun_timeout:g}s (raise dryrun_timeout if this step is meant to be slow)")
        if total is not None:
            result.estimated_peak_bytes = int(total)
            result.estimate_breakdown = memory.as_dict()
            result.estimated_step_seconds = step_seconds
            result.estimate_overheads = estimate.overhead_units() if estimate is not None else None
            # Only what is over the budget beyond the estimate's known error is pruned: a
            # candidate near the boundary is dry-run, and its measured peak decides.
            if result.reason is None and cost.surely_over(result.estimated_peak_bytes, budget, ratio):
                result.reason, result.pruned_by = OVER_BUDGET.format(ratio[1]), OVER_BUDGET_RULE
        results.append((strategy, result))

    def surely(result) -> bool:
        """Within the budget even at the low end of its estimate's known error."""
        return cost.surely_fits(result.estimated_peak_bytes, budget, ratios.get(id(result), ratio))

    # Strategies sure to fit: by their estimate now, and each dry run that measures a fit adds its own.
    fits = {id(s) for s, r in results if r.reason is None and surely(r)}
    if only is None:
        # A twin that may not fit (near the boundary, or not estimated) prunes nothing.
        _prune_twins(results, fits)
        _prune_dominated(results)

    # Dry runs go in order of estimated step time (fastest first, the simpler on a tie; those with
    # no estimate last, since their probe failed), so max_dryruns and time_limit cut the least
    # promising candidates.
    runnable = [(s, r) for s, r in results if r.reason is None]
    runnable.sort(key=lambda item: (item[1].estimated_step_seconds is None,
                                    round(item[1].estimated_step_seconds or 0.0, 9), len(item[0])))
    to_run = runnable[: options.max_dryruns]
    kept = 0  # slots at the end of to_run kept for a candidate sure to fit
    if to_run and not any(surely(r) for _, r in to_run):
        # Near-boundary candidates may all measure over the budget: the last slot goes to the
        # fastest candidate sure to fit, when there is one, so max_dryruns never leaves the
        # search without an answer that was there.
        safe = next(((s, r) for s, r in runnable[len(to_run):] if surely(r)), None)
        if safe is not None:
            to_run = to_run[:-1] + [safe]
            kept = 1
    baseline = next(((s, r) for s, r in runnable if _is_baseline(s, device_ctx.world_size)), None)
    if only is None and baseline is not None and baseline not in to_run and len(to_run) - kept >= 2 \
            and surely(baseline[1]):
        # Plain data parallelism, the job as the user wrote it, is measured whenever it surely
        # fits, so an estimate alone never makes the answer slower than it (on search_quality's
        # small Llama it was estimated 14% slower than zero1 and measured as fast). It takes the
        # last slot not kept for a candidate sure to fit.
        last = len(to_run) - 1 - kept
        to_run = to_run[:last] + [baseline] + to_run[last + 1:]
    # Past them, in order, the candidates that take the slot of one the dry runs so far prune
    # (cannot fit, cannot win, a twin measured to fit): max_dryruns counts dry runs, not places.
    reserve = [item for item in runnable if item not in to_run]
    last_seconds = 0.0

    def time_left() -> float | None:
        return None if options.time_limit is None else options.time_limit - (time.perf_counter() - start)

    def measure(strategy: Strategy, result, steps: int, timeout: float, remaining: float | None) -> dict:
        """One dry run of ``steps`` timed steps, stopped at the time limit; its seconds are added to
        the candidate's, and the next candidate starts only if one as long fits the time left."""
        nonlocal last_seconds
        with quiet():
            outcome = dry_run(model, strategy, make_context, apply, options.warmup_steps, steps, timeout, global_batch,
                              stop_after_s=None if remaining is None else from_rank0(remaining))
        last_seconds = outcome["seconds"]
        result.seconds = (result.seconds or 0.0) + outcome["seconds"]
        return outcome

    stopped = 0  # candidates left that the estimate's measured error says cannot win
    ran = 0
    for strategy, result in [*to_run, *reserve]:
        if ran >= options.max_dryruns:
            result.reason, result.pruned_by = f"not dry-run: max_dryruns={options.max_dryruns} reached", MAX_DRYRUNS
            continue
        if only is None:
            # A twin measured to fit proves what its estimate could not: the twin rules apply again.
            _prune_twins(results, fits, pending={id(result)})
            if result.reason is not None:
                continue
            # The estimate's error as the dry runs so far measured it: a candidate that cannot fit
            # the budget, or cannot beat the best measured step, is not dry-run (fastest estimate first).
            so_far = [r for _, r in results]
            why = None if options.budget_is_device_memory else stop.check_fit(result, so_far, budget)
            if why is not None:
                result.reason, result.pruned_by = why, stop.CANNOT_FIT
                continue
            why = stop.check(result, so_far, global_batch)
            if why is not None:
                result.reason, result.pruned_by = why, stop.CANNOT_WIN
                stopped += 1
                continue
        # Rank 0's clock decides for everyone. A candidate starts only if one like the last fits
        # in the time left, and its timed steps stop at the limit: time_limit is a promise.
        remaining = time_left()
        if not from_rank0(remaining is None or remaining >= last_seconds):
            timed_out = True
            result.reason = f"not dry-run: time_limit of {options.time_limit:g}s would be exceeded"
            result.pruned_by = TIME_LIMIT
            continue
        ran += 1
        slots = min(options.max_dryruns, len(to_run) + len(reserve))
        bar = "#" * ran + "-" * max(0, slots - ran)
        _say(options, f"search [{bar}] {ran}/{slots}: dry-running {' + '.join(strategy.opt_names) or '(plain)'}")
        outcome = measure(strategy, result, options.timed_steps,
                          options.dryrun_timeout - estimate_seconds.get(id(strategy), 0.0), remaining)
        if outcome["reason"] is not None:
            result.status, result.reason = FAILED, outcome["reason"]
            continue
        _record(result, outcome, global_batch)
        if outcome["timed_steps"] < options.timed_steps:
            timed_out = True
            result.reason = f"time_limit: measured over {outcome['timed_steps']} of {options.timed_steps} steps"
        result.measured_peak_bytes = outcome["measured_peak_bytes"]
        _judge(result, options)
        if result.status == MEASURED and result.measured_peak_bytes is not None:
            fits.add(id(strategy))
    if stopped:
        report.stopped = stop.stop_note(stopped, sum(1 for _, r in results if r.status in (MEASURED, FAILED)))
    # measure() (only) and a search past its time limit time nothing again
    no_retiming = only is not None or timed_out
    close = [] if no_retiming else _close_call(results)
    if close:
        # the close call settled side by side; where its copies cannot be alive together on every
        # rank, or it does not fit the time left, or fails, they are timed again one by one (below)
        need = sum(r.seconds + (MAX_TURNS * TURN_STEPS - options.timed_steps) * global_batch / r.throughput
                   for _, r in close)
        remaining = time_left()
        fits = all_ok(fits_together([r.measured_peak_bytes for _, r in close], device_ctx.device,
                                    device_ctx.local_world_size))
        if fits and from_rank0(remaining is None or remaining >= need):
            no_retiming = _side_by_side(model, close, make_context, apply, options, global_batch)
    for round_ in range(RETIME_ROUNDS):
        close = [] if no_retiming else _close_call(results)
        if not close:
            break  # no close call, out of time, or the readings so far set the candidates apart
        # the slowest to the best, then the best to the slowest, ...
        for strategy, result in close if round_ % 2 == 0 else close[::-1]:
            # Timed again over as many steps; the throughput is the median of the readings, the
            # peak their largest, judged again.
            remaining = time_left()
            if not from_rank0(remaining is None or remaining >= last_seconds):
                no_retiming = True
                break
            _say(options, f"search: timing {' + '.join(strategy.opt_names) or '(plain)'} again (a close call)")
            outcome = measure(strategy, result, options.timed_steps, options.dryrun_timeout, remaining)
            if outcome["reason"] is not None or outcome["timed_steps"] < options.timed_steps:
                continue  # the readings so far stand
            result.throughputs = [*(result.throughputs or [result.throughput]), _reading(outcome, global_batch)]
            _record(result, outcome, global_batch)
            peaks = [p for p in (result.measured_peak_bytes, outcome["measured_peak_bytes"]) if p is not None]
            result.measured_peak_bytes = max(peaks) if peaks else None
            _judge(result, options)
    for _, result in results:
        if result.status not in (MEASURED, FAILED):
            result.status = PRUNED

    report.candidates = [r for _, r in results]
    report.generated = counts["generated"]
    pruned = Counter(r.pruned_by or "other" for r in report.candidates if r.status == PRUNED)
    pruned.update({rule: counts[rule] for rule in ("conflicting", "symmetric", "ineligible") if counts[rule]})
    report.pruned = dict(pruned.most_common())
    report.dry_run = sum(1 for r in report.candidates if r.status in (MEASURED, FAILED))
    winner = _pick_winner(results)
    if winner is None and timed_out and not any(r.throughput for _, r in results):
        # Out of time before any measurement: the simplest candidate that fits the budget even at
        # the lowest estimated / measured ever seen is the safe answer, and the report says it
        # was not measured.
        safe = [(s, r) for s, r in results
                if r.status != FAILED and cost.fits_unmeasured(r.estimated_peak_bytes, budget)]
        winner = min(safe, key=lambda item: len(item[0]), default=None)
        if winner is not None:
            report.note = (f"time_limit of {options.time_limit:g}s reached before any candidate was measured: the "
                           f"simplest strategy estimated to fit is returned unmeasured")
    report.winner = None if winner is None else [r for _, r in results].index(winner[1])
    if winner is not None:
        report.tied = [[r for _, r in results].index(r) for r in _tied(results, winner)] or None
    report.search_seconds = time.perf_counter() - start
    report.created = time.time()
    if winner is None:
        report.note = _no_winner_note(results, options, timed_out)
    torch.set_rng_state(rng)  # the search does not change the user's random stream
    return (None if winner is None else winner[0]), report


def _share_probes(model, candidates: list[Strategy], probed_batch, probe_ctx: ModelContext, device_ctx, memo: dict,
                  out_of_time) -> tuple[dict[int, list], dict]:
    """Run the probes ``candidates`` need over the ranks into ``memo`` (:func:`share.run_shared`).
    Returns the probes' keys per candidate (by ``id``) and each probe's seconds."""
    keys: dict[int, list] = {}
    jobs: dict = {}
    for strategy in candidates:
        try:
            with quiet():
                planned = resolve_strategy(model, strategy)
        except Exception:  # noqa: BLE001 - a config error: the candidate's estimate records it
            continue
        batch = probed_batch(layout_dims(strategy, device_ctx.world_size))
        keys[id(strategy)] = []
        for stages in cost.probe_stages(planned):
            key = cost.probe_key(planned, batch, stages)
            keys[id(strategy)].append(key)
            jobs.setdefault(key, functools.partial(cost.probe_once, model, planned, batch, probe_ctx.model_input_format,
                                                   probe_ctx.loss_func, device_ctx, stages))
    with quiet():
        return keys, run_shared(list(jobs.items()), memo, out_of_time)


def _is_baseline(strategy: Strategy, world_size: int) -> bool:
    """Plain data parallelism over every rank (or the plain model on one): no other method."""
    return all(name == "parallel_mode" for name in strategy.opt_names) and all(
        name in DATA_PARALLEL_DIMS for name in layout_dims(strategy, world_size))


def _layout_config(strategy: Strategy) -> dict | None:
    """The config of the strategy's layout method (its microbatches show in the layout's text)."""
    for name, config in strategy.items():
        if get_method(name).layouts is not None:
            return config.model_dump()
    return None


def _prune_twins(results, fits: set[int], pending: set[int] | None = None) -> None:
    """Prune a candidate when the same strategy less one of its methods surely fits the budget
    (its ``id`` in ``fits``: by its estimate, or by a dry run's measured peak) and that method
    cannot pay for itself: it only saves memory (``memory_only`` in the registry), or it is
    estimated to slow this step (``_slower_by``). ``pending`` (ids of results) limits the pruning
    to candidates that have not run."""
    for strategy, result in results:
        if result.reason is not None or (pending is not None and id(result) not in pending):
            continue
        for name in strategy.opt_names:
            without = strategy.without(name)
            twin = next(((s, r) for s, r in results if s == without), None)
            if twin is None or id(twin[0]) not in fits:
                continue
            if get_method(name).memory_only:
                result.reason, result.pruned_by = _memory_only_reason(name), MEMORY_ONLY
                break
            slower = _slower_by(result, twin[1])
            if slower is not None and get_method(name).layouts is None:
                result.reason = (f"{name} is estimated to make the step {slower:.2f}x slower here, and the same "
                                 f"strategy without it fits the budget")
                result.pruned_by = SLOWER
                break


def _memory_only_reason(name: str) -> str:
    return f"{name} only saves memory, and the same strategy without it fits the budget"


def _memory_only_twin_fits(strategy: Strategy, results, ratios: dict, budget: int, ratio) -> str | None:
    """A method of ``strategy`` that only saves memory (checkpoint, gradient_accumulation) whose
    twin, the strategy without it, already surely fits by its estimate: then ``strategy`` cannot
    win and need not be estimated. Candidates come simplest first, so the twin came before."""
    for name in strategy.opt_names:
        if not get_method(name).memory_only:
            continue
        without = strategy.without(name)
        twin = next((r for s, r in results if s == without), None)
        if twin is not None and twin.reason is None and twin.estimated_peak_bytes is not None \
                and cost.surely_fits(twin.estimated_peak_bytes, budget, ratios.get(id(twin), ratio)):
            return name
    return None


def _slower_by(result, twin) -> float | None:
    """How many times slower ``result`` is estimated than ``twin`` (the same strategy less one
    method), when it is; None when it is not, or either has no estimate. One method's own time
    term is all that differs between the two, so its sign is more trustworthy than a comparison
    across layouts, which needs DOMINANCE (e.g. bf16 autocast on a CPU: casts, no faster matmul)."""
    if result.estimated_step_seconds is None or not twin.estimated_step_seconds:
        return None
    slower = result.estimated_step_seconds / twin.estimated_step_seconds
    # Each candidate's FLOPs come from its own probe: a method with no time term of its own may
    # differ from its twin by how the FLOPs were counted, which is not a slower step.
    return slower if slower > SLOWER_MARGIN else None


def _prune_dominated(results) -> None:
    """Prune a candidate when another one needs no more memory and is estimated at least
    DOMINANCE times faster: the first fits wherever the second does, and the step-time estimate
    is not that far off (docs/search.md)."""
    live = [(s, r) for s, r in results if r.reason is None and r.estimated_step_seconds is not None
            and r.estimated_peak_bytes is not None]
    for _, result in live:
        for other_strategy, other in live:
            if other is result or other.reason is not None:
                continue
            if (other.estimated_peak_bytes <= result.estimated_peak_bytes
                    and other.estimated_step_seconds * DOMINANCE < result.estimated_step_seconds):
                names = " + ".join(other_strategy.opt_names) or "(plain)"
                result.reason = (f"dominated by {names} ({other.layout}): no more memory and estimated "
                                 f"{result.estimated_step_seconds / other.estimated_step_seconds:.1f}x faster")
                result.pruned_by = DOMINATED
                break


def _first_micro_batch(ctx: ModelContext, dp_size: int):
    from atorch.data.loader import build_dataloader

    loader = build_dataloader(ctx.dataset, ctx.dataloader_args, dp_size, 0, ctx.distributed_sampler_cls, ctx.sampler_seed)
    return next(iter(loader))


def _judge(result, options: SearchOptions) -> None:
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


def _no_winner_note(results, options: SearchOptions, timed_out: bool) -> str:
    """Why nothing came back: what was tried, the smallest candidate, and what would make it fit."""
    from collections import Counter

    budget = options.memory_budget
    ran = [r for _, r in results if r.status in (MEASURED, FAILED)]
    pruned = Counter(r.reason for _, r in results if r.status == PRUNED)
    over = sum(1 for r in ran if r.measured_peak_bytes and r.measured_peak_bytes > budget)
    tried = f"{len(ran)} dry-run ({over} measured over the budget), " + (", ".join(f"{n} pruned ({why})" for why, n in pruned.most_common())
                                       or "none pruned")
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
    peak, how, smallest = min(peaks, key=lambda item: item[0])
    names = " + ".join(smallest.names) or "(plain)"
    # Memory-saving methods no candidate used (excluded, or not runnable here) could help.
    unused = [s.name for s in all_methods() if (s.saves_memory or s.memory_only) and s.search_space
              and not any(s.name in r.names for _, r in results)]
    helps = "more ranks or a smaller batch per rank" + (f", or allowing {', '.join(unused)}" if unused else "")
    if how == "estimated":
        how = f"estimated (up to x{options.estimate_ratio[1]:g} high)"
    fit = (f"it would fit a larger memory budget (>= {size_text(peak)})" if peak > budget
           else "that is within the budget, but it did not run (see its reason)")
    return (f"{lead}; tried: {tried}; the smallest is {names}, {how} peak {size_text(peak)}: {fit}; {helps} "
            "would lower the peak")


def _close_call(results) -> list:
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


def _side_by_side(model, close: list, make_context, apply, options: SearchOptions, global_batch: int) -> bool:
    """Time the close call's candidates side by side (sidebyside.py): each keeps its samples/s
    there (``side_by_side``), which then decides. Whether it ran."""
    names = ", ".join(" + ".join(s.opt_names) or "(plain)" for s, _ in close)
    _say(options, f"search: timing {names} side by side (a close call)")
    with quiet():
        outcome = time_side_by_side(model, [s for s, _ in close], make_context, apply, options.warmup_steps,
                                    options.dryrun_timeout)
    if outcome["reason"] is not None:
        logger.info("timing the close call side by side failed (%s); timing its candidates again one by one",
                    outcome["reason"])
        return False
    for (_, result), turns in zip(close, outcome["turn_seconds"]):
        result.side_by_side = global_batch / statistics.median(turns)
        result.side_by_side_seconds = turns
    return True


def _record(result, outcome: dict, global_batch: int) -> None:
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


def _reading(outcome: dict, global_batch: int) -> float:
    """One dry run's throughput as :func:`_record` reads a candidate's first: its median step's."""
    steps = [t for t in outcome.get("step_seconds") or () if t > 0]
    return global_batch / statistics.median(steps) if steps else outcome["throughput"]


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


def _side_by_side_tie_rule(item) -> tuple:
    """A tie side by side goes to the lower measured peak (as fast, more memory left), then to
    fewer methods, then to the faster there (sidebyside.TIE says why not fewer methods first)."""
    strategy, result = item
    peak = result.measured_peak_bytes if result.measured_peak_bytes is not None else float("inf")
    return peak, len(strategy), -result.side_by_side


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
    over sidebyside.NEAR behind on the turns all had taken; its median, over fewer and earlier
    turns, is not compared with theirs (a change in the machine's load after it stopped would
    move theirs and not its)."""
    together = [(s, r) for s, r in results if r.status == MEASURED and r.side_by_side]
    if len(together) < 2:
        return []
    most = max(len(r.side_by_side_seconds or ()) for _, r in together)
    return [(s, r) for s, r in together if len(r.side_by_side_seconds or ()) == most]


def _tied_set(results) -> list:
    together = _timed_together(results)
    if together:  # side by side, only a difference within the tolerance (turn by turn) is a tie
        ratios = behind([r.side_by_side_seconds for _, r in together])
        return [item for item, ratio in zip(together, ratios) if ratio <= 1 + SIDE_BY_SIDE_TIE]
    measured = [(s, r) for s, r in results if r.status == MEASURED and r.throughput]
    if not measured:
        return []
    best = max(measured, key=lambda item: item[1].throughput)[1]
    return [(s, r) for s, r in measured if _ties_with(r, best)]


def _pick_winner(results):
    measured = [(s, r) for s, r in results if r.status == MEASURED]
    if not measured:
        return None
    if _timed_together(results):
        return min(_tied_set(results), key=_side_by_side_tie_rule)
    tied = _clearly_faster(_tied_set(results) or measured)
    return min(tied, key=_tie_rule)  # min keeps the first of equals: the order of generation


def _tied(results, winner) -> list:
    """The other measured candidates the winner was tied with (it won by the tie rule)."""
    return [r for s, r in _tied_set(results) if r is not winner[1]]
