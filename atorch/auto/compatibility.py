"""docs/methods/compatibility.md, generated from the registry: every pair of methods, whether the
planner accepts it, and what one does to the other.

Regenerate with ``python -m atorch.auto.compatibility > docs/methods/compatibility.md``;
tests/auto/test_composition.py fails when the file is stale.
"""

import itertools

from atorch.auto.order import applied_order
from atorch.auto.registry import MethodSpec, all_methods, get_method

_HEADER = """\
# Which methods compose

Generated from the method registry by `python -m atorch.auto.compatibility > docs/methods/compatibility.md`
(a test fails when this file is stale). Every pair the planner accepts is trained on gloo ranks
against a serial reference by the composition matrix (`tests/auto/test_composition.py`; the full
matrix: `pytest -m slow tests/auto/test_composition.py`); every refused pair is asserted refused
with the message below.

- **applied order**: the order of the methods' hooks, decided by stage and the registry's
  before/after relations, whatever order the strategy lists them in. The strategy
  `auto_accelerate` returns is written in this order.
- **refused**: `plan_strategy` raises `StrategyConflictError` naming both methods, before anything
  is applied.
- **absorbs**: the first method does the second's work (e.g. computes in its dtype); the second
  stays in the strategy and its other hooks (loss scaling) still run.
- **needs**: the first is refused without the second.
- Pairs where a method also needs a parallel dim or more than one data-parallel rank are planned
  per world size: a method named without the dim it needs gets one chosen (or the plan is
  refused); a sharding method with a single data-parallel rank is dropped, at WARNING and in
  `result.notes`.
"""


def _variants(spec: MethodSpec) -> list[tuple[str, object]]:
    """(label, config) for each config whose relations differ; the default config first."""
    out = [("", spec.config_cls())]
    for raw in spec.variants:
        label = ", ".join(f"{key}={value}" for key, value in raw.items())
        out.append((f" ({label})", spec.config_cls(**raw)))
    return out


def _cell(a: MethodSpec, config_a, b: MethodSpec) -> str:
    """What happens when ``a`` (with ``config_a``) and ``b`` (default config) are both present."""
    config_b = b.config_cls()
    for left, config, right in ((a, config_a, b), (b, config_b, a)):
        conflicts = left.related("conflicts", config)
        if right.name in conflicts:
            why = conflicts[right.name]
            return f"refused{': ' + why if why else ''}"
    notes = []
    for left, config, right in ((a, config_a, b), (b, config_b, a)):
        absorbs = left.related("absorbs", config)
        if right.name in absorbs:
            why = absorbs[right.name]
            notes.append(f"{left.name} absorbs {right.name}{' (' + why + ')' if why else ''}")
        if right.name in left.related("requires", config):
            notes.append(f"{left.name} needs {right.name}")
        if right.name in left.overridden_by:
            notes.append(f"{left.name} is dropped: {right.name} takes its place")
    order = " -> ".join(applied_order([a.name, b.name]))
    return "; ".join(["accepted", f"order {order}", *notes])


def compatibility_markdown() -> str:
    specs = sorted(all_methods(), key=lambda spec: spec.name)
    lines = [_HEADER, "| method | with | outcome |", "|---|---|---|"]
    for a, b in itertools.combinations(specs, 2):
        for label, config in _variants(a):
            lines.append(f"| `{a.name}`{label} | `{b.name}` | {_cell(a, config, b)} |")
        for label, config in _variants(b)[1:]:
            lines.append(f"| `{b.name}`{label} | `{a.name}` | {_cell(b, config, a)} |")
    order = " -> ".join(applied_order(spec.name for spec in specs))
    lines += ["", f"Applied order of every method together (each stage runs in this order): {order}.", ""]
    return "\n".join(lines)


def _main() -> None:
    get_method("parallel_mode")  # loads the built-in methods
    print(compatibility_markdown(), end="")


if __name__ == "__main__":
    _main()
