"""No import cycles inside the package. Every module under src/gradian is parsed with `ast` (nothing is imported),
every intra-package import becomes an edge (absolute `gradian.x`, relative `.x`, `..x`, `from . import x`, at
module level or inside a function), and a cycle fails the test as `a -> b -> a`.

Edges go to the module that an import names: `import gradian.a.b` and `from gradian.a import b` (b a submodule)
give `gradian.a.b`; `from gradian.a import name` (name not a submodule) gives `gradian.a`. The parent packages
that Python runs on the way are not edges (every submodule would otherwise depend on its package, and a package
that re-exports its submodules would always be a cycle). Imports under `if TYPE_CHECKING:` are left out: they never
run."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every .py under src/package (a package's __init__.py is the package itself)."""
    mods = {}
    for f in sorted((src / package).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom, function bodies included, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports, read from the source under src/package without importing it."""
    mods = _modules(src, package)
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def inside(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    for mod, f in mods.items():
        here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]  # the package `.` means in this file
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if inside(a.name)]
            else:
                if node.level:
                    parts = here.split(".")
                    if node.level - 1 >= len(parts):
                        raise ValueError(f"{f}:{node.lineno}: relative import beyond the top-level package")
                    base = ".".join(parts[:len(parts) - (node.level - 1)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if not inside(base):
                    continue
                targets = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                # `import gradian.x.y` of a module that does not exist: the longest prefix that does.
                while t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles, each as [a, b, ..., a]: for every strongly connected component with a cycle, the
    shortest cycle through each of its modules (rotations of one cycle reported once), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the graphs here are a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    def shortest_cycle(start: str, comp: set[str]) -> list[str]:
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier:
            nxt = []
            for u in frontier:
                for w in sorted(graph.get(u, ())):
                    if w not in comp:
                        continue
                    if w == start:
                        path = [u]
                        while path[-1] != start:
                            path.append(prev[path[-1]])
                        return [start, *reversed(path[:-1]), start]
                    if w not in prev:
                        prev[w] = u
                        nxt.append(w)
            frontier = nxt
        raise AssertionError(f"{start} is on no cycle")  # pragma: no cover

    cycles, seen = [], set()
    for comp in sccs:
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph.get(comp[0], ()):
            continue
        for m in sorted(comp):
            c = shortest_cycle(m, members)
            body = c[:-1]
            i = body.index(min(body))
            key = tuple(body[i:] + body[:i])
            if key not in seen:
                seen.add(key)
                cycles.append([*key, key[0]])
    return sorted(cycles, key=lambda c: (len(c), c))


def format_cycles(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in cycles)


# ------------------------------------------------------------------------------------------------ the real package


def test_the_graph_sees_the_package():
    graph = import_graph(SRC, "gradian")
    assert "gradian.cli" in graph and "gradian.demo.run" in graph
    assert "gradian.errors" in graph["gradian.cli"]  # from .errors import GradianError (module level)
    assert "gradian.api" in graph["gradian.cli"]  # from . import api (inside a verb)
    assert "gradian.config" in graph["gradian.demo.run"]  # from ..config import load_config


def test_no_import_cycles():
    cycles = find_cycles(import_graph(SRC, "gradian"))
    assert not cycles, f"{len(cycles)} import cycle(s) in gradian:\n{format_cycles(cycles)}"


# ----------------------------------------------------------------------------- the checker on synthetic packages


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


@pytest.mark.parametrize("a_imports_b", [
    "import pkg.sub.b",
    "from pkg.sub import b",
    "from pkg.sub.b import thing",
    "from .sub import b",
    "from .sub.b import thing",
    "from . import sub\nfrom .sub import *",
    "def later():\n    from .sub.b import thing\n    return thing",
], ids=["import-abs", "from-abs-module", "from-abs-name", "from-rel-module", "from-rel-name", "star", "in-function"])
def test_a_synthetic_cycle_is_found(tmp_path, a_imports_b):
    # pkg.a imports pkg.sub.b (each form); pkg.sub.b imports pkg.a back with `..` from inside a function.
    src = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": a_imports_b + "\n",
        "pkg/sub/__init__.py": "from .b import thing\n" if "*" in a_imports_b else "",
        "pkg/sub/b.py": """
            thing = 1

            def f():
                from ..a import later
            """,
        "pkg/c.py": "import os\nfrom pkg import a\n",  # on no cycle
    })
    cycles = find_cycles(import_graph(src, "pkg"))
    if "*" in a_imports_b:  # a -> sub (the package), sub -> sub.b, sub.b -> a
        assert cycles == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.a"]], format_cycles(cycles)
    else:
        assert cycles == [["pkg.a", "pkg.sub.b", "pkg.a"]], format_cycles(cycles)
    assert format_cycles(cycles).startswith("pkg.a -> ")


def test_a_synthetic_package_without_cycles_passes(tmp_path):
    src = _write(tmp_path, {
        "pkg/__init__.py": "from .a import x\n__version__ = '1'\n",
        "pkg/a.py": "x = 1\n",
        "pkg/b.py": "from . import __version__\nfrom .a import x\n",
        "pkg/sub/__init__.py": "from . import c\n",  # a package importing its own submodule: no edge back
        "pkg/sub/c.py": "from ..b import x\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import y\n",
        "pkg/d.py": "from .sub import c\n",  # a cycle only through TYPE_CHECKING: never runs
    })
    graph = import_graph(src, "pkg")
    assert graph["pkg.b"] == {"pkg", "pkg.a"} and graph["pkg.sub.c"] == {"pkg.b"}
    assert find_cycles(graph) == []


def test_self_import_and_several_cycles(tmp_path):
    src = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import a\n",
        "pkg/b.py": "from .c import y\nfrom .d import z\n",
        "pkg/c.py": "from .b import w\n",
        "pkg/d.py": "from .b import w\n",
    })
    assert format_cycles(find_cycles(import_graph(src, "pkg"))).splitlines() == [
        "pkg.a -> pkg.a", "pkg.b -> pkg.c -> pkg.b", "pkg.b -> pkg.d -> pkg.b"]
