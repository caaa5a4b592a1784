"""Results the cost model computes from a model's structure, kept while one plan or search costs
its candidates: which layers a tensor split replaces, which units a pipeline stage holds, the
model's parameter bytes. Every candidate asks again for the same model; 256 candidates of a 70B
Llama spent most of ``atorch plan --search``'s time recomputing them (plan_shards alone 273
times).

Outside :func:`kept` nothing is kept, so a model changed between two searches is never costed
from a stale result; inside it the model must not change (the search and the plan cost a
pristine model and apply methods only to copies)."""

from collections.abc import Callable, Hashable
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
_kept: dict | None = None


@contextmanager
def kept():
    """Keep :func:`once`'s results until the block ends (nested blocks share the outer one's)."""
    global _kept
    outer = _kept
    _kept = {} if outer is None else outer
    try:
        yield
    finally:
        _kept = outer


def once(key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, or inside :func:`kept` the value it gave for ``key`` before. Put the
    model's ``id`` in ``key``: the model is alive for the whole block."""
    if _kept is None:
        return compute()
    if key not in _kept:
        _kept[key] = compute()
    return _kept[key]
