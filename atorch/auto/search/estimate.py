"""Stage 2 of the search: each candidate's estimate (peak memory and step time) before anything
runs, from one probe of the model per distinct combination of methods, shared out over the ranks;
a candidate the same as one before it, one whose memory-only method is not needed, one its
planner refuses (config error) and one surely over the budget are decided here."""

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

from atorch.auto.context import ModelContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.registry import get_method
from atorch.auto.search import cost
from atorch.auto.search.agree import agreed
from atorch.auto.search.candidate import (
    CONFIG_ERROR,
    DUPLICATE,
    FAILED,
    INELIGIBLE,
    MEMORY_ONLY,
    OVER_BUDGET,
    OVER_BUDGET_RULE,
    SYMMETRIC,
    TIME_LIMIT,
    CandidateResult,
)
from atorch.auto.search.prune import memory_only_reason, memory_only_twin_fits
from atorch.auto.search.share import run_shared
from atorch.auto.search.space import layout_text, method_labels
from atorch.auto.search.state import SearchRun
from atorch.auto.strategy import Strategy
from atorch.distributed.topology import data_parallel_size
from atorch.errors import AtorchConfigError
from atorch.utils.log import logger, quiet


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
        # attention, bytes the operators without FLOPs move (and of them those a tensor rank moves
        # whole), FLOPs a checkpoint recomputes (and of them attention's); a probe may count only
        # the FLOPs
        flops, ops, profile, hooked, spans, attention, traffic, whole, recomputed, again = (
            counts + [0.0, 0.0, (), 0, (), 0.0, 0.0, 0.0, 0.0, 0.0][len(counts):])
        return cost.build_cost(model, strategy, dims, state_factor, activations, flops, tokens, device_type, ops,
                               optim_seconds_per_byte, profile, hooked, spans, attention, accumulation, traffic,
                               whole, recomputed, again), None
    except Exception as error:  # noqa: BLE001
        logger.debug("no estimate for %s: %s", strategy.opt_names, error)
        return None, None


def layout_dims(strategy: Strategy, world_size: int) -> dict[str, int]:
    """parallel_mode's dims of a planned strategy (data over every rank when it has none)."""
    mode = strategy.get("parallel_mode")
    if mode is None or not mode.dims:
        return {"data": world_size}
    return dict(mode.dims)


def layout_config(strategy: Strategy) -> dict | None:
    """The config of the strategy's layout method (its microbatches show in the layout's text)."""
    for name, config in strategy.items():
        if get_method(name).layouts is not None:
            return config.model_dump()
    return None


def resolved(model: torch.nn.Module, strategy: Strategy) -> Strategy:
    """``strategy`` as planned for ``model`` (a method that would change nothing on it is dropped),
    so the report names what would run, and candidates that are the same here run once."""
    try:
        with quiet():
            return resolve_strategy(model, strategy)
    except Exception:  # noqa: BLE001 - estimate_candidate records a config error; a dry run any other
        return strategy


def first_micro_batch(ctx: ModelContext, dp_size: int):
    """The batch one of ``dp_size`` data ranks gets at the job's first step."""
    from atorch.data.loader import build_dataloader

    loader = build_dataloader(ctx.dataset, ctx.dataloader_args, dp_size, 0, ctx.distributed_sampler_cls, ctx.sampler_seed)
    return next(iter(loader))


class Prober:
    """The probes of one search: one forward and backward of a copy of the model per distinct
    combination of methods, on the first batch of a data rank, remembered.

    Every layout is probed on the smallest per-data-rank batch of the space (the most data
    ranks), its activations and FLOPs scaled to the layout's batch: what a step keeps per sample
    grows with the samples, and a layout search probes each method combination once, not once per
    data-parallel size (search_quality's tensor-best: 12 s of search before, 7 s after)."""

    def __init__(self, run: SearchRun, probe_ctx: ModelContext, candidates: list[Strategy]):
        self.run, self.ctx = run, probe_ctx
        self.batches: dict[int, object] = {}  # per data-parallel size: the batch one data rank gets
        self.memo: dict = {}  # cost._probe's memo: one forward per distinct probe
        world = run.device_ctx.world_size
        self.probed_dp = max((data_parallel_size(layout_dims(s, world)) for s in candidates), default=1)
        self.keys: dict[int, list] = {}  # id(strategy) -> the keys of its probes
        self.seconds: dict = {}  # each probe's seconds, on the rank that ran it

    def micro_batch(self, dp_size: int):
        if dp_size not in self.batches:
            self.batches[dp_size] = first_micro_batch(self.ctx, dp_size)
        return self.batches[dp_size]

    def probed_batch(self, dims: dict[str, int]):
        return self.micro_batch(max(self.probed_dp, data_parallel_size(dims)))

    def __call__(self, strategy: Strategy, counts: list, dims: dict[str, int]) -> tuple[int, int]:
        """``cost_candidate``'s probe: activation bytes and tokens of the layout's batch."""
        tokens = cost.batch_tokens(self.micro_batch(data_parallel_size(dims)))
        batch = self.probed_batch(dims)
        scale = tokens / max(cost.batch_tokens(batch), 1)
        # From the probes the ranks shared out; one left out there (time_limit) runs here, on every rank.
        counted: list = []
        with quiet():
            saved = cost.activation_bytes(self.run.model, strategy, batch, self.ctx.model_input_format,
                                          self.ctx.loss_func, self.run.device_ctx, counted, memo=self.memo)
        counts.extend(cost.scaled_counts(counted, scale))
        return int(saved * scale), tokens

    def share(self, candidates: list[Strategy]) -> None:
        """Run the probes ``candidates`` need over the ranks (:func:`share.run_shared`), candidates
        in order; a probe slower than dryrun_timeout on the rank that ran it fails its candidates."""
        self.keys, self.seconds = share_probes(self.run.model, candidates, self.probed_batch, self.ctx,
                                               self.run.device_ctx, self.memo, self.run.out_of_time)

    def seconds_of(self, strategy: Strategy) -> float:
        return sum(self.seconds.get(key, 0.0) for key in self.keys.get(id(strategy), ()))


def share_probes(model, candidates: list[Strategy], probed_batch, probe_ctx: ModelContext, device_ctx, memo: dict,
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


@dataclass(frozen=True)
class Rates:
    """What every candidate's estimate shares: optimizer state per parameter, the optimizer's
    seconds per byte on this device, and the rates: a calibrated profile, or nominal ones with
    bf16's speedup over fp32 measured here (speedup.py)."""

    state_factor: float
    optim_rate: float
    profile: Any = None
    half_speedup: float | None = None
    # the optimizer's fused step (fused_optimizer), seconds per byte timed here; 0: not timed
    fused_optim_rate: float = 0.0


def ineligible_rows(layouts) -> list[tuple[Strategy, CandidateResult]]:
    """One pruned row per layout this model cannot run, with the layout method's reason."""
    return [(layout.strategy(), CandidateResult(layout.strategy().to_dict(), reason=why, layout=layout.text,
                                                pruned_by=INELIGIBLE)) for layout, why in layouts]


def estimate_all(run: SearchRun, candidates: list[Strategy], prober: Prober, rates: Rates,
                 generated: list[Strategy] | None = None) -> None:
    """Every candidate's record added to ``run.results``, in order, estimated or decided here.
    ``candidates`` are planned for the model (:func:`resolved`); ``generated``, the same as the
    space made them (a duplicate's record says what it was generated as)."""
    prober.share(candidates)
    late = run.out_of_time()  # then learnt with each candidate's agreement (one collective a candidate)
    for strategy, as_generated in zip(candidates, generated or candidates):
        dims = layout_dims(strategy, run.device_ctx.world_size)
        text = layout_text(dims.items(), layout_config(strategy))
        result = _decided_unestimated(run, strategy, text, late, as_generated)
        if result is None:
            result, late = _estimated(run, strategy, dims, text, prober, rates)
        run.results.append((strategy, result))


def estimate_one(run: SearchRun, strategy: Strategy, prober: Prober, rates: Rates) -> CandidateResult:
    """One more candidate's record with its estimate, after the others' (refine.py's trials)."""
    dims = layout_dims(strategy, run.device_ctx.world_size)
    prober.share([strategy])
    return _estimated(run, strategy, dims, layout_text(dims.items(), layout_config(strategy)), prober, rates)[0]


def _decided_unestimated(run: SearchRun, strategy: Strategy, text: str, late: bool,
                         generated: Strategy) -> CandidateResult | None:
    """A candidate decided without its estimate: a duplicate, one whose memory-only method is not
    needed (what prune_twins would prune, not estimated nor probed at all), or one past the
    time limit."""
    record = functools.partial(CandidateResult, strategy.to_dict(), layout=text)
    if any(s == strategy for s, _ in run.results):
        as_generated = None if generated == strategy else " + ".join(method_labels(generated.items()))
        return record(reason=DUPLICATE, pruned_by=SYMMETRIC, generated_as=as_generated)
    if not run.given:
        saver = memory_only_twin_fits(strategy, run.results, run.ratios, run.options.memory_budget,
                                      run.options.estimate_ratio)
        if saver is not None:
            return record(reason=memory_only_reason(saver), pruned_by=MEMORY_ONLY)
    if run.results and late:
        run.timed_out = True
        return record(reason="not estimated: time_limit reached", pruned_by=TIME_LIMIT)
    return None


def _estimated(run: SearchRun, strategy: Strategy, dims: dict, text: str, prober: Prober,
               rates: Rates) -> tuple[CandidateResult, bool]:
    """The candidate's estimate, agreed over the ranks, and whether rank 0 is past the time limit."""
    options = run.options
    began = time.perf_counter()
    estimate, reason = cost_candidate(run.model, strategy, dims, rates.state_factor, prober,
                                      run.device_ctx.device.type, rates.optim_rate)
    if estimate is not None:
        estimate.profile, estimate.half_speedup = rates.profile, rates.half_speedup
        estimate.fused_optim_seconds_per_byte = rates.fused_optim_rate
    memory = None if estimate is None else estimate.memory()
    # Decisions use agreed values only, so every rank prunes and runs the same candidates: rank
    # 0's reason and whether its clock is past the time limit, the largest peak and step time
    # (none where a rank has no estimate), the slowest rank's seconds, all in one agreement.
    (reason, late), total, step_seconds, seconds = agreed(
        (reason, run.past_limit()), None if memory is None else memory.total,
        None if estimate is None else estimate.seconds(),
        time.perf_counter() - began + prober.seconds_of(strategy))
    run.estimate_seconds[id(strategy)] = seconds
    result = CandidateResult(strategy.to_dict(), reason=reason, layout=text)
    if result.reason is not None:
        result.pruned_by = CONFIG_ERROR
    run.ratios[id(result)] = cost.candidate_ratio(options.estimate_ratio, estimate)
    if result.reason is None and seconds > options.dryrun_timeout:
        # dryrun_timeout bounds the whole candidate: a forward this slow cannot finish a dry run.
        result.status, result.seconds = FAILED, seconds
        result.reason = (f"its memory-estimate forward took {result.seconds:.1f}s, over dryrun_timeout="
                         f"{options.dryrun_timeout:g}s (raise dryrun_timeout if this step is meant to be slow)")
    if total is not None:
        result.estimated_peak_bytes = int(total)
        result.estimate_breakdown = memory.as_dict()
        result.estimated_step_seconds = step_seconds
        result.estimate_overheads = estimate.overhead_units() if estimate is not None else None
        # Only what is over the budget beyond the estimate's known error is pruned: a
        # candidate near the boundary is dry-run, and its measured peak decides.
        if result.reason is None and cost.surely_over(result.estimated_peak_bytes, options.memory_budget,
                                                      options.estimate_ratio):
            result.reason, result.pruned_by = OVER_BUDGET.format(options.estimate_ratio[1]), OVER_BUDGET_RULE
    return result, late
