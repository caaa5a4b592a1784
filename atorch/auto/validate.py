"""Check a strategy file and report every problem in it at once (``atorch validate``).

``auto_accelerate`` stops at the first error, which is right for a job; a person editing a file
wants the whole list. Each method entry is validated on its own, every conflict is listed, the
file is fitted to a world size when one is given, and each method's ``resolve`` meets a model
when one is given (a class name the model does not have, say).

    check = check_strategy_file("strategies/lora_fsdp_bf16.json", world_size=8, model=model)
    check.problems   # [] when the file is good; else one message per problem
    print(check.summary())
"""

import os
from dataclasses import dataclass, field

import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.fit_dims import FitJob
from atorch.auto.plan import in_applied_order, plan_strategy, relation_problems
from atorch.auto.registry import get_method
from atorch.auto.strategy import Strategy, _split_item, make_config, method_entries, read_strategy_file
from atorch.errors import AtorchConfigError


@dataclass
class StrategyCheck:
    source: str
    description: str | None = None
    strategy: Strategy | None = None  # the methods that validate, as written
    planned: Strategy | None = None  # fitted to the world size, when one was given
    notes: list[str] = field(default_factory=list)  # what fitting changed, and why
    resolved: Strategy | None = None  # with the model's choices filled in, when a model was given
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self, world_size: int | None = None, device: str = "cuda") -> str:
        if self.problems:
            count = len(self.problems)
            lines = [f"{self.source}: {count} problem{'s' if count > 1 else ''}"]
            if self.description:
                lines.append(f"  (the file says: {self.description})")
            lines += [f"  {i}. {problem}" for i, problem in enumerate(self.problems, 1)]
            return "\n".join(lines)
        lines = [f"{self.source}: valid", str(self.strategy)]
        if world_size is None:
            lines.append("(checked at any world size; add --world-size N to see it fitted to N ranks)")
        else:
            lines.append(f"on {world_size} x {device}:")
            lines += [f"  - {note}" for note in self.notes] or ["  (no changes)"]
            if self.notes:
                lines.append(str(self.planned))
        if self.resolved is not None:
            lines.append("against the model:")
            lines.append(str(self.resolved))
        return "\n".join(lines)


def check_strategy_file(
    path: str | os.PathLike,
    world_size: int | None = None,
    device: str = "cuda",
    model: torch.nn.Module | None = None,
) -> StrategyCheck:
    """Every problem of the strategy file at ``path``; see the module docstring.

    A file that cannot be read at all (missing, not JSON, a pickle) raises StrategyFileError.
    Conflicts between methods are problems at any world size: a pair that one process would
    drop (zero2 + fsdp) is still refused.
    """
    source = str(path)
    entries, description = method_entries(read_strategy_file(path), f"strategy file {source!r}")
    check = StrategyCheck(source, description)
    methods, invalid = _entries(entries, check.problems)
    check.strategy = Strategy(methods, description)
    # A method whose config is invalid still takes part in the relations, at its default config:
    # its conflicts are problems of their own (every problem in one run, not one per fix).
    named = Strategy([*methods, *((name, make_config(name)) for name in invalid)], description)
    try:
        check.problems += relation_problems(in_applied_order(named))
    except AtorchConfigError as error:
        check.problems.append(str(error))

    # Fitting and resolving go on with what is left: the methods that validate and are in no
    # conflict (a conflicting pair would only repeat its problem), so that one bad config does
    # not hide a world-size or a model problem (one rerun per fix).
    target = check.strategy
    for name in _in_relation_problems(check.strategy):
        target = target.without(name)
    if world_size is not None and len(target):
        capability = (9, 0) if device == "cuda" else None
        device_ctx = DeviceContext(world_size, min(world_size, 8), torch.device(device), capability, 2**40)
        try:
            planned, notes = plan_strategy(target, device_ctx, job=FitJob(model))
        except AtorchConfigError as error:
            check.problems.append(f"on {world_size} ranks: {error}")
        else:
            target = planned
            if not check.problems:
                check.planned, check.notes = planned, notes
    if model is not None and len(check.strategy):
        # every method meets the model, those left out of fitting (a conflict) as written
        written = [(name, config) for name, config in check.strategy.items() if name not in target]
        resolved = _resolve_each(model, Strategy([*target.items(), *written]), check.problems)
        if not check.problems:
            check.resolved = resolved
    return check


def _entries(entries: list, problems: list[str]) -> tuple[list, list[str]]:
    """The entries whose config validates, as ``(name, config)``, and the registered names whose
    config does not; each entry's problem appended to ``problems``."""
    methods, invalid = [], []
    for index, item in enumerate(entries, 1):
        name = None
        try:
            name, raw = _split_item(item)
            if name in [n for n, _ in methods] or name in invalid:
                raise AtorchConfigError(f"method {name!r} appears twice in the strategy; keep one entry")
            methods.append((name, make_config(name, raw)))
        except AtorchConfigError as error:
            problems.append(f"method {index}: {error}{_field_fix(item, str(error))}")
            if name is not None and name not in invalid and name not in [n for n, _ in methods] \
                    and _registered(name):
                invalid.append(name)
    return methods, invalid


def _registered(name: str) -> bool:
    try:
        get_method(name)
    except AtorchConfigError:
        return False
    return True


def _field_fix(item, message: str) -> str:
    """". Fix: ..." for each unknown field of a config: the field it is closest to, or remove it."""
    import difflib
    import re

    unknown = re.findall(r"unknown field '([^']+)'", message)
    if not unknown:
        return ""
    try:
        fields = list(get_method(_split_item(item)[0]).config_cls.model_fields)
    except AtorchConfigError:
        return ""
    fixes = []
    for name in unknown:
        close = difflib.get_close_matches(name.split(".")[-1], fields, n=1)
        fixes.append(f"rename {name!r} to {close[0]!r}" if close else f"remove {name!r}")
    return ". Fix: " + "; ".join(fixes)


def _in_relation_problems(strategy: Strategy) -> set[str]:
    """The methods of ``strategy`` named in a conflict or a missing requirement."""
    names: set[str] = set()
    for name, config in strategy.items():
        spec = get_method(name)
        try:
            conflicts = [other for other in spec.related("conflicts", config) if other in strategy]
            missing = [other for other in spec.related("requires", config) if other not in strategy]
        except AtorchConfigError:
            names.add(name)
            continue
        if conflicts:
            names.update([name, *conflicts])
        if missing:
            names.add(name)
    return names


def _resolve_each(model: torch.nn.Module, strategy: Strategy, problems: list[str]) -> Strategy:
    """Each method's ``resolve`` on its own, so that one bad class name does not hide another."""
    resolved = strategy
    for name, config in strategy.items():
        spec = get_method(name)
        if spec.resolve is None:
            continue
        try:
            resolved = resolved.replace(name, spec.resolve(model, config))
        except AtorchConfigError as error:
            problems.append(str(error))
        except Exception as error:  # noqa: BLE001 - a method that cannot look at a meta model
            problems.append(f"{name}: could not be checked against the model ({type(error).__name__}: {error})")
    return resolved
