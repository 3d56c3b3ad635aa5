"""The shape of the package, read from its source with ``ast``: no import circles, no module
over 500 lines (but the named ones, a set that may only shrink), no private name imported
from another module."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "workerpool"
MAX_LINES = 500
# Over MAX_LINES today; each is to be split. Remove a module once it is under: the test fails
# until it is, so the set stays current.
TOO_LONG: frozenset[str] = frozenset()


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


@cache
def _tree(name: str) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests that read it."""
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative levels resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imported(module: str, tree: ast.AST) -> Iterator[tuple[str, int]]:
    """``(workerpool module, line)`` for each import anywhere in ``tree``: at module level,
    under ``if TYPE_CHECKING``, inside functions. ``from pkg import name`` imports the
    submodule ``pkg.name`` when there is one, else ``pkg`` itself."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in MODULES else source), node.lineno


def _with_packages(importer: str, imported: str) -> Iterator[str]:
    """``imported`` and the packages above it that importing it runs first, leaving out those
    that also hold ``importer`` (they are running already when it runs; but a name taken
    from one, ``from workerpool import job``, needs its ``__init__`` to have run that far)."""
    parts = imported.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        if name in MODULES and not (importer + ".").startswith(name + "."):
            yield name
    if imported in MODULES:
        yield imported


@cache
def _graph() -> dict[str, dict[str, int]]:
    """Each module's workerpool imports, each with the line of its first import."""
    graph: dict[str, dict[str, int]] = {}
    for name in MODULES:
        edges: dict[str, int] = {}
        for imported, line in _imported(name, _tree(name)):
            for target in _with_packages(name, imported):
                if target != name:
                    edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """The shortest path back to the component's first module (by name), through it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return paths[node] + [start]
                if target in component and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = (f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle))
    return " -> ".join([*steps, cycle[-1]])


def test_the_package_has_no_import_circles() -> None:
    graph = _graph()
    cycles = [_describe(graph, cycle) for cycle in _cycles(graph)]
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_import_walk_sees_imports_in_functions_relative_and_of_submodules() -> None:
    """Given the graph, then it holds the kinds of import a circle can hide in."""
    graph = _graph()
    # Inside a function: the idempotency store's opener imports the Firestore store lazily.
    assert "workerpool.idempotency.firestore" in graph["workerpool.idempotency"]
    # ``from workerpool import constants as c`` imports the submodule, not the package.
    assert "workerpool.constants" in graph["workerpool.config"]
    assert "workerpool" not in graph["workerpool.config"]
    # Importing a module of another package runs that package's __init__ first.
    assert "workerpool.ratelimit" in graph["workerpool.config"]


def test_a_circle_is_found_and_named() -> None:
    """Given a made-up graph with a circle through two modules, then it is named in order."""
    graph = {"a": {"b": 3}, "b": {"c": 4}, "c": {"a": 5}, "d": {"a": 1}}
    assert [_describe(graph, cycle) for cycle in _cycles(graph)] == [
        "a (line 3) -> b (line 4) -> c (line 5) -> a"
    ]


def test_a_relative_import_is_resolved() -> None:
    tree = ast.parse("from ..ratelimit import limiters\nfrom . import delivery\n")
    found = {name for name, _ in _imported("workerpool.worker.middleware", tree)}
    assert found == {"workerpool.ratelimit.limiters", "workerpool.worker.delivery"}


def test_importing_a_module_depends_on_the_packages_it_runs_first() -> None:
    """A module of another package runs that package's ``__init__`` first; a name taken from
    the package holding the importer needs its ``__init__`` too, a submodule of it does not."""
    tree = ast.parse("from workerpool import job, constants\nfrom workerpool.slots import keys\n")
    importer = "workerpool.worker.middleware"
    found = {
        target for name, _ in _imported(importer, tree) for target in _with_packages(importer, name)
    }
    assert found == {
        "workerpool",
        "workerpool.constants",
        "workerpool.slots",
        "workerpool.slots.keys",
    }


def _length(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_500_lines_but_the_known_ones() -> None:
    lengths = {str(path.relative_to(PACKAGE.parent)): _length(path) for path in MODULES.values()}
    over = {name for name, length in lengths.items() if length > MAX_LINES}
    grown = sorted(f"{name} ({lengths[name]} lines)" for name in over - TOO_LONG)
    assert not grown, f"over {MAX_LINES} lines, split them: {', '.join(grown)}"
    shrunk = sorted(f"{name} ({lengths.get(name, 0)} lines)" for name in TOO_LONG - over)
    assert not shrunk, f"under {MAX_LINES} lines now, remove from TOO_LONG: {', '.join(shrunk)}"


def test_no_private_name_is_imported_from_another_module() -> None:
    private = [
        f"{name} line {node.lineno}: {_absolute(name, node)}.{alias.name}"
        for name in MODULES
        for node in ast.walk(_tree(name))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, "private names imported across modules:\n" + "\n".join(private)
