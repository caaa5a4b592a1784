"""The shape of the code the docs promise (docs/dev/search_internals.md): functions a reader can
take in at once, and no import circle of more than two modules, in all of atorch/."""

from pathlib import Path

from tests.helpers.code_shape import import_circles, long_functions

ATORCH = Path(__file__).resolve().parents[1] / "atorch"
MAX_FUNCTION_LINES = 80
# The pairs left (each a module and a helper that imports it back inside a function), named so a
# new one shows: pipeline's layouts and the tracer, intra_layer's Linear and its overlap, the
# ATorch strategy front and its files.
KNOWN_PAIRS = [
    ["atorch.compat.antgroup.strategy", "atorch.compat.antgroup.strategy_io"],
    ["atorch.intra_layer.linear", "atorch.intra_layer.overlap"],
    ["atorch.pipeline.layouts", "atorch.pipeline.traced"],
]


def test_no_function_is_longer_than_the_limit():
    assert long_functions(ATORCH, MAX_FUNCTION_LINES) == []


def test_no_import_circle_beyond_the_known_pairs():
    circles = import_circles(ATORCH)
    assert all(len(circle) <= 2 for circle in circles), circles
    assert circles == KNOWN_PAIRS


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_measures_see_a_circle_and_a_long_function(tmp_path):
    """The measures themselves can fail: a circle through a function-local import and through a
    package's ``__init__`` is found; a submodule imported through its package is not a circle."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "def f():\n    from pkg.b import g\n    return g()\n",
        "pkg/b.py": "from pkg import c\n\ndef g():\n    return c.h()\n",
        "pkg/c.py": "import pkg.a\n\ndef h():\n" + "    x = 1\n" * 85 + "    return x\n",
        "pkg/d.py": "from pkg import f\n",  # the package's own name: depends on __init__
        "pkg/e.py": "from pkg import b\n",  # a submodule through the package: depends on b only
        "pkg/typing_only.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
    })
    assert import_circles(pkg) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert [where.rsplit(":", 1)[1] for _, where in long_functions(pkg, MAX_FUNCTION_LINES)] == ["h"]
    (pkg / "a.py").write_text("from pkg.d import x\n")  # a -> d -> __init__ -> a
    assert ["pkg", "pkg.a", "pkg.d"] in import_circles(pkg)
