"""The package's structure, read from its source with `ast` (nothing is imported): no import cycle, no module over
500 lines, no function over 80 (outside `demo/` and `report/plots.py`), no comparison of a preconditioner, metric,
query-formulation or verdict name outside the module that defines its class, and no test probing a `gradian.*`
module that does not exist. Each check prints every violation as file:line, also when run as a script:

    python tests/test_structure.py

Imports. Every import of one of our own modules is an edge: absolute (`gradian.x`) or relative (`.x`, `..x`,
`from . import x`), at module level, inside a function, or under `if TYPE_CHECKING:` (all of them are read by
someone following the code). An edge goes to the module an import names: `import gradian.a.b` and
`from gradian.a import b` (b a submodule) give `gradian.a.b`; `from gradian.a import name` (name not a submodule)
gives `gradian.a`. Importing a module runs the `__init__` of every package on its path, so each of those packages
is an edge too, except the importer's own ancestors (they run before the importer itself: a package that re-exports
its submodules is no cycle). A strongly connected component of more than one module, or a module importing itself,
is a cycle.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TESTS = ROOT / "tests"

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
SIZE_EXEMPT = ("gradian/demo/", "gradian/report/plots.py")  # scenario tables and SVG drawing

# Variant names a caller must not compare as strings, and the modules that define their classes (where the
# registry is keyed by them). The config module is where the strings enter (its enums).
VARIANTS = {
    "preconditioner": ({"identity", "diagonal", "fisher", "datainf", "ekfac"},
                       ("gradian.config", "gradian.attribution.precondition")),
    "metric": ({"exact_match", "contains", "loglik", "regex"}, ("gradian.config", "gradian.capability.metrics")),
    "query formulation": ({"contrastive", "classic", "own_words", "margin", "behaviour"},
                          ("gradian.attribution.formulation",)),
    "verdict": ({"attributed", "declined", "smoke_test"}, ("gradian.verdict",)),
}
# enums whose members name a variant: comparing a value with a member (`f is Formulation.margin`) chooses the
# variant by its name as surely as comparing the string does
VARIANT_ENUMS = {"Formulation": "query formulation", "QueryFormulation": "query formulation"}
PROBES = {"importorskip", "import_module", "find_spec"}

@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        try:
            rel = self.path.relative_to(ROOT)
        except ValueError:
            rel = self.path
        return f"{rel}:{self.line}: {self.what}"


# ------------------------------------------------------------------------------------------------ imports


def modules(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every .py under src/package (a package's __init__.py is the package itself)."""
    mods = {}
    for f in sorted((src / package).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def _parse(f: Path) -> ast.Module:
    return ast.parse(f.read_text(encoding="utf-8"), filename=str(f))


def _imports(tree: ast.AST):
    """(node, in a function) for every Import / ImportFrom, TYPE_CHECKING blocks included."""
    stack = [(tree, False)]
    while stack:
        node, inner = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, inner
        inside = inner or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((c, inside) for c in ast.iter_child_nodes(node))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node, mod: str, f: Path, mods: dict[str, Path], package: str) -> list[str]:
    """The package modules one import statement names."""

    def inside(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    if isinstance(node, ast.Import):
        return [a.name for a in node.names if inside(a.name)]
    if node.level:
        here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]  # the package `.` means in this file
        parts = here.split(".")
        if node.level - 1 >= len(parts):
            raise ValueError(f"{f}:{node.lineno}: relative import beyond the top-level package")
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if not inside(base):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph(src: Path, package: str, counts: Counter | None = None) -> dict[str, set[str]]:
    """Module -> the package modules importing it runs, read from the source under src/package. `counts`, when
    given, receives the number of own-module import statements at module level ("module") and inside functions
    ("function")."""
    mods = modules(src, package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        own = set(_ancestors(mod)) | ({mod} if f.name == "__init__.py" else set())
        for node, inner in _imports(_parse(f)):
            targets = _targets(node, mod, f, mods, package)
            if targets and counts is not None:
                counts["function" if inner else "module"] += 1
            for t in targets:
                while t not in mods and "." in t:  # `import gradian.x.y` of a module that does not exist
                    t = t.rpartition(".")[0]
                if t not in mods:
                    continue
                graph[mod].add(t)
                graph[mod].update(a for a in _ancestors(t) if a in mods and a not in own)
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

    cycles, seen = [], set()
    for comp in sccs:
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph.get(comp[0], ()):
            continue
        for m in sorted(comp):
            body = _shortest_cycle(graph, m, members)[:-1]
            i = body.index(min(body))
            key = tuple(body[i:] + body[:i])
            if key not in seen:
                seen.add(key)
                cycles.append([*key, key[0]])
    return sorted(cycles, key=lambda c: (len(c), c))


def _shortest_cycle(graph: dict[str, set[str]], start: str, comp: set[str]) -> list[str]:
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


def format_cycles(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in cycles)


# ------------------------------------------------------------------------------------------------ the scans


def _exempt(f: Path, src: Path) -> bool:
    rel = f.relative_to(src).as_posix()
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in SIZE_EXEMPT)


def cycle_violations() -> list[Violation]:
    mods = modules(SRC, "gradian")
    return [Violation(mods[c[0]], 1, "import cycle " + " -> ".join(c)) for c in find_cycles(import_graph(SRC, "gradian"))]


def module_size_violations(src: Path = SRC, package: str = "gradian") -> list[Violation]:
    out = []
    for f in modules(src, package).values():
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES and not _exempt(f, src):
            out.append(Violation(f, 1, f"module of {n} lines (at most {MAX_MODULE_LINES})"))
    return out


def function_size_violations(src: Path = SRC, package: str = "gradian") -> list[Violation]:
    out = []
    for f in modules(src, package).values():
        if _exempt(f, src):
            continue
        for node in ast.walk(_parse(f)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(Violation(f, node.lineno, f"function {node.name} of {n} lines "
                                                         f"(at most {MAX_FUNCTION_LINES})"))
    return out


def _literals(node: ast.expr) -> list[str]:
    """The string literals an operand of a comparison is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _compared_names(node: ast.Compare) -> set[str]:
    """The string literals a comparison tests a value against: either side of == and !=, the container of `in` and
    `not in` (`"key" in mapping` tests a key, not a variant)."""
    out: set[str] = set()
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        if isinstance(op, (ast.Eq, ast.NotEq)):
            out.update(_literals(operands[i]) + _literals(operands[i + 1]))
        elif isinstance(op, (ast.In, ast.NotIn)):
            out.update(_literals(operands[i + 1]))
    return out


def _compared_members(node: ast.Compare) -> dict[str, set[str]]:
    """Variant -> the members of its enum (`VARIANT_ENUMS`) a comparison tests a value against, on either side of
    ==, !=, is, is not, in and not in."""
    out: dict[str, set[str]] = {}
    for operand in [node.left, *node.comparators]:
        elts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        for e in elts:
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in VARIANT_ENUMS:
                out.setdefault(VARIANT_ENUMS[e.value.id], set()).add(f"{e.value.id}.{e.attr}")
    return out


def variant_compare_violations(src: Path = SRC, package: str = "gradian") -> list[Violation]:
    """`x == "identity"`, `x != "loglik"`, `f in ("contrastive", ...)`, `f is Formulation.margin`: a variant chosen
    by its name."""
    out = []
    for mod, f in modules(src, package).items():
        for node in ast.walk(_parse(f)):
            if isinstance(node, ast.Compare):
                found, members = _compared_names(node), _compared_members(node)
            else:
                continue
            for what, (names, homes) in VARIANTS.items():
                hit = sorted(found & names) + sorted(members.get(what, ()))
                if hit and not any(mod == h or mod.startswith(h + ".") for h in homes):
                    out.append(Violation(f, node.lineno, f"compares the {what} name(s) {', '.join(map(repr, hit))}: "
                                                         "ask the object (a property of its class) instead"))
    return out


def _probe_name(call: ast.Call) -> str | None:
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    if name not in PROBES or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def probe_violations(tests: Path = TESTS) -> list[Violation]:
    """A test that probes (`importorskip`, `import_module`, `find_spec`) a `gradian.*` module that does not exist
    silently skips what it guards."""
    mods = set(modules(SRC, "gradian"))
    out = []
    for f in sorted(tests.rglob("*.py")):
        for node in ast.walk(_parse(f)):
            if isinstance(node, ast.Call):
                name = _probe_name(node)
                if name and (name == "gradian" or name.startswith("gradian.")) and name not in mods:
                    out.append(Violation(f, node.lineno, f"probes {name!r}, which is not a module of the package"))
    return out


def _check(violations: list[Violation], what: str) -> None:
    for v in violations:
        print(v)
    assert not violations, f"{len(violations)} {what}:\n" + "\n".join(map(str, violations))


# ------------------------------------------------------------------------------------------------ the package


def test_the_graph_sees_the_package():
    counts: Counter = Counter()
    graph = import_graph(SRC, "gradian", counts)
    assert "gradian.cli" in graph and "gradian.demo.run" in graph
    assert "gradian.errors" in graph["gradian.cli"]  # from .errors import GradianError (module level)
    assert "gradian.api" in graph["gradian.cli"]  # from . import api (inside a verb)
    assert "gradian.config" in graph["gradian.demo.run"]  # from ..config import load_config
    assert "gradian.api" in graph["gradian"]  # the lazy verbs
    assert counts["module"] > 100 and counts["function"] > 50, counts
    print(f"imports of our own modules: {counts['module']} at module level, {counts['function']} inside functions")


def test_no_import_cycles():
    _check(cycle_violations(), "import cycle(s)")


def test_no_module_over_500_lines():
    _check(module_size_violations(), "module(s) too long")


def test_no_function_over_80_lines():
    _check(function_size_violations(), "function(s) too long")


def test_no_caller_compares_a_variant_name():
    _check(variant_compare_violations(), "comparison(s) of a variant's name")


def test_no_test_probes_a_module_that_does_not_exist():
    _check(probe_violations(), "probe(s) of a missing module")


# ----------------------------------------------------------------------------- the checks on synthetic packages


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
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import thing",
], ids=["import-abs", "from-abs-module", "from-abs-name", "from-rel-module", "from-rel-name", "star", "in-function",
        "type-checking"])
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


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    """pkg.x.impl imports pkg.y.base, which runs pkg/y/__init__.py, which imports pkg.x.impl back: Python finds
    pkg.x.impl half-initialised (an ImportError depending on which is imported first)."""
    src = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/x/__init__.py": "",
        "pkg/x/impl.py": "from ..y.base import Base\nclass Impl(Base): pass\n",
        "pkg/y/__init__.py": "from .base import Base\nfrom ..x.impl import Impl\n",
        "pkg/y/base.py": "class Base: pass\n",
    })
    graph = import_graph(src, "pkg")
    assert graph["pkg.x.impl"] == {"pkg.y", "pkg.y.base"}
    assert find_cycles(graph) == [["pkg.x.impl", "pkg.y", "pkg.x.impl"]]


def test_a_synthetic_package_without_cycles_passes(tmp_path):
    src = _write(tmp_path, {
        "pkg/__init__.py": "from .a import x\n__version__ = '1'\n",
        "pkg/a.py": "x = 1\n",
        "pkg/b.py": "from . import __version__\nfrom .a import x\n",
        "pkg/sub/__init__.py": "from . import c\n",  # a package importing its own submodule: no edge back
        "pkg/sub/c.py": "from ..b import x\n",  # its own ancestors (pkg.sub, pkg) run first: no edges
        "pkg/d.py": "from .sub import c\n",
    })
    counts: Counter = Counter()
    graph = import_graph(src, "pkg", counts)
    assert graph["pkg.b"] == {"pkg", "pkg.a"} and graph["pkg.sub.c"] == {"pkg.b"}
    assert graph["pkg.d"] == {"pkg.sub", "pkg.sub.c"}
    assert find_cycles(graph) == []
    assert counts == {"module": 6}


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


def test_the_other_scans_see_what_they_guard(tmp_path):
    """Each scan on cases it must flag and cases it must pass (so that an xfail above cannot hide a blind scan)."""
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    src = _write(tmp_path / "src", {
        "gradian/__init__.py": "",
        "gradian/config.py": 'def ok(kind):\n    return kind == "identity"\n',  # where the strings enter
        "gradian/capability/metrics/base.py": 'def ok(name):\n    return name in ("exact_match", "contains")\n',
        "gradian/attribution/formulation.py": 'def ok(s, f):\n    return s is QueryFormulation.auto or f == "margin"\n',
        "gradian/caller.py": textwrap.dedent("""
            def choose(kind, metric, q, mode):
                if kind == "identity": pass
                if metric in ("exact_match", "contains"): pass
                if q.formulation != "own_words": pass
                if "exact_match" not in info: pass
                if kind == PreconditionerKind.identity: pass
                if mode == "supervised": pass
                if report.verdict != "attributed": pass
                if report.verdict is Verdict.attributed: pass
                if q.formulation is Formulation.margin or setting in (QueryFormulation.auto,): pass
            """),
        "gradian/long.py": "def long():\n" + long_body + "\n" * (MAX_MODULE_LINES - MAX_FUNCTION_LINES),
        "gradian/short.py": "def short():\n" + long_body[: -len(f"    x{MAX_FUNCTION_LINES - 1} = 79\n")],
        "gradian/demo/table.py": "def long():\n" + long_body + "\n" * MAX_MODULE_LINES,  # demo/ is exempt
    })
    got = [(v.path.name, v.line, v.what.split(":")[0]) for v in variant_compare_violations(src)]
    assert got == [("caller.py", 3, "compares the preconditioner name(s) 'identity'"),
                   ("caller.py", 4, "compares the metric name(s) 'contains', 'exact_match'"),
                   ("caller.py", 5, "compares the query formulation name(s) 'own_words'"),
                   ("caller.py", 9, "compares the verdict name(s) 'attributed'"),
                   ("caller.py", 11, "compares the query formulation name(s) 'Formulation.margin'"),
                   ("caller.py", 11, "compares the query formulation name(s) 'QueryFormulation.auto'")], got
    assert [(v.path.name, v.what) for v in function_size_violations(src)] == [
        ("long.py", f"function long of {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})")]
    assert [(v.path.name, v.what) for v in module_size_violations(src)] == [
        ("long.py", f"module of {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})")]
    tests = _write(tmp_path / "t", {"test_x.py": """
        import importlib, pytest
        pytest.importorskip("gradian.nope")
        importlib.util.find_spec("gradian.config")
        importlib.import_module("gradian.attribution.nope")
        pytest.importorskip("numpy")
        """})
    got = [(v.line, v.what.split("'")[1]) for v in probe_violations(tests)]
    assert got == [(3, "gradian.nope"), (5, "gradian.attribution.nope")]


if __name__ == "__main__":  # every violation of every check, one per line
    found = [*cycle_violations(), *module_size_violations(), *function_size_violations(),
             *variant_compare_violations(), *probe_violations()]
    print("\n".join(map(str, found)) or "no violations")
    sys.exit(1 if found else 0)


def test_report_keys_are_spelled_only_where_the_report_is_built():
    """`report[` (a key read or written on report.json's dict) appears only in `report.assemble`, the one place the
    report is built from the stages' values; readers use `report.read` or `.get`."""
    pkg = Path(__file__).resolve().parent.parent / "src" / "gradian"
    found = [f"{p.relative_to(pkg)}:{i}" for p in sorted(pkg.rglob("*.py")) if p != pkg / "report" / "assemble.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1) if "report[" in line]
    assert not found, found
