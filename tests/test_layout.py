"""The shape of the package: no import cycle between its modules (`TYPE_CHECKING` imports included), faces
over the core, no face importing another, the job runtime apart from the web framework."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "service" / "logdx"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set[str], current: str, *, type_checking: bool = True) -> set[str]:
    """The package's modules a module imports, anywhere in it (a lazy import inside a function is still
    a dependency; so is one under `if TYPE_CHECKING:`, unless `type_checking` is false: naming another
    module's class for annotations couples the two as surely as importing it)."""
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := resolve(alias.name)) is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                target = resolve(f"{node.module}.{alias.name}") or resolve(node.module)
                if target is not None:
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(current)
    return found


def _external(tree: ast.AST) -> set[str]:
    """The top-level names of what a module imports from outside the package (`fastapi`, `starlette`...)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.partition(".")[0])
    found.discard("logdx")
    return found


@functools.cache  # the package does not change during a run: parsed once for every test here
def _trees() -> dict[str, ast.AST]:
    return {_module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    trees = _trees()
    return {name: _imports(tree, set(trees), name) for name, tree in trees.items()}


@functools.cache
def runtime_graph() -> dict[str, set[str]]:
    """The graph without the imports under `if TYPE_CHECKING:`."""
    trees = _trees()
    return {name: _imports(tree, set(trees), name, type_checking=False) for name, tree in trees.items()}


@functools.cache
def external_imports() -> dict[str, set[str]]:
    return {name: _external(tree) for name, tree in _trees().items()}


def reaches(graph: dict[str, set[str]], start: str, goal: Callable[[str], bool],
            within: Callable[[str], bool] = lambda _m: True) -> bool:
    """Whether `start` or a module it imports (following only modules `within` says) satisfies `goal`."""
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        if goal(node):
            return True
        for nxt in graph.get(node, ()):
            if nxt not in seen and within(nxt):
                seen.add(nxt)
                todo.append(nxt)
    return False


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := dfs(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


# Annotation-only imports that still close a circle, in files other work owns at the moment; each is to
# become a Protocol of what it uses (as jobs/ports.py, culprit.Finding, model.TimeoutFacts did). The list
# only shrinks: an edge that is gone, or that is a run-time import, fails the test below.
KNOWN_ANNOTATION_CIRCLES: set[tuple[str, str]] = set()  # none left

FACES = ("logdx.cli", "logdx.api", "logdx.run", "logdx.agent")
WEB = frozenset({"fastapi", "starlette", "uvicorn"})
WIRE = "logdx.wire"


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_package_has_no_import_cycle():
    graph = {m: set(targets) for m, targets in import_graph().items()}
    runtime = runtime_graph()
    for source, target in KNOWN_ANNOTATION_CIRCLES:
        assert target in graph[source] and target not in runtime[source], \
            f"{source} -> {target} is no longer an annotation-only import: take it off KNOWN_ANNOTATION_CIRCLES"
        graph[source].discard(target)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (TYPE_CHECKING imports count): " + " -> ".join(cycle or [])


def test_no_face_imports_another_face():
    face_of = {m: next((f for f in FACES if _in(m, f)), None) for m in import_graph()}
    bad = sorted((m, t) for m, targets in import_graph().items() if face_of[m]
                 for t in targets if face_of[t] and face_of[t] != face_of[m])
    assert bad == [], "a face imports another (share it through a neutral module: logdx.faces, logdx.wire...)"


def test_the_http_face_is_only_http():
    """Every module of `logdx.api` imports the web framework or the wire models (itself or through another
    module of `logdx.api`): one that does neither is runtime, and belongs in `logdx.jobs` or the core."""
    graph, external = import_graph(), external_imports()
    api = sorted(m for m in graph if _in(m, "logdx.api"))
    assert len(api) > 5
    bad = [m for m in api if not reaches(graph, m, lambda n: bool(external[n] & WEB) or _in(n, WIRE),
                                         within=lambda n: _in(n, "logdx.api", WIRE))]
    assert bad == []


def test_the_job_runtime_knows_nothing_of_http():
    """`logdx.jobs`, the wire models and the callers' identities never load the web framework, directly or not."""
    graph, external = import_graph(), external_imports()
    neutral = sorted(m for m in graph if _in(m, "logdx.jobs", WIRE, "logdx.access"))
    assert "logdx.jobs.manager" in neutral
    bad = [m for m in neutral if reaches(graph, m, lambda n: bool(external[n] & WEB) or _in(n, *FACES))]
    assert bad == []


def test_the_face_commands_resolve():
    """The other faces' commands `logdx` registers by name (`faces.FACE_COMMANDS`): each one exists."""
    import importlib

    from logdx.faces import FACE_COMMANDS

    for spec in FACE_COMMANDS:
        module, _, name = spec.partition(":")
        assert _in(module, *FACES) and callable(getattr(importlib.import_module(module), name)), spec


def test_the_core_never_imports_a_face():
    faces = (*FACES, "logdx.faces")
    core = ("logdx.pipeline", "logdx.diagnose", "logdx.compress", "logdx.normalize", "logdx.detect", "logdx.act",
            "logdx.jobs", "logdx.wire", "logdx.access", "logdx.jobinput")
    graph = import_graph()
    bad = sorted((m, t) for m, targets in graph.items() if m.startswith(core)
                 for t in targets if t.startswith(faces))
    assert bad == []
