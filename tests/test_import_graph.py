"""pykv's import graph (``pykv/**/*.py``, commands included) has no cycle (issue 37).

Read from the source, not by importing: an absolute ``pykv.`` or relative import names the
deepest module it reaches (``from pykv.x import y`` is ``pykv.x.y`` when that is a module, else
``pykv.x``), and importing a module first runs its packages' ``__init__``. An import at module
level (under ``if TYPE_CHECKING:`` excepted: it never runs) makes an edge; one inside a function
runs later and is *lazy*. A lazy import may avoid a cycle only when ``LAZY_CYCLE_BREAKS`` says why.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pykv"

LAZY_CYCLE_BREAKS = {
    ("pykv.commands.completions", "pykv.commands.app"):
        "the app registers completions' command; render_all() takes that app by default, so it "
        "imports it when called, not when completions is loaded",
}
"""(importer, imported) -> why: lazy imports whose module imports the importer at module level."""


def _modules() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = _modules()


def _deepest(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The pykv modules one import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module or ""])
        else:
            base = node.module or ""
        base = base.rstrip(".")
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return {found for name in names if name.split(".")[0] == "pykv" and (found := _deepest(name)) not in (None, module)}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"


@lru_cache(maxsize=None)
def _imports(module: str) -> tuple[set[str], dict[str, int]]:
    """``module``'s module-level imports, and its lazy ones (imported module -> first line)."""
    eager: set[str] = set()
    lazy: dict[str, int] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child) and not in_function:
                for branch in child.orelse:
                    visit(ast.Module(body=[branch], type_ignores=[]), in_function)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, child):
                    if in_function:
                        lazy.setdefault(target, child.lineno)
                    else:
                        eager.add(target)
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])), False)
    return eager, lazy


def _runtime_graph() -> dict[str, set[str]]:
    """Module-level edges, each import also reaching the packages above its module (not the importer's own)."""
    graph = {}
    for module in MODULES:
        eager, _ = _imports(module)
        packages = {".".join(t.split(".")[:i]) for t in eager for i in range(1, t.count(".") + 1)}
        graph[module] = eager | {p for p in packages if not (module + ".").startswith(p + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_tarjan_finds_each_cycle_once():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"d"}, "e": {"a"}}
    assert cycles(graph) == [["d"], ["a", "b", "c"]]


def test_the_scan_reads_absolute_relative_and_lazy_imports():
    assert "pykv.commands.completions" in _runtime_graph()["pykv.commands.app"]
    assert {"pykv.io.memory", "pykv.io"} <= _runtime_graph()["pykv.staging"]  # a module and its package
    assert _targets("pykv.reactor.core", ast.parse("from . import types").body[0]) == {"pykv.reactor.types"}
    assert _targets("pykv.reactor.core", ast.parse("from ..lanes import LaneCalls").body[0]) == {"pykv.lanes"}
    assert _targets("pykv.reactor", ast.parse("from .core import Reactor").body[0]) == {"pykv.reactor.core"}
    assert "pykv.commands.app" in _imports("pykv.commands.completions")[1]


def test_no_import_cycle_at_module_level():
    assert cycles(_runtime_graph()) == []


def test_a_lazy_import_avoids_a_cycle_only_where_documented():
    graph = _runtime_graph()
    breaks = {(module, target): f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}"
              for module in MODULES for target, line in _imports(module)[1].items() if _reaches(graph, target, module)}
    assert {pair: where for pair, where in breaks.items() if pair not in LAZY_CYCLE_BREAKS} == {}
    assert set(LAZY_CYCLE_BREAKS) <= set(breaks), "a documented cycle break is gone: drop its entry"
