"""The shape of atorch's code, measured: functions longer than a limit, and import circles.

An import circle is a set of modules each of which reaches the others through imports (Tarjan's
strongly connected components). Every ``import`` counts, module-level or inside a function (a
function-local import only hides a circle until the function runs), except those under ``if
TYPE_CHECKING:``. ``from package import name`` depends on the submodule ``package.name`` where
there is one, else on the package's ``__init__`` (even from inside the package: a name read
from a package that is still initialising is the classic circular-import error).

    python -m tests.helpers.code_shape            # atorch's long functions and circles
"""

import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (a package directory) by its dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool, known: dict):
        self.name, self.is_package, self.known, self.found = name, is_package, known, set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(alias.name for alias in node.names if alias.name in self.known)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            here = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join(here + ([node.module] if node.module else []))
        subs = [f"{base}.{alias.name}" for alias in node.names]
        self.found.update(sub for sub in subs if sub in self.known)
        if base in self.known and any(sub not in self.known for sub in subs):
            self.found.add(base)


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    graph = {}
    for name, path in known.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text()))
        graph[name] = visitor.found - {name}
    return graph


def import_circles(root: Path) -> list[list[str]]:
    """The import circles under ``root``, largest first (each a sorted list of modules)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(circles, key=lambda members: (-len(members), members))


def long_functions(root: Path, limit: int) -> list[tuple[int, str]]:
    """``(lines, "path:function")`` for each function or method under ``root`` longer than
    ``limit`` lines (its decorators left out, its docstring in), longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path}:{node.name}"))
    return sorted(found, reverse=True)


if __name__ == "__main__":
    atorch = Path(__file__).resolve().parents[2] / "atorch"
    for lines, where in long_functions(atorch, 80):
        print(f"{lines:4d} lines  {where}")
    for members in import_circles(atorch):
        print(f"circle of {len(members)}: {', '.join(members)}")
