"""Where the stage boundaries fall: from the user's cuts, or balanced over the transformer layers.

``auto_partition`` balances by **parameter count**: stage boundaries fall only before
transformer layers, and the split minimizes the largest stage's number of parameters (the
embedding and head count towards the first and last stage). Parameter count stands in for
compute: in a decoder every layer costs the same per token, so equal layers get equal shares.
"""

from torch import nn

from atorch.errors import MethodConfigError, WorldSizeError


def ranges_from_cuts(units: list[str], cuts: list[str], num_stages: int) -> list[list[str]]:
    """Split ``units`` after each name in ``cuts`` (a cut names the last unit of a stage)."""
    if len(cuts) != num_stages - 1:
        raise MethodConfigError(
            f"pipeline_cuts {cuts} make {len(cuts) + 1} stages but the pipeline has {num_stages} "
            f"(pipeline size x virtual_pipeline_size); give {num_stages - 1} cuts"
        )
    positions = []
    for cut in cuts:
        if cut not in units:
            raise MethodConfigError(
                f"pipeline cut {cut!r} is not a unit of this model; a cut names the last module of a stage, one of "
                f"{units}"
            )
        positions.append(units.index(cut))
    if positions != sorted(set(positions)) or (positions and positions[-1] == len(units) - 1):
        raise MethodConfigError(
            f"pipeline_cuts {cuts} must be distinct, in forward order, and leave at least one module after the "
            f"last cut; the units in order are {units}"
        )
    bounds = [0] + [p + 1 for p in positions] + [len(units)]
    return [units[a:b] for a, b in zip(bounds, bounds[1:])]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balanced_ranges(model: nn.Module, units: list[str], layer_units: list[str], num_stages: int) -> list[list[str]]:
    """Contiguous ranges of ``units`` with boundaries only before layer units, minimizing the
    largest stage's parameter count (ties: the earliest boundaries)."""
    allowed = sorted({units.index(name) for name in layer_units} - {0})
    if len(allowed) < num_stages - 1:
        raise WorldSizeError(
            f"auto_partition needs {num_stages - 1} boundaries before transformer layers to make {num_stages} stages "
            f"but the model has {len(layer_units)} layers; use fewer stages or give pipeline_cuts"
        )
    sizes = [_numel(model.get_submodule(name)) for name in units]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[s][i]: the smallest achievable max stage size splitting units[:i] into s stages, ending at i.
    points = [0] + allowed + [len(units)]
    inf = float("inf")
    best = {(0, 0): (0, None)}
    for s in range(1, num_stages + 1):
        for j, end in enumerate(points[1:], start=1):
            for start in points[:j]:
                if (s - 1, start) not in best:
                    continue
                cost = max(best[(s - 1, start)][0], prefix[end] - prefix[start])
                if cost < best.get((s, end), (inf, None))[0]:
                    best[(s, end)] = (cost, start)
    bounds = [len(units)]
    for s in range(num_stages, 0, -1):
        bounds.append(best[(s, bounds[-1])][1])
    bounds.reverse()
    return [units[a:b] for a, b in zip(bounds, bounds[1:])]
