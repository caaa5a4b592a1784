"""The order methods are applied in: data from the registry, never the order of the user's list.

Stages come first (:class:`~atorch.auto.registry.Stage`); inside a stage, the ``after`` and
``before`` relations of the methods' registry rows decide; methods the relations leave free are
ordered by their first stage, then by name, so that any list order of the same methods gives
the same applied order. The returned strategy is written in this order.
"""

import heapq
from collections.abc import Iterable

from atorch.auto.registry import Stage, get_method


def _first_stage(name: str) -> int:
    return min(get_method(name).hooks, default=Stage.RUNTIME)


def applied_order(names: Iterable[str]) -> list[str]:
    """``names`` sorted into the order their hooks run in, in every stage.

    Example::

        applied_order(["amp_native", "pipeline_parallel", "parallel_mode"])
        # ['parallel_mode', 'pipeline_parallel', 'amp_native']: autocast wraps the stages
    """
    present = list(dict.fromkeys(names))
    successors: dict[str, set[str]] = {name: set() for name in present}
    for name in present:
        spec = get_method(name)
        successors.update({other: successors[other] | {name} for other in spec.after if other in successors})
        successors[name].update(other for other in spec.before if other in successors)
    waiting = {name: 0 for name in present}
    for name in present:
        for other in successors[name]:
            waiting[other] += 1
    ready = [(_first_stage(name), name) for name in present if waiting[name] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for other in successors[name]:
            waiting[other] -= 1
            if waiting[other] == 0:
                heapq.heappush(ready, (_first_stage(other), other))
    if len(order) != len(present):
        stuck = sorted(set(present) - set(order))
        # A contradiction between registry rows is atorch's bug (or a plugin's), not the user's.
        raise RuntimeError(f"the registry's after/before relations form a cycle among {stuck}; fix their MethodSpecs")
    return order
