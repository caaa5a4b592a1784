"""Stage 3 of the search: pruning on the estimates, each prune with its reason. A candidate goes
when the same strategy less one of its methods surely fits and that method cannot pay for itself
(the twin rules), or when another one needs no more memory and is estimated far faster
(dominated). The dry runs apply the twin rules again as their measured peaks prove fits."""

from atorch.auto.registry import get_method
from atorch.auto.search import cost, stop
from atorch.auto.search.candidate import DOMINATED, MEMORY_ONLY, SLOWER

# A candidate is dominated by one that needs no more memory and is estimated this many times
# faster. The step-time estimate (nominal or calibrated rates) orders candidates, it does not
# predict seconds well, so only a wide gap prunes.
DOMINANCE = 2.0
# A method is "slower" than its twin without it when estimated more than this many times slower:
# the estimate's own error between candidates, the early stop's slack (stop.STOP_SLACK: a candidate
# may run 1/0.8 = 1.25x faster than its estimate says, relative to another). At 1.03 (the winner's
# tie tolerance, until 2026-11-26) zero1 on search_quality's BERT, estimated 1.16x slower than plain
# DDP, was pruned unmeasured; side by side it ran 8% faster (picked/best 0.918).
SLOWER_MARGIN = 1 / stop.STOP_SLACK


# measured= of prune_twins: every rate (a calibrated or given profile)
ALL_RATES = None


def prune_on_estimates(results, fits: set[int], measured: frozenset | None = ALL_RATES) -> None:
    """The twin rules, then dominance, over every candidate not yet decided. A twin that may not
    fit (near the boundary, or not estimated) prunes nothing."""
    prune_twins(results, fits, measured=measured)
    prune_dominated(results)


def prune_twins(results, fits: set[int], pending: set[int] | None = None,
                measured: frozenset | None = ALL_RATES) -> None:
    """Prune a candidate when the same strategy less one of its methods surely fits the budget
    (its ``id`` in ``fits``: by its estimate, or by a dry run's measured peak) and that method
    cannot pay for itself: it only saves memory (``memory_only`` in the registry), or it is
    estimated to slow this step (``_slower_by``) on rates measured here (``measured``: the rates
    measured on this machine, ALL_RATES with a calibration; a method whose ``decided_by`` names
    another is dry-run, not pruned as slower). ``pending`` (ids of results) limits the pruning to
    candidates that have not run."""
    for strategy, result in results:
        if result.reason is not None or (pending is not None and id(result) not in pending):
            continue
        for name in strategy.opt_names:
            without = strategy.without(name)
            twin = next(((s, r) for s, r in results if s == without), None)
            if twin is None or id(twin[0]) not in fits:
                continue
            if get_method(name).memory_only:
                result.reason, result.pruned_by = memory_only_reason(name), MEMORY_ONLY
                break
            slower = _slower_by(result, twin[1])
            if slower is not None and get_method(name).layouts is None and _measured(name, measured):
                result.reason = (f"{name} is estimated to make the step {slower:.2f}x slower here, and the same "
                                 f"strategy without it fits the budget")
                result.pruned_by = SLOWER
                break


def _measured(name: str, measured: frozenset | None) -> bool:
    """Whether every rate that decides ``name``'s time was measured on this machine."""
    return measured is ALL_RATES or set(get_method(name).decided_by) <= measured


def memory_only_reason(name: str) -> str:
    return f"{name} only saves memory, and the same strategy without it fits the budget"


def memory_only_twin_fits(strategy, results, ratios: dict, budget: int, ratio) -> str | None:
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


def prune_dominated(results) -> None:
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
