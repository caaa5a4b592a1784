"""A parallel dim the user left out, chosen for the method that needs it.

``["parallel_mode", "tensor_parallel"]`` on 8 ranks names a method but no ``tensor`` dim for it
to split over. Dropping the method would train plain DDP while the user believes the model is
split; instead the planner picks the largest size that the ranks and the model allow and says
so (at WARNING, and in the result's notes). When no size works, it raises and names the fix.

The candidate sizes are the ones the method's registry row lays out (``layouts``), the model's
check is its ``ineligible``: the same rows the search reads, so a size fitted here is one the
search could have tried.
"""

import math
from dataclasses import dataclass
from typing import Any

from atorch.auto.registry import LayoutJob, MethodSpec, get_method
from atorch.distributed.topology import data_parallel_size
from atorch.errors import WorldSizeError

# Innermost first, as parallel_mode writes dims: a fitted dim goes before the dims listed after it.
_INNERMOST = ("tensor", "pipeline")


@dataclass(frozen=True)
class FitJob:
    """What fitting a dim reads about the job besides the world: the model and its batch."""

    model: Any = None
    # The global batch (dataloader_args["batch_size"]); None when unknown.
    batch_size: int | None = None
    model_input_format: str | None = None


def _cap(dim: str, config, world: int, local_world: int) -> tuple[int, str]:
    """The largest size worth fitting for ``dim``, and why."""
    if dim == "tensor":
        # A tensor group all-reduces inside every layer: Megatron keeps it within one machine.
        return max(local_world, 1), f"the {local_world} ranks of one machine (its collectives run in every layer)"
    if dim == "pipeline":
        # With fewer microbatches than stages, most stages wait for most of the step.
        microbatches = getattr(config, "num_microbatches", 1)
        return max(2, microbatches), f"num_microbatches ({microbatches}), or 2 (deeper pipelines idle more)"
    return world, ""


def _sizes(spec: MethodSpec, dim: str, ranks: int) -> list[int]:
    """Sizes of ``dim`` the method lays out on ``ranks`` ranks, largest first."""
    if spec.layouts is not None:
        sizes = {dims[dim] for dims, _ in spec.layouts(ranks) if set(dims) == {dim}}
    else:
        sizes = {d for d in range(2, ranks + 1) if ranks % d == 0}
    return sorted((s for s in sizes if ranks % s == 0), reverse=True)


def _insert(dims: list[tuple[str, int]], dim: str, size: int) -> list[tuple[str, int]]:
    def depth(name: str) -> int:
        return _INNERMOST.index(name) if name in _INNERMOST else len(_INNERMOST)

    at = 0
    while at < len(dims) and depth(dims[at][0]) < depth(dim):
        at += 1
    return [*dims[:at], (dim, size), *dims[at:]]


def fit_missing_dims(strategy, dims: list[tuple[str, int]], world: int, local_world: int,
                     job: FitJob | None = None) -> tuple[list[tuple[str, int]], list[str]]:
    """``dims`` with a size for every dim a method of ``strategy`` puts to work but ``dims``
    lacks, and one note per dim fitted; raises :class:`WorldSizeError` when no size fits.

    A dim written with size 1 is the user's choice and is left alone (the planner refuses the
    method then). The data dim is not resized here: ``resolve_dims`` gives it what is left.
    """
    job = job or FitJob()
    notes: list[str] = []
    for name, config in strategy.items():
        spec = get_method(name)
        for dim in spec.needs_dims:
            if dim in dict(dims) or dim not in spec.uses_dims:
                continue  # given, or put to work by another method (sequence_parallel: tensor_parallel's)
            others = math.prod(size for n, size in dims if n != "data")
            if world % others:
                return dims, notes  # resolve_dims says what does not fit
            ranks = world // others
            cap, why_cap = _cap(dim, config, world, local_world)
            refused: list[str] = []
            chosen = None
            for size in _sizes(spec, dim, ranks):
                if size > cap:
                    refused.append(f"{dim}={size}: larger than {why_cap}")
                    continue
                candidate = _insert(dims, dim, size)
                layout = {n: s for n, s in candidate if n != "data"} | {"data": ranks // size}
                why = _ineligible(spec, config, layout, job)
                if why is None:
                    chosen = size
                    break
                refused.append(why)
            if chosen is None:
                raise WorldSizeError(_no_fit(name, dim, ranks, refused))
            dims = _insert(dims, dim, chosen)
            model = ("" if job.model is None
                     else f", that {type(job.model).__name__} allows")
            notes.append(
                f"{name}: parallel_mode has no {dim!r} dim; chose {dim}={chosen}, the largest size that divides "
                f"the {ranks} ranks{model} and that is at most {why_cap}; the data dim takes the remaining ranks. "
                f"Write ({dim!r}, N) in parallel_mode's dims to choose the size yourself"
            )
    return dims, notes


def _ineligible(spec: MethodSpec, config, layout: dict[str, int], job: FitJob) -> str | None:
    if job.model is None or spec.ineligible is None:
        return None  # checked when the method is applied
    data = data_parallel_size(layout)
    batch = job.batch_size // data if job.batch_size and job.batch_size % data == 0 else None
    return spec.ineligible(job.model, config, LayoutJob(layout, batch, job.model_input_format))


def _no_fit(name: str, dim: str, ranks: int, refused: list[str]) -> str:
    tried = "; ".join(refused) if refused else f"{ranks} rank(s) have no {dim} size larger than 1"
    return (
        f"{name} needs a {dim!r} dim larger than 1 and parallel_mode has none, and no size fits this job ({tried}). "
        f"Add ({dim!r}, N) to parallel_mode's dims with N a divisor of the world size that the model allows "
        f"(launch more ranks if there is none), or remove {name} from the strategy"
    )
