import sys
import types

import pytest

from atorch.utils.lazy import lazy_exports


def test_lazy_exports_import_on_first_use(monkeypatch):
    package = types.ModuleType("lazypkg")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "lazypkg", package)
    package.__getattr__, package.__dir__ = lazy_exports("lazypkg", {"rgb_to_hsv": "colorsys"}, package.__dict__)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    assert "rgb_to_hsv" in dir(package) and "rgb_to_hsv" not in package.__dict__
    assert "colorsys" not in sys.modules
    assert package.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0) and "colorsys" in sys.modules
    assert package.__dict__["rgb_to_hsv"] is sys.modules["colorsys"].rgb_to_hsv  # stored: the next read is plain
    with pytest.raises(AttributeError, match="'lazypkg' has no attribute 'nothing'"):
        package.nothing


def test_atorch_and_atorch_auto_resolve_their_names():
    import atorch
    import atorch.auto
    from atorch.auto.strategy import Strategy

    assert atorch.Strategy is Strategy and atorch.auto.Strategy is Strategy
    assert atorch.auto.search.__name__ == "atorch.auto.search"  # a submodule by attribute
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        atorch.nope
