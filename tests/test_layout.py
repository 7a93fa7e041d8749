"""The package's layout keeps imports one-way.

1. No cycles: no module of tiller imports, directly or through others, a module that imports it
   back (lazy imports inside functions and `if TYPE_CHECKING:` imports count too).
2. Boxes are folders: each box of the architecture (docs/architecture.md) is one folder; the
   modules at the top are the foundation (errors, files, runtime, seeds), the wiring (models,
   fetch, plugins, preflight, checkpoints, resume, run, controller, trust) and the entry
   points (api, cli, __main__, the package).
3. Layers: a box imports only the boxes `ALLOWED` lists for it, each in a lower tier of
   `TIERS`, so the allowed imports are a DAG. From the bottom:

       errors < files, runtime, seeds < algorithms, tools < envs < plugins < config < engine
       < rollout < models, serve < train, fetch < observe, gateway < preflight < checkpoints
       < resume < run, trust < controller < api, cli < __main__, tiller

   So envs and tools never import engine, rollout or train; the algorithm library (registries,
   presets and their resolution) imports only errors, so config validates against it; the
   engine never imports envs, rollout, train, serve or gateway; nothing below the wiring
   imports run or controller. The wiring and entry points may import any lower tier. Imports
   made only for annotations (`if TYPE_CHECKING:`) are not counted here (envs annotate with
   `Config`). `EXCEPTIONS` lists the imports against the layers that exist today, each with
   the reason; the test fails on any other, and on an exception that no longer occurs.
4. The engine comes from engine/: a name a module of tiller.engine defines is imported from
   tiller.engine, never through another box that imported it (so serve/, gateway/ and train/
   get the engine from engine/, never from rollout/).
5. Sizes: no function (methods and nested functions included, from `def` to its last line) over
   `MAX_FUNCTION_LINES`, no module over `MAX_MODULE_LINES`. `SIZE_ALLOWANCES` would name an
   offender with its size (it may shrink, not grow, and must leave the list once it fits); it
   is empty since issue 20 split the last ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tiller

ROOT = Path(tiller.__file__).parent

TIERS: list[tuple[str, ...]] = [
    ("errors",), ("files", "runtime", "seeds"), ("algorithms", "tools"), ("envs",), ("plugins",),
    ("config",),
    ("engine",), ("rollout",), ("models", "serve"), ("train", "fetch"), ("observe", "gateway"),
    ("preflight",), ("checkpoints",), ("resume",), ("run", "trust"), ("controller",),
    ("api", "cli"), ("__main__", "tiller"),
]
# what each box and each shared top-level module may import; the wiring and entry points
# (not listed) may import anything in a lower tier
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "files": {"errors"},
    "runtime": {"errors"},
    "seeds": set(),
    "algorithms": {"errors"},
    "tools": {"errors", "files", "runtime"},
    "envs": {"errors", "tools"},
    "plugins": {"envs", "errors", "tools"},
    "config": {"algorithms", "envs", "errors", "tools"},
    "engine": {"config", "errors", "files"},
    "rollout": {"config", "engine", "envs", "errors", "seeds", "tools"},
    "models": {"config", "envs", "errors", "files", "rollout"},
    "serve": {"engine", "envs", "errors", "rollout"},
    "train": {"algorithms", "config", "engine", "envs", "errors", "models", "rollout"},
    "observe": {"algorithms", "errors", "files", "rollout", "seeds", "serve", "train"},
    "gateway": {"engine", "envs", "errors", "rollout", "seeds", "serve"},
}
# imports against the layers today: (importer, imported module) -> why, and what removes it
EXCEPTIONS: dict[tuple[str, str], str] = {
}

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
MAX_RL_LINES = 30  # controller.rl, the RL loop (issue 20 acceptance: it reads as the algorithm)
# offenders (module, or module.qualified.function) -> their size in lines: none
SIZE_ALLOWANCES: dict[str, int] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in ROOT.rglob("*.py")}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _nodes(tree: ast.AST, runtime_only: bool):
    """Every node of `tree`; with `runtime_only`, none inside an `if TYPE_CHECKING:` body."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if runtime_only and _type_checking(node):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(modules: dict[str, str] | None = None, runtime_only: bool = False
                 ) -> dict[str, set[str]]:
    """Module -> the tiller modules it imports. `from pkg import mod` counts pkg.mod (and pkg,
    unless `runtime_only`: then only what is imported, so `from tiller import controller` is
    an import of the controller, not of the package)."""
    modules = sources() if modules is None else modules
    graph: dict[str, set[str]] = {}
    for name, text in modules.items():
        deps = set()
        for node in _nodes(ast.parse(text), runtime_only):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                whole = not runtime_only or not all(s in modules for s in subs)
                targets = [node.module] * whole + subs
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


def box(module: str) -> str:
    """tiller.engine.http -> engine; tiller.errors -> errors; tiller -> tiller."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def tier_problems(tiers: list[tuple[str, ...]], allowed: dict[str, set[str]]) -> list[str]:
    """Boxes named twice in `tiers`, and allowed imports that are not of a lower tier."""
    level = {b: i for i, group in enumerate(tiers) for b in group}
    problems = [f"{b} is in more than one tier" for b in level
                if sum(b in group for group in tiers) > 1]
    for b, deps in sorted(allowed.items()):
        problems += [f"{b} may import {d}, which is not in a lower tier" for d in sorted(deps)
                     if b not in level or d not in level or level[d] >= level[b]]
    return problems


def layer_violations(graph: dict[str, set[str]], tiers: list[tuple[str, ...]],
                     allowed: dict[str, set[str]], exceptions: dict[tuple[str, str], str]
                     ) -> tuple[list[str], list[tuple[str, str]]]:
    """(imports against the layers that are not exceptions, exceptions that did not occur).
    A box in `allowed` may import only those boxes; any other box, only lower tiers."""
    level = {b: i for i, group in enumerate(tiers) for b in group}
    bad, seen = [], set()
    for module, deps in sorted(graph.items()):
        if box(module) not in level:
            bad.append(f"{module}: box {box(module)!r} is in no tier")
            continue
        for dep in sorted(deps):
            mine, theirs = box(module), box(dep)
            ok = (theirs in allowed[mine] if mine in allowed
                  else level.get(theirs, len(tiers)) < level[mine])
            if mine == theirs or ok:
                continue
            if (module, dep) in exceptions:
                seen.add((module, dep))
            else:
                bad.append(f"{module} imports {dep}: {mine} may not import {theirs}")
    return bad, [e for e in exceptions if e not in seen]


def engine_reexports(modules: dict[str, str]) -> list[str]:
    """`from M import N` where N is defined by a module of tiller.engine and M is a module
    outside it that imported N itself: the engine reached through another box."""
    engine_names, imported = set(), {}
    for name, text in modules.items():
        tree = ast.parse(text)
        if box(name) == "engine":
            for n in tree.body:
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    engine_names.add(n.name)
                elif isinstance(n, ast.Assign | ast.AnnAssign):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    engine_names |= {t.id for t in targets if isinstance(t, ast.Name)}
        imported[name] = {a.asname or a.name for n in ast.walk(tree)
                          if isinstance(n, ast.ImportFrom) and n.module
                          and n.module.startswith("tiller.engine") for a in n.names}
    engine_names -= {"logger", "T"}  # module plumbing, not the engine's names
    bad = []
    for name, text in modules.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                via = node.module
                bad += [f"{name} imports {a.name} from {via}, not from tiller.engine"
                        for a in node.names if box(via) != "engine"
                        and a.name in engine_names and a.name in imported[via]]
    return bad


def oversized(modules: dict[str, str], max_function: int = MAX_FUNCTION_LINES,
              max_module: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Name -> lines of every module over `max_module` lines and every function over
    `max_function` (methods and nested functions too, named by their qualified path, from the
    `def` line to the last; decorators not counted)."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{child.name}"
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = child.end_lineno - child.lineno + 1
                if lines > max_function:
                    found[name] = max(lines, found.get(name, 0))
            visit(child, name)

    for module, text in modules.items():
        if (lines := len(text.splitlines())) > max_module:
            found[module] = lines
        visit(ast.parse(text), module)
    return found


def size_problems(found: dict[str, int], allowances: dict[str, int]) -> list[str]:
    """Offenders not allowed or grown past their allowance, and allowances no longer needed."""
    problems = [f"{name}: {lines} lines (allowed: {allowances[name]})" if name in allowances
                else f"{name}: {lines} lines" for name, lines in sorted(found.items())
                if lines > allowances.get(name, 0)]
    return problems + [f"{name} fits now: remove it from SIZE_ALLOWANCES"
                       for name in sorted(allowances) if name not in found]


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
        "algorithms", "config", "engine", "envs", "gateway", "observe", "rollout", "serve", "tools",
        "train"}


def test_the_tiers_order_the_allowed_imports():
    assert tier_problems(TIERS, ALLOWED) == []
    assert {b for group in TIERS for b in group} >= set(ALLOWED)


def test_imports_go_down_the_layers():
    graph = import_graph(runtime_only=True)
    assert "tiller.engine.api" in graph["tiller.rollout.agent_loop"]  # the graph is real
    bad, unused = layer_violations(graph, TIERS, ALLOWED, EXCEPTIONS)
    assert bad == []
    assert unused == [], f"these exceptions no longer occur: remove them: {unused}"


def test_the_engine_comes_from_engine():
    modules = sources()
    assert engine_reexports(modules) == []
    assert "tiller.engine.api" in import_graph(modules)["tiller.serve.server"]


def test_the_layer_checker_finds_wrong_imports():
    """Each rule fails on a deliberately wrong import in a small synthetic package."""
    tiers = [("errors",), ("envs",), ("engine",), ("rollout",), ("run",)]
    allowed = {"errors": set(), "envs": {"errors"}, "engine": {"errors"},
               "rollout": {"engine", "envs"}}
    good = {"tiller.envs.a": {"tiller.errors"}, "tiller.rollout.b": {"tiller.engine.c"},
            "tiller.engine.c": set(), "tiller.errors": set(),
            "tiller.run": {"tiller.rollout.b", "tiller.envs.a"}}
    assert layer_violations(good, tiers, allowed, {}) == ([], [])
    upward = {**good, "tiller.envs.a": {"tiller.rollout.b"}}  # envs importing rollout
    assert layer_violations(upward, tiers, allowed, {})[0] == [
        "tiller.envs.a imports tiller.rollout.b: envs may not import rollout"]
    sideways = {**good, "tiller.engine.c": {"tiller.envs.a"}}  # lower tier, but not allowed
    assert layer_violations(sideways, tiers, allowed, {})[0] == [
        "tiller.engine.c imports tiller.envs.a: engine may not import envs"]
    wiring_up = {**good, "tiller.engine.c": {"tiller.run"}}  # a box importing the wiring
    assert len(layer_violations(wiring_up, tiers, allowed, {})[0]) == 1
    excused = {("tiller.envs.a", "tiller.rollout.b"): "why"}
    assert layer_violations(upward, tiers, allowed, excused) == ([], [])
    assert layer_violations(good, tiers, allowed, excused) == ([], list(excused))  # stale
    stray = {**good, "tiller.newbox.x": set()}
    assert layer_violations(stray, tiers, allowed, {})[0] == [
        "tiller.newbox.x: box 'newbox' is in no tier"]
    assert tier_problems(tiers, {**allowed, "envs": {"rollout"}}) == [
        "envs may import rollout, which is not in a lower tier"]


def test_the_import_graph_skips_annotations_only_for_the_layers():
    modules = {"tiller.envs.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from tiller.config import Config\n",
               "tiller.config": "def f():\n    from tiller.envs.a import x\n"}
    assert import_graph(modules) == {"tiller.envs.a": {"tiller.config"},
                                     "tiller.config": {"tiller.envs.a"}}
    assert import_graph(modules, runtime_only=True) == {"tiller.envs.a": set(),
                                                        "tiller.config": {"tiller.envs.a"}}


def test_the_reexport_checker_finds_the_engine_through_rollout():
    modules = {"tiller.engine.api": "class Generation: ...\n",
               "tiller.rollout.agent_loop": "from tiller.engine.api import Generation\n",
               "tiller.gateway.session": "from tiller.engine.api import Generation\n"}
    assert engine_reexports(modules) == []
    modules["tiller.gateway.session"] = "from tiller.rollout.agent_loop import Generation\n"
    assert engine_reexports(modules) == [
        "tiller.gateway.session imports Generation from tiller.rollout.agent_loop, not from "
        "tiller.engine"]


def test_no_function_over_80_lines_and_no_module_over_600():
    found = oversized(sources())
    assert size_problems(found, SIZE_ALLOWANCES) == []


def test_controller_rl_fits_30_lines():
    lines = oversized({"tiller.controller": sources()["tiller.controller"]}, max_function=0,
                      max_module=10**6)  # every function, with its size
    assert 20 <= lines["tiller.controller.rl"] <= MAX_RL_LINES, lines["tiller.controller.rl"]


def test_the_size_checker_finds_long_functions_and_modules():
    def body(indent: int) -> str:  # five statements
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(5))

    modules = {"tiller.a": "class C:\n    def m(self):\n" + body(8)  # m: 6 lines
                           + "def f():\n" + body(4) + "    def g():\n" + body(8),  # f: 12, g: 6
               "tiller.b": "x = 1\n" * 20}  # tiller.a: 19 lines
    found = oversized(modules, max_function=5, max_module=19)
    assert found == {"tiller.a.C.m": 6, "tiller.a.f": 12, "tiller.a.f.g": 6, "tiller.b": 20}
    assert oversized(modules, max_function=12, max_module=20) == {}
    assert size_problems(found, {**found, "tiller.a.f": 11, "tiller.gone": 90}) == [
        "tiller.a.f: 12 lines (allowed: 11)",
        "tiller.gone fits now: remove it from SIZE_ALLOWANCES"]
    assert size_problems({"tiller.a.f": 12}, {}) == ["tiller.a.f: 12 lines"]
