"""Candidate strategies, generated from the registry's search spaces."""

import itertools

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import plan_strategy
from atorch.auto.registry import all_methods, get_method
from atorch.auto.strategy import Strategy
from atorch.errors import AtorchConfigError


def candidate_space(
    device_ctx: DeviceContext,
    excluded: list[str] | None = None,
    included: list[str] | None = None,
    base: Strategy | None = None,
) -> list[Strategy]:
    """Every distinct strategy the search may try, simplest first.

    Each searchable method (one with a ``search_space``) is off or one of its configs; methods in
    ``included`` are always on (their search space, or their default config); ``excluded`` ones
    never appear. With ``base`` (finetune_strategy), only ``base``'s methods appear, each always
    on, with its loaded config or one from its search space. Combinations that conflict, or that
    planning changes (a method this job cannot run), are left out or merged with their planned form.
    """
    excluded, included = set(excluded or []), set(included or [])
    for name in excluded | included:
        get_method(name)
    choices: list[tuple[str, list]] = []
    if base is not None:
        for name, config in base.items():
            if name == "parallel_mode":
                continue
            options = [config.model_dump(mode="json")] + [c for c in get_method(name).search_space]
            choices.append((name, _unique(options)))
    else:
        for spec in all_methods():
            if spec.name in excluded or spec.name == "parallel_mode":
                continue
            if spec.name in included:
                choices.append((spec.name, list(spec.search_space) or [{}]))
            elif spec.search_space:
                choices.append((spec.name, [None, *spec.search_space]))
    parallel = base.get("parallel_mode") if base is not None else None
    seen: list[Strategy] = []
    for combo in itertools.product(*(options for _, options in choices)):
        methods = [(name, config) for (name, _), config in zip(choices, combo) if config is not None]
        if parallel is not None:
            methods.insert(0, ("parallel_mode", parallel))
        try:
            planned, _ = plan_strategy(Strategy(methods), device_ctx)
        except AtorchConfigError:
            continue
        if any(name in excluded for name in planned.opt_names):
            continue
        if planned not in seen:
            seen.append(planned)
    return sorted(seen, key=len)


def _unique(options: list) -> list:
    out = []
    for option in options:
        if option not in out:
            out.append(option)
    return out
