"""A package's names imported on first use (PEP 562); imports nothing but importlib.

    # atorch/auto/__init__.py
    from atorch.utils.lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, {"Strategy": "atorch.auto.strategy"}, globals())

``atorch.auto.Strategy`` imports ``atorch.auto.strategy`` when first read; ``atorch.auto.search``
(a submodule not imported yet) imports it. So ``import atorch`` and the ``atorch`` command start
without torch, and a package's heavy modules load only when something uses them.
"""

import importlib
from collections.abc import Callable


def lazy_exports(package: str, names: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps an exported name to its module.

    A name read once is stored in ``namespace`` (the package's ``globals()``), so later reads
    do not come back here. Any other attribute is tried as a submodule, then ``AttributeError``.
    """

    def __getattr__(name: str):
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value
            return value
        try:  # a submodule not imported yet
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
