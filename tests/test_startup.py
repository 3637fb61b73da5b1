"""`gradian --help` stays fast: the light modules import no torch, transformers or peft (a behaviour test, not a
timing test; bench/cli_startup.py measures the time). Each check runs in a fresh interpreter, since the test
process itself has long imported everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradian

HEAVY = ("torch", "transformers", "peft", "numpy", "scipy", "sklearn", "datasets")
# The package the test process imported, so the child checks the same source tree.
SRC = str(Path(gradian.__file__).resolve().parents[1])


def heavy_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; the heavy libraries (top-level names) found in sys.modules afterwards."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, *filter(None, [os.environ.get("PYTHONPATH")])]))
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_import_cli_loads_no_torch_transformers_peft():
    loaded = heavy_after("import gradian.cli")
    assert not {"torch", "transformers", "peft"} & set(loaded), f"import gradian.cli imported {loaded}"


@pytest.mark.parametrize("module", ["gradian", "gradian.cli", "gradian.errors", "gradian.config", "gradian.runtime"])
def test_light_modules_load_no_heavy_library(module):
    loaded = heavy_after(f"import {module}")
    assert loaded == [], f"import {module} imported {loaded}"


def test_help_loads_no_heavy_library():
    # What the console script does, `main()` included: the log silencing used to import transformers here.
    code = ("import sys\nsys.argv = ['gradian', '--help']\nfrom gradian.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n")
    loaded = heavy_after(code)
    assert loaded == [], f"gradian --help imported {loaded}"


def test_verbs_that_load_models_still_quiet_the_libraries(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import gradian.runtime
    from gradian.cli import app

    calls = []
    monkeypatch.setattr(gradian.runtime, "quiet_libraries", lambda: calls.append(1))
    r = CliRunner().invoke(app, ["evaluate", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and calls == [1], r.output
    r = CliRunner().invoke(app, ["report", str(tmp_path)])  # loads no model: stays light
    assert r.exit_code == 2 and calls == [1], r.output
