"""The one registry of optimization methods, read by the appliers and the search alike.

A method is one file in ``atorch/methods``: its pydantic ``Config``, a :class:`MethodSpec` with
its metadata (atorch/auto/method_spec.py), and one function per :class:`Stage` it acts in. Order
and compatibility are data in the spec; the engine sorts and checks them once. The built-in
methods are loaded on the first lookup (``_ensure_builtin_methods``): they import
method_spec.py, never this module, so loading them is not an import circle.
"""

import difflib

from atorch.auto.method_spec import (  # noqa: F401 - the registry's public names, defined in the leaf
    _REGISTRY,
    DS_ACCUMULATES,
    ONE_SHARDING,
    Hook,
    LayoutJob,
    MethodSpec,
    Relation,
    Stage,
    register_method,
    unregister_method,
)
from atorch.errors import UnknownMethodError


def get_method(name: str) -> MethodSpec:
    """The spec of ``name``; an unknown name raises an error that lists the registered ones."""
    _ensure_builtin_methods()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownMethodError(
            f"unknown method {name!r}.{hint} Registered methods: {', '.join(sorted(_REGISTRY))}"
        ) from None


def method_names() -> list[str]:
    _ensure_builtin_methods()
    return list(_REGISTRY)


def all_methods() -> list[MethodSpec]:
    _ensure_builtin_methods()
    return list(_REGISTRY.values())


def absorbed_methods(strategy) -> set[str]:
    """The methods of ``strategy`` (a :class:`~atorch.auto.strategy.Strategy`) whose work another of
    its methods takes over (``absorbs`` under that method's config): their ``skipped_when_absorbed``
    stages do not run, and the cost model probes them with their ``absorbed_probe``."""
    return {other for name, config in strategy.items() for other in get_method(name).related("absorbs", config)
            if other in strategy}


def _ensure_builtin_methods() -> None:
    # The method files register themselves on import; importing here keeps ``atorch.auto``
    # usable on its own without a circular import at package load time.
    import atorch.methods  # noqa: F401
