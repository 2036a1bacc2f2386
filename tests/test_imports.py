"""Imports inside the package point one way: no cycle among lowp's modules, counting every
import statement (module level, inside functions, and under ``TYPE_CHECKING``)."""
from __future__ import annotations

import ast
from pathlib import Path

import lowp

ROOT = Path(lowp.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("lowp", *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The lowp modules one import statement loads (``from pkg import sub`` counts ``pkg.sub``
    when ``sub`` is a module, else ``pkg``)."""
    found = set()
    if isinstance(node, ast.Import):
        found = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        found = {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for node in ast.walk(ast.parse(path.read_text())) for t in _targets(node, modules)} - {name}
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_lazy_and_type_checking_imports():
    graph = _graph()
    assert "lowp.optim.kernels.triton.ops" in graph["lowp.optim.kernels.triton.kernel"]  # inside a method
    assert "lowp.optim.backends" in graph["lowp.optim.base"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (lazy and TYPE_CHECKING imports included): {cycles}"
