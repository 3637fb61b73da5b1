"""The README's TRL quick path runs as written (on a trained demo in place of `make demo`'s runs/demo), the README
keeps its shape (set-up and the whole quick path on the first screen, under 150 lines, no figure of its own), and
the Python API example of docs/cli.md runs as written."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API_DOC = ROOT / "docs" / "cli.md"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start: nxt if nxt >= 0 else len(text)]


def quick_path() -> list[list[str]]:
    """The commands of the README's "Your TRL run" block, continuation lines joined, each split as a shell would."""
    (block,) = re.findall(r"```bash\n(.*?)```", _section(README.read_text(), "## Your TRL run"), flags=re.S)
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    return [c for c in commands if c]


def test_readme_layout():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) < 150, len(lines)
    first = "\n".join(lines[:60])
    setup = re.search(r"```bash\n(.*?)```", first, flags=re.S).group(1)
    assert "make demo" in setup and "make test" in setup
    quick = _section(text, "## Your TRL run").rstrip()
    assert quick in first, "the whole TRL quick path is on the first screen (60 lines)"
    assert len(quick.splitlines()) <= 15, len(quick.splitlines())
    # no figure of its own: outside code and links, the README states no number (the docs hold them)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`]*`|\]\([^)]*\)", "", prose)
    assert not re.findall(r"\d", prose), re.findall(r".{20}\d.{20}", prose)
    # every page it links to exists
    for target in re.findall(r"\]\(([^)#]+)", text):
        assert (ROOT / target).exists(), target


def test_readme_trl_quick_path_runs_as_written(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gradian.cli import app
    from test_precondition import trained_demo

    trained_demo(tmp_path / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    commands = quick_path()
    assert [c[:2] for c in commands] == [["gradian", "attribute"], ["gradian", "verify"]]
    runner = CliRunner()
    for cmd in commands:
        res = runner.invoke(app, cmd[1:])
        assert res.exit_code == 0, (cmd, res.output)
    why = tmp_path / "runs" / "why"
    report = json.loads((why / "report.json").read_text())
    truth = json.loads((tmp_path / "runs" / "demo" / "truth.json").read_text())
    # what the README says the output is: the metric moved with its interval, the planted rows ranked first, accused
    assert report["verdict"] == "attributed" and report["capability"]["ci"][1] < 0
    top = [r["position"] for r in report["ranking"][: len(truth["planted"])]]
    assert len(set(top) & set(truth["planted"])) >= len(truth["planted"]) - 1, top
    assert set(report["accused"]["positions"]) <= set(truth["planted"])
    verify = json.loads((why / "verify.json").read_text())
    assert verify["confirmed"] is True, verify["statement"]


def _api_example() -> str:
    section = _section(API_DOC.read_text(), "## Python API")
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_docs_python_api_example_runs(tmp_path, capsys):
    from test_precondition import trained_demo

    run = tmp_path / "demo"
    cfg_path = trained_demo(run)
    code = _api_example().replace("runs/demo/gradian.yaml", str(cfg_path))
    assert str(cfg_path) in code  # the example names the demo's config
    exec(compile(code, str(API_DOC), "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("attributed ")
    assert len(out) == 1 + 5 + 1 and (run / "out-notebook" / "report.json").exists()
