"""The README's Python API example runs as written (on a trained demo run in place of runs/demo)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):text.index("## Architecture")]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_readme_python_api_example_runs(tmp_path, capsys):
    from test_precondition import trained_demo

    run = tmp_path / "demo"
    cfg_path = trained_demo(run)
    code = _example().replace("runs/demo/gradian.yaml", str(cfg_path))
    assert str(cfg_path) in code  # the example names the demo's config
    exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("attributed ")
    assert len(out) == 1 + 5 + 1 and (run / "out-notebook" / "report.json").exists()
