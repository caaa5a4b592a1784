"""Candidate strategies: layouts (how the ranks split into data x tensor x pipeline) from the
registry's layout methods, each combined with the registry's search spaces."""

import functools
import itertools
import math
from collections import Counter
from dataclasses import dataclass

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import any_conflict, plan_strategy
from atorch.auto.registry import LayoutJob, all_methods, get_method
from atorch.auto.strategy import Strategy, make_config
from atorch.distributed.topology import DATA_PARALLEL_DIMS
from atorch.errors import AtorchConfigError
from atorch.utils.memo import kept


@dataclass(frozen=True)
class Layout:
    """parallel_mode's dims (innermost first, data last) and the layout method that uses them
    with its config; ``method`` None is data parallelism over every rank."""

    dims: tuple[tuple[str, int], ...]
    method: tuple[str, dict] | None = None

    @property
    def text(self) -> str:
        return layout_text(self.dims, None if self.method is None else self.method[1])

    def strategy(self) -> Strategy:
        if self.method is None:
            return Strategy()  # planning adds parallel_mode over every rank
        return Strategy([("parallel_mode", {"dims": [list(d) for d in self.dims]}), self.method])


def layout_text(dims, config: dict | None = None) -> str:
    """``tensor=2 x data=2``, with ``microbatches=4`` when the layout's config sets them."""
    text = " x ".join(f"{name}={size}" for name, size in dims if size > 1) or "1 rank"
    if config and config.get("num_microbatches"):
        text += f", microbatches={config['num_microbatches']}"
    if config and (config.get("virtual_pipeline_size") or 1) > 1:
        text += f", virtual stages={config['virtual_pipeline_size']}"
    if config and config.get("sequence_parallel"):  # mixed_parallel's, inside the stages
        text += ", sequence parallel"
    return text


def layout_space(model, device_ctx: DeviceContext, global_batch: int | None = None,
                 model_input_format: str | None = None, excluded=None, included=None, first_batch=None,
                 ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """The layouts the search tries on ``model``, and those it cannot run with the reason.

    Every layout method of the registry (a row with ``layouts``) lists the dims it takes on this
    world size; the data dim gets the remaining ranks; the method's ``ineligible`` says whether
    this model can run it there. Data parallelism over every rank comes first, unless a layout
    method is in ``included`` (then only its layouts are tried); ``excluded`` ones are not tried.
    ``first_batch(data_parallel_size)`` returns the batch one data rank gets (the job's first):
    ``ineligible`` sees it as ``LayoutJob.first_batch``.
    """
    excluded, included = set(excluded or []), set(included or [])
    world = device_ctx.world_size
    specs = [s for s in all_methods() if s.layouts is not None and s.name not in excluded]
    forced = [s for s in specs if s.name in included]
    eligible: list[Layout] = [] if forced else [Layout((("data", world),) if world > 1 else ())]
    ineligible: list[tuple[Layout, str]] = []
    if world == 1:
        return eligible, ineligible
    with kept():  # layouts with as many pipeline stages share one trace of the model (its eligibility)
        for spec in forced or specs:
            for sizes, raw in spec.layouts(world, model=model):
                taken = math.prod(sizes.values())
                if world % taken:
                    continue
                layout = Layout((*sizes.items(), ("data", world // taken)), (spec.name, dict(raw)))
                data = world // taken
                job = LayoutJob(dict(layout.dims), global_batch // data if global_batch else None,
                                model_input_format, None if first_batch is None else functools.partial(first_batch, data))
                why = None if spec.ineligible is None else spec.ineligible(model, make_config(spec.name, raw), job)
                if why is None:
                    eligible.append(layout)
                else:
                    ineligible.append((layout, why))
    return eligible, ineligible


def candidate_space(
    device_ctx: DeviceContext,
    excluded: list[str] | None = None,
    included: list[str] | None = None,
    base: Strategy | None = None,
    layouts: list[Layout] | None = None,
    counts: Counter | None = None,
    model=None,
    global_batch: int | None = None,
) -> list[Strategy]:
    """Every distinct strategy the search may try, simplest first.

    Each of ``layouts`` (default: data parallel over every rank) is combined with each
    searchable method (one with a ``search_space``) off or in one of its configs; methods in
    ``included`` are always on (their search space, or their default config); ``excluded`` ones
    never appear. With ``base`` (finetune_strategy), only ``base``'s methods appear, each always
    on, with its loaded config or one from its search space, on ``base``'s layout. Combinations
    that conflict, or that planning changes (a method this job cannot run), are left out or
    merged with their planned form; so are those a method's ``ineligible`` refuses on the layout
    (gradient_accumulation's steps that do not divide a rank's share of ``global_batch``);
    ``counts`` (when given) counts them as ``conflicting``, ``symmetric`` and ``ineligible``, and
    every combination as ``generated``.
    """
    excluded, included = set(excluded or []), set(included or [])
    counts = Counter() if counts is None else counts
    for name in excluded | included:
        get_method(name)
    choices: list[tuple[str, list]] = []
    if base is not None:
        for name, config in base.items():
            if name == "parallel_mode" or get_method(name).layouts is not None:
                continue
            options = [config.model_dump(mode="json")] + [c for c in get_method(name).search_space]
            choices.append((name, _unique(options)))
        kept = [(n, c) for n, c in base.items() if n == "parallel_mode" or get_method(n).layouts is not None]
        layouts = [_FixedLayout(Strategy(kept))]
    else:
        for spec in all_methods():
            if spec.name in excluded or spec.name == "parallel_mode" or spec.layouts is not None:
                continue
            if spec.name in included:
                choices.append((spec.name, list(spec.search_space) or [{}]))
            elif spec.search_space and not spec.tried_on_pick and (spec.applies_to is None or (model is not None and spec.applies_to(model))):
                choices.append((spec.name, [None, *spec.search_space]))
        layouts = layouts or [Layout(())]
    seen = _Distinct()
    for layout in layouts:
        # a method that needs a dim this layout lacks (sequence_parallel, tensor) is not generated on it
        dims = _dims_of(layout, device_ctx.world_size)
        here = [(name, options if set(get_method(name).needs_dims) <= {d for d, n in dims.items() if n > 1}
                 else [None]) for name, options in choices]
        for combo in itertools.product(*(options for _, options in here)):
            counts["generated"] += 1
            methods = layout.strategy().items()
            methods += [(name, config) for (name, _), config in zip(here, combo) if config is not None]
            if any_conflict(methods):  # what plan_strategy would refuse, without building a Strategy
                counts["conflicting"] += 1
                continue
            if _refused_on(_dims_of(layout, device_ctx.world_size), methods, model, global_batch):
                counts["ineligible"] += 1
                continue
            try:
                planned, _ = plan_strategy(Strategy(methods), device_ctx)
            except AtorchConfigError:
                counts["conflicting"] += 1
                continue
            if any(name in excluded for name in planned.opt_names):
                counts["conflicting"] += 1
                continue
            if not seen.add(planned):
                # e.g. fsdp on a layout whose data dim is 1: planning drops it, leaving the bare layout
                counts["symmetric"] += 1
    return sorted(seen.kept, key=len)


class _Distinct:
    """Strategies kept once each, in the order they came: a new one is looked for in a bucket of
    its printed form (the same strategy always prints the same), then by Strategy's own equality.
    A list alone made candidate_space quadratic: 40 of 64 profiled seconds of a 96-rank plan."""

    def __init__(self):
        self.kept: list[Strategy] = []
        self._buckets: dict[str, list[Strategy]] = {}

    def add(self, strategy: Strategy) -> bool:
        """Keep ``strategy`` unless an equal one was kept; whether it was new."""
        bucket = self._buckets.setdefault(repr(strategy), [])
        if strategy in bucket:
            return False
        bucket.append(strategy)
        self.kept.append(strategy)
        return True


def _dims_of(layout, world: int) -> dict[str, int]:
    """A layout's parallel dims; data parallelism over every rank when it names none."""
    if isinstance(layout, Layout):
        dims = dict(layout.dims)
    else:
        mode = layout.strategy().get("parallel_mode")
        dims = dict(mode.dims) if mode is not None and mode.dims else {}
    return dims or {"data": world}


def _refused_on(dims: dict[str, int], methods: list, model, global_batch: int | None) -> bool:
    """Whether a method that is not a layout method refuses the layout of ``dims`` (its ``ineligible``)."""
    data = math.prod(size for name, size in dims.items() if name in DATA_PARALLEL_DIMS)
    job = LayoutJob(dims, global_batch // data if global_batch else None)
    for name, config in methods:
        spec = get_method(name)
        if spec.layouts is None and spec.ineligible is not None and name != "parallel_mode":
            if spec.ineligible(model, make_config(name, config), job) is not None:
                return True
    return False


@dataclass(frozen=True)
class _FixedLayout:
    """A loaded strategy's own layout (finetune_strategy keeps it)."""

    fixed: Strategy

    def strategy(self) -> Strategy:
        return self.fixed


def _unique(options: list) -> list:
    out = []
    for option in options:
        if option not in out:
            out.append(option)
    return out


def method_labels(methods) -> list[str]:
    """The methods' names as reports show them: a variant the search tries beside the method's
    default says which (``checkpoint (selective)``), so two rows never read the same."""
    labels = []
    for name, config in methods:
        field = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        if name == "checkpoint" and field("selective", False):
            every_other = field("keep_matmuls", "all") == "every_other"
            name = "checkpoint (selective, every other matmul)" if every_other else "checkpoint (selective)"
        elif name == "gradient_accumulation":
            name = f"gradient_accumulation x{field('steps', 2)}"
        elif name == "fsdp":
            notes = [text for key, text in (("reduce_every_micro_batch", "reduce every micro-batch"),
                                            ("cpu_offload", "CPU offload")) if field(key, False)]
            name = f"fsdp ({', '.join(notes)})" if notes else name
        labels.append(name)
    return labels
