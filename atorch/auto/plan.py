"""Fit a requested strategy to this job before anything is applied.

Every adjustment (a method dropped, a dim rescaled or chosen, a default added) is returned as a
:class:`Note` with its reason; the caller logs it (at WARNING when the job runs otherwise than the
user wrote) and returns it with the result. A method the user names is never dropped for want of
the dim it needs: the dim is fitted (atorch/auto/fit_dims.py) or the plan raises. Contradictions
raise a user error here, so a strategy is never half-applied.
"""

import json
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from atorch.auto.environment import DeviceContext
from atorch.auto.fit_dims import FitJob, fit_missing_dims
from atorch.auto.order import applied_order
from atorch.auto.registry import get_method
from atorch.auto.strategy import Strategy, make_config
from atorch.distributed.topology import DATA_PARALLEL_DIMS, resolve_dims
from atorch.errors import StrategyConflictError
from atorch.utils.log import logger


class Note(str):
    """One adjustment the planner made, as text. ``warning`` is True when the job runs otherwise
    than the user wrote (a named method dropped, a dim chosen for one): logged at WARNING; the
    others (a default added, the data dim rescaled) at INFO. Both are returned with the result."""

    warning: bool = False

    def __new__(cls, text: str, warning: bool = False) -> "Note":
        note = super().__new__(cls, text)
        note.warning = warning
        return note


def dropped(name: str, reason: str) -> Note:
    return Note(f"{name}: dropped because {reason}", warning=True)


def log_notes(notes: Iterable[str]) -> None:
    """Each note at WARNING when it says the job runs otherwise than written, else at INFO."""
    for note in notes:
        logger.log(logging.WARNING if getattr(note, "warning", False) else logging.INFO, "%s", note)


def plan_strategy(
    strategy: Strategy,
    device_ctx: DeviceContext,
    excluded: Iterable[str] | None = None,
    included: Iterable[str] | None = None,
    job: FitJob | None = None,
) -> tuple[Strategy, list[Note]]:
    """Return the strategy that will run here and the notes that explain each change.

    ``job`` (the model and its batch) lets a method named without its parallel dim get the
    largest size the model allows; without it the size is fitted to the world alone and the
    model is checked when the method is applied.
    """
    strategy, notes = _as_asked(strategy, list(excluded or []), list(included or []))
    # Conflicts that hold at any world size are refused before anything is dropped for this job
    # (zero2 + fsdp on one process would otherwise lose both quietly and fail only at scale).
    check_relations(in_applied_order(strategy))
    strategy = _without_unrunnable(strategy, device_ctx, notes)
    if device_ctx.distributed and "parallel_mode" not in strategy:
        strategy = strategy.with_method("parallel_mode", first=True)
        notes.append(Note(f"parallel_mode: added (data parallel over {device_ctx.world_size} processes) "
                          "because none was given"))
    if "parallel_mode" in strategy:
        strategy = _laid_out(strategy, device_ctx, job, notes)
    strategy = _with_dims_checked(strategy, notes)
    strategy = in_applied_order(strategy)
    check_relations(strategy)  # in applied order: the same message whatever the list order
    return strategy, notes


def _as_asked(strategy: Strategy, excluded: list[str], included: list[str]) -> tuple[Strategy, list[Note]]:
    """``included`` methods added (default config), ``excluded`` ones dropped, each with a note."""
    for name in excluded + included:
        get_method(name)  # unknown names are errors, listing the valid ones
    both = sorted(set(excluded) & set(included))
    if both:
        raise StrategyConflictError(f"methods {both} are both excluded and included; pick one")
    notes: list[Note] = []
    for name in included:
        if name not in strategy:
            strategy = strategy.with_method(name)
            notes.append(Note(f"{name}: added with its default config because it is in `included`"))
    for name in excluded:
        if name in strategy:
            strategy = strategy.without(name)
            notes.append(Note(f"{name}: dropped because it is in `excluded`"))  # as the user asked
    return strategy, notes


def _without_unrunnable(strategy: Strategy, device_ctx: DeviceContext, notes: list[Note]) -> Strategy:
    """Methods this job cannot run dropped, with why: one process, an unsupported device, or a
    method that another in the strategy takes the place of."""
    for name, config in strategy.items():
        spec = get_method(name)
        reason = None
        if spec.distributed_only and not device_ctx.distributed:
            reason = "it needs more than one process and this job has one"
        elif spec.unsupported is not None:
            reason = spec.unsupported(device_ctx, config)
        if reason is None:
            present = [other for other in spec.overridden_by if other in strategy]
            if present:
                reason = f"{present[0]} is in the strategy and takes its place"
        if reason is not None:
            strategy = strategy.without(name)
            notes.append(dropped(name, reason))
    return strategy


def _laid_out(strategy: Strategy, device_ctx: DeviceContext, job: FitJob | None, notes: list[Note]) -> Strategy:
    """parallel_mode's dims fitted to the world (and the model, with ``job``), then laid out by a
    method that lays out the mesh itself (mixed_parallel); every dim must be used."""
    config = strategy.get("parallel_mode")
    requested = config.dims or [("data", device_ctx.world_size)]
    requested, fitted = fit_missing_dims(strategy, requested, device_ctx.world_size,
                                         device_ctx.local_world_size, job)
    notes += [Note(note, warning=True) for note in fitted]
    dims, dim_notes = resolve_dims(requested, device_ctx.world_size, config.rank_order)
    notes += [Note(f"parallel_mode: {note}") for note in dim_notes]
    for name, method_config in strategy.items():
        lay_out = get_method(name).lay_out_dims
        if lay_out is not None:
            method_config, dims = lay_out(method_config, device_ctx.world_size, dims)
            strategy = strategy.replace(name, method_config)
    if dims != config.dims:
        strategy = strategy.replace("parallel_mode", {"dims": dims, "rank_order": config.rank_order})
    _check_dims_used(strategy, dims)
    return strategy


def _with_dims_checked(strategy: Strategy, notes: list[Note]) -> Strategy:
    """A method without a dim it needs is refused by name; one that shards over data ranks is
    dropped when there is one."""
    dims = dict(strategy.get("parallel_mode").dims) if "parallel_mode" in strategy else {}
    dp_size = 1
    for name, size in dims.items():
        if name in DATA_PARALLEL_DIMS:
            dp_size *= size
    for name, _ in strategy.items():
        spec = get_method(name)
        missing = [dim for dim in spec.needs_dims if dims.get(dim, 1) <= 1]
        if missing:
            # What fit_missing_dims left: a dim written as 1, or one only another method fills.
            dim = missing[0]
            written = f"sets the {dim!r} dim to 1" if dim in dims else f"has no {dim!r} dim"
            raise StrategyConflictError(
                f"{name} needs a {dim!r} dim larger than 1 but parallel_mode {written}; write ({dim!r}, N) with "
                f"N > 1 in parallel_mode's dims, leave the {dim!r} dim out to let atorch choose N, or remove {name}")
        if spec.needs_data_parallel and dp_size == 1:
            strategy = strategy.without(name)
            notes.append(dropped(name, "it shards over data-parallel ranks and there is only one"))
    return strategy


def in_applied_order(strategy: Strategy) -> Strategy:
    """The same methods, listed in the order they are applied (atorch/auto/order.py)."""
    configs = dict(strategy.items())
    return Strategy([(name, configs[name]) for name in applied_order(configs)])


def check_relations(strategy: Strategy) -> None:
    """Refuse a strategy with two conflicting methods, or a method without one it requires;
    the error names both methods, the reason, and the fix."""
    problems = relation_problems(strategy)
    if problems:
        raise StrategyConflictError(problems[0])


# declared()'s memo: (name, relation, config's JSON) -> (the spec read, its answer)
_DECLARED: dict[tuple, tuple] = {}


def declared(name: str, config, relation: str) -> dict[str, str]:
    """``relation`` (``conflicts`` or ``requires``) of method ``name`` under ``config`` (a config,
    its dict, or None for the default), as ``{method: reason}``; read from the registry once per
    config: the search asks about the same pairs thousands of times (1824 of the 2304 combinations
    it generates for a small transformer on 2 ranks are such conflicts)."""
    spec = get_method(name)
    text = config.model_dump_json() if hasattr(config, "model_dump_json") else json.dumps(config, sort_keys=True,
                                                                                          default=str)
    key = (name, relation, text)
    if key not in _DECLARED or _DECLARED[key][0] is not spec:  # a method registered again reads anew
        typed = config if hasattr(config, "model_dump_json") else make_config(name, config)
        _DECLARED[key] = (spec, spec.related(relation, typed))
    return _DECLARED[key][1]


def any_conflict(methods: Iterable[tuple[str, object]]) -> bool:
    """Whether two of ``methods`` (``(name, config)`` pairs) declare a conflict: what
    :func:`plan_strategy` would refuse, without building a Strategy."""
    methods = list(methods)
    names = {name for name, _ in methods}
    return any(set(declared(name, config, "conflicts")) & names for name, config in methods)


def relation_problems(strategy: Strategy) -> list[str]:
    """Every conflict and missing requirement in ``strategy`` (each pair once), as messages."""
    problems: list[str] = []
    seen: set[frozenset] = set()
    for name, config in strategy.items():
        for other, why in declared(name, config, "conflicts").items():
            if other in strategy and frozenset((name, other)) not in seen:
                seen.add(frozenset((name, other)))
                because = f": {why}" if why else ""
                problems.append(f"methods {name!r} and {other!r} cannot be used together{because}; remove one of them")
        for other, why in declared(name, config, "requires").items():
            if other not in strategy:
                because = f" ({why})" if why else ""
                problems.append(f"method {name!r} needs {other!r} in the same strategy{because}; add it")
    return problems


# The drops resolve_strategy has logged inside each_drop_once (a search resolves every candidate,
# and said the same drop once per candidate and dry run).
_logged: set[str] | None = None


@contextmanager
def each_drop_once() -> Iterator[None]:
    """Inside the block, :func:`resolve_strategy` logs each drop once (nested blocks share it)."""
    global _logged
    outer = _logged
    _logged = set() if outer is None else outer
    try:
        yield
    finally:
        _logged = outer


def _note_what_stays_whole(spec, model, config, notes: list[Note] | None) -> None:
    """A method that runs but leaves part of ``model`` as it was says so: a WARNING in the user's
    notes (never silence); once per search at INFO for the search's candidates."""
    whole = spec.leaves_whole(model, config) if spec.leaves_whole is not None else None
    if whole is None:
        return
    note = Note(f"{spec.name}: {whole}", warning=True)
    if notes is not None:
        notes.append(note)
    elif _logged is None or note not in _logged:
        logger.info("%s", note)
        if _logged is not None:
            _logged.add(note)


def resolve_strategy(model, strategy: Strategy, notes: list[Note] | None = None) -> Strategy:
    """Each method's ``resolve`` applied to ``model``: user errors raised before anything runs,
    and the choices methods make from the model (checkpointed classes, FSDP units) filled in.

    A method that would change nothing on ``model`` is dropped: with ``notes`` (the user's own
    strategy) the drop is appended there for the caller to log at WARNING; without (the search's
    candidates) it is logged at INFO, once per search (:func:`each_drop_once`)."""
    mode = strategy.get("parallel_mode") if "parallel_mode" in strategy else None
    dims = dict(mode.dims) if getattr(mode, "dims", None) else None
    for name, config in strategy.items():
        spec = get_method(name)
        if spec.resolve is not None:
            config = spec.resolve(model, config)
            strategy = strategy.replace(name, config)
        _note_what_stays_whole(spec, model, config, notes)
        idle = spec.changes_nothing(model, config) if spec.changes_nothing is not None else None
        if idle is None and dims is not None and spec.idle_on_layout is not None:
            idle = spec.idle_on_layout(model, config, dims)
        if idle is not None:
            strategy = strategy.without(name)
            note = dropped(name, f"it would change nothing: {idle}")
            if notes is None:
                if _logged is None or note not in _logged:
                    logger.info("%s", note)
                if _logged is not None:
                    _logged.add(note)
            else:
                notes.append(note)
    return strategy


def _check_dims_used(strategy: Strategy, dims: list[tuple[str, int]]) -> None:
    used = set(DATA_PARALLEL_DIMS)
    for name, _ in strategy.items():
        used.update(get_method(name).uses_dims)
    idle = [(name, size) for name, size in dims if size > 1 and name not in used]
    if idle:
        name, size = idle[0]
        raise StrategyConflictError(
            f"parallel_mode has a {name!r} dim of size {size} but no method in the strategy uses it, so "
            f"{size} ranks would repeat the same work; add a method that uses it or drop the dim"
        )
