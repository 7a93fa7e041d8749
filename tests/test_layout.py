"""The package's layout keeps imports one-way: no module of tiller imports, directly or
through others, a module that imports it back (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import tiller

ROOT = Path(tiller.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and "tiller.controller" in graph["tiller.cli"]
    # packages re-export their modules, so skip package -> own-module edges
    acyclic = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    assert find_cycle(acyclic) is None, " -> ".join(find_cycle(acyclic))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_boxes_are_folders():
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "config", "engine", "rollout", "train", "tools", "envs", "observe", "serve", "gateway"}
