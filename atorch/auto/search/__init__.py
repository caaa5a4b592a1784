"""The fully automatic strategy search (see docs/search.md; its stages: engine.py).

The names below load on first use, so importing one stage (``from atorch.auto.search import
cost``) does not import the others.
"""

from atorch.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "SearchOptions": "atorch.auto.search.state",
    "search": "atorch.auto.search.engine",
    "CandidateResult": "atorch.auto.search.candidate",
    "SearchReport": "atorch.auto.search.report",
    "measure": "atorch.auto.search.given",
}, globals())

__all__ = ["CandidateResult", "SearchOptions", "SearchReport", "measure", "search"]
