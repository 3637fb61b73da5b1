"""The benches stay runnable: every script in bench/ has a smoke mode that `make bench-smoke` (.ci/bench-smoke, run by
CI after `make test`) runs, and every bench command the documentation shows names options its script has.

Static checks, read from the sources (nothing is imported or run here: the smoke runs themselves take a minute or
two of CPU, so they are CI's `make bench-smoke`, not part of `make test`).
"""

from __future__ import annotations

import re
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh")] if not p.name.startswith("_"))
DOCS = [ROOT / "README.md", BENCH / "README.md", *sorted((ROOT / "docs").glob("*.md")), *SCRIPTS]
COMMAND = re.compile(r"bench/([A-Za-z_]+)\.(py|sh)((?:[ \t]+(?!#)[^\s`|;&)]+)*)")


def runner():
    loader = SourceFileLoader("bench_smoke_runner", str(ROOT / ".ci" / "bench-smoke"))
    mod = module_from_spec(spec_from_loader(loader.name, loader))
    loader.exec_module(mod)
    return mod


def options_of(script: Path) -> set[str]:
    """The long options a bench script takes: its argparse `add_argument("--x"` calls (and those of the bench modules
    it imports from, e.g. `equivalence.common_arguments`), or for a shell script the options it tests itself and
    those of the .py it runs."""
    text = script.read_text(encoding="utf-8")
    found = set(re.findall(r"""add_argument\(\s*["'](--[\w-]+)["']""", text))
    for mod in re.findall(r"^from (\w+) import", text, re.M):
        if mod != script.stem and (BENCH / f"{mod}.py").exists():
            found |= options_of(BENCH / f"{mod}.py")
    if script.suffix == ".sh":
        found |= set(re.findall(r'"(--[\w-]+)"', text))
        py = script.with_suffix(".py")
        if py.exists():
            found |= options_of(py)
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_bench_has_a_smoke_mode_and_says_how_to_run_it(script):
    assert "--smoke" in options_of(script), f"{script.name}: no --smoke option (bench/_smoke.py shows the pattern)"
    usage = [m.group(3) for m in COMMAND.finditer(script.read_text(encoding="utf-8")) if m.group(1) == script.stem]
    assert any("--smoke" in u for u in usage), f"{script.name}: its header shows no `bench/{script.name} --smoke` line"


def test_make_bench_smoke_runs_every_script_and_ci_runs_it():
    ran = {p.name for p in runner().scripts([])}
    # a .py that a .sh of the same name wraps runs through the .sh
    want = {p.name for p in SCRIPTS if not (p.suffix == ".py" and p.with_suffix(".sh").exists())}
    assert ran == want
    assert re.search(r"^bench-smoke:.*\n\t.*\.ci/bench-smoke", (ROOT / "Makefile").read_text(), re.M)
    assert "make bench-smoke" in (ROOT / ".ci" / "run").read_text()
    # and never inside `make test`: its budget is 15 minutes on a fresh clone
    test_rule = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "bench" not in test_rule


def documented_commands() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        for m in COMMAND.finditer(doc.read_text(encoding="utf-8")):
            out.append((doc.relative_to(ROOT).as_posix(), f"{m.group(1)}.{m.group(2)}", m.group(3)))
    return out


def test_documented_bench_commands_name_existing_scripts_and_options():
    bad = []
    for where, name, args in documented_commands():
        script = BENCH / name
        if not script.exists():
            bad.append(f"{where}: bench/{name} does not exist")
            continue
        opts = options_of(script)
        for opt in re.findall(r"(?<![\w-])--[a-z][\w-]*", args):
            if opt not in opts and opt != "--help":
                bad.append(f"{where}: bench/{name} {args.strip()}: no option {opt}")
    assert not bad, "\n".join(bad)


def test_the_command_scan_sees_what_it_guards(tmp_path):
    found = [(m.group(1), m.group(3)) for m in COMMAND.finditer(
        "    .venv/bin/python bench/index_bench.py --quick --rows 10   # a comment --not-an-option\n"
        "`bench/fidelity.py --scenarios a,b` and bench/gpu_check.sh --cpu-smoke | tee x\n")]
    assert found == [("index_bench", " --quick --rows 10"), ("fidelity", " --scenarios a,b"),
                     ("gpu_check", " --cpu-smoke")]
