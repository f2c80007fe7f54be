"""No import cycle among the engine's modules, function-level imports counted.

A cycle broken at import time by a function-level import still ties two
modules into one: neither can be read, tested or replaced alone. The graph
is read with ``ast`` (nothing is imported): every ``import`` and ``from ...
import`` in a module, at any depth, except under ``if TYPE_CHECKING:``
(annotations only). ``from pkg import name`` is an edge to ``pkg.name`` when
that is a module, else to ``pkg``; importing ``pkg.mod`` is an edge to
``pkg.mod`` alone (its package's ``__init__`` runs first, but re-exporting
its own submodules is no cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mstar_actors", "actors", "transport")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``PACKAGES``."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import outside ``TYPE_CHECKING`` blocks."""
    found = []
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([node.module] if node.module else []))
            # ``pkg.name`` resolves to the module pkg.name if there is one, else to pkg.
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, within ``PACKAGES``."""
    modules = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(), str(path))
        for name, line in sorted(_imported_names(tree, module, path.name == "__init__.py"), key=lambda item: item[1]):
            target = _owning_module(name, modules)
            if target is not None and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (None: outside them)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        on_stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = on_stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"{a}:{line} -> {b}" for a in cycle for b, line in sorted(graph[a].items()) if b in cycle]
    return " | ".join(edges)


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, "the module walk found too few modules: is ROOT right?"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module:line -> module):\n" + "\n".join(describe(c, graph) for c in cycles)


def test_the_walk_sees_function_level_imports_and_skips_type_checking(tmp_path):
    """The checker itself: a cycle through a function-level import is found,
    one through a ``TYPE_CHECKING`` import is not."""
    package = tmp_path / "mstar_actors"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from mstar_actors import b\n")
    (package / "b.py").write_text("def f():\n    from mstar_actors.a import x\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mstar_actors import d\n")
    (package / "d.py").write_text("from . import c\n")
    for name in PACKAGES[1:]:
        (tmp_path / name).mkdir()
    graph = import_graph(tmp_path)
    assert find_cycles(graph) == [["mstar_actors.a", "mstar_actors.b"]]
    assert graph["mstar_actors.d"] == {"mstar_actors.c": 1} and graph["mstar_actors.c"] == {}
