"""A search report read back from JSON, checked field by field against the dataclasses that wrote
it: a damaged or hand-edited report is refused with the field and what it should hold, never a
TypeError from deep inside the table."""

import types
import typing
from dataclasses import fields
from typing import Any

STATUSES = ("measured", "pruned", "failed")


def check_report(report_cls, candidate_cls, data: Any) -> None:
    """Raise ValueError naming the first field of ``data`` (a report's JSON) that does not hold
    what ``report_cls`` / ``candidate_cls`` declare, or an index that points nowhere."""
    if not isinstance(data, dict):
        raise ValueError(f"a report is a JSON object, not {type(data).__name__}")
    _check_fields(report_cls, data, "report", skip=("candidates",))
    candidates = data.get("candidates", [])
    if not isinstance(candidates, list):
        raise ValueError(f"report.candidates must be a list, got {_shown(candidates)}")
    for index, candidate in enumerate(candidates):
        where = f"candidates[{index}]"
        if not isinstance(candidate, dict):
            raise ValueError(f"{where} must be an object, got {_shown(candidate)}")
        _check_fields(candidate_cls, candidate, where)
        _check_candidate(candidate, where)
    _check_indexes(data, len(candidates))


def _check_candidate(candidate: dict, where: str) -> None:
    methods = candidate.get("strategy", {}).get("methods")
    if not isinstance(methods, list) or not all(isinstance(m, dict) and isinstance(m.get("name"), str)
                                                 for m in methods):
        raise ValueError(f"{where}.strategy.methods must be a list of {{\"name\": ..., \"config\": ...}} objects")
    if candidate.get("status", "pruned") not in STATUSES:
        raise ValueError(f"{where}.status must be one of {list(STATUSES)}, got {_shown(candidate['status'])}")
    breakdown = candidate.get("estimate_breakdown") or {}
    wrong = [key for key, value in breakdown.items() if not _holds(value, float)]
    if wrong:
        raise ValueError(f"{where}.estimate_breakdown must hold numbers (bytes, FLOP, seconds), got "
                         f"{_shown({key: breakdown[key] for key in wrong})}")
    behind = candidate.get("side_by_side_behind")
    if behind is not None and len(behind) != 3:
        raise ValueError(f"{where}.side_by_side_behind must be [median, low, high], got {_shown(behind)}")


def _check_indexes(data: dict, count: int) -> None:
    winner = data.get("winner")
    if winner is not None and not 0 <= winner < count:
        raise ValueError(f"report.winner is {winner}, but the report has {count} candidates")
    refined_from = data.get("refined_from")
    if refined_from is not None and not 0 <= refined_from < count:
        raise ValueError(f"report.refined_from is {refined_from}, but the report has {count} candidates")
    for index in data.get("tied") or ():
        if not 0 <= index < count:
            raise ValueError(f"report.tied lists {index}, but the report has {count} candidates")


def _check_fields(cls, data: dict, where: str, skip: tuple = ()) -> None:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for name, value in data.items():
        if name in skip:
            continue
        if name not in known:
            raise ValueError(f"{where} has an unknown field {name!r} (known: {', '.join(sorted(known))})")
        if not _holds(value, hints[name]):
            raise ValueError(f"{where}.{name} must be {_described(hints[name])}, got {_shown(value)}")


def _holds(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from JSON) is of the type ``hint`` declares."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_holds(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list or hint is list:
        return isinstance(value, list) and all(_holds(item, args[0]) for item in value) if args else \
            isinstance(value, list)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False
        return not args or all(_holds(k, args[0]) and _holds(v, args[1]) for k, v in value.items())
    return True


def _described(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        named = [_described(arg) for arg in args if arg is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if typing.get_origin(hint) is list:
        return f"a list of {_PLURAL.get(args[0], _described(args[0]))}" if args else "a list"
    if typing.get_origin(hint) is dict or hint is dict:
        return "an object"
    return {int: "a whole number", float: "a number", str: "text", bool: "true or false"}.get(hint, str(hint))


_PLURAL = {int: "whole numbers", float: "numbers", str: "texts"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
