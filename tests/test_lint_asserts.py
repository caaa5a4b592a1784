"""A test that asserts nothing passes whatever the code does: every test must check something.

A ``test_*`` function (module level or in a class) passes this lint when its body, nested
functions included, holds an ``assert``, a ``pytest.raises`` / ``pytest.warns`` /
``pytest.fail``, or a call to a function whose name starts with ``assert_``, ``check_`` or
``expect_`` (the helpers in tests/helpers; a private ``_assert_...`` counts too). It does not follow calls into other helpers: a test
whose checks all live in a helper names it so (``assert_...``) or asserts on what it returns.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKING_PREFIXES = ("assert_", "check_", "expect_")
PYTEST_CHECKS = {"raises", "warns", "fail", "deprecated_call"}


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def checks_something(function: ast.AST) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if name is None:
                continue
            if name.lstrip("_").startswith(CHECKING_PREFIXES):
                return True
            if name in PYTEST_CHECKS and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest":
                return True
    return False


def _test_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    yield item


def offenders(root: Path = TESTS) -> list[str]:
    """``path:line name`` of every test function under ``root`` that checks nothing."""
    found = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for function in _test_functions(tree):
            if not checks_something(function):
                found.append(f"{path.relative_to(root.parent)}:{function.lineno} {function.name}")
    return found


def test_every_test_function_checks_something():
    found = offenders()
    assert not found, "test functions that assert nothing and expect no exception:\n" + "\n".join(found)


def test_the_lint_tells_checking_tests_from_empty_ones(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(
        "import pytest\n"
        "def test_asserts():\n    assert 1\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_helper():\n    _assert_refused({})\n"
        "def test_nested():\n    def inner():\n        assert 1\n    inner()\n"
        "def test_runs_only():\n    sum([1])\n"
        "class TestGroup:\n    def test_method_runs_only(self):\n        pass\n"
        "def helper_without_assert():\n    pass\n"
    )
    assert offenders(tmp_path / "tests") == [
        "tests/test_sample.py:13 test_runs_only",
        "tests/test_sample.py:16 test_method_runs_only",
    ]
