import os
import re
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GRADIAN_THREADS", "1")
torch.set_num_threads(1)

pytest_plugins = ["pytester"]  # tests/test_skip_guard.py runs a session inside the session


# ---------------------------------------------------------------------------------------- missing listed packages
# A test skipped because a package the project lists (pyproject.toml: dependencies and every extra) could not be
# imported is a supported feature nobody tested: the session fails, naming the module and the package. Skips for
# anything else (no chromium, no CUDA, a package the project does not list) stay skips.
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# distribution name -> the module a test imports, where they differ
IMPORT_NAMES = {"pyyaml": "yaml", "scikit-learn": "sklearn"}
# listed, yet no CPU machine can import them: a test importorskip-ing one is skipped on CI, not failed
NOT_ON_CPU = {"unsloth"}  # needs a CUDA GPU at import
_MISSING = re.compile(r"could not import '([^']+)'|module '([^']+)' has __version__")


def _requirements(text: str) -> list[str]:
    """Every requirement string of [project] dependencies and [project.optional-dependencies]."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the quoted strings of the two blocks
        blocks = re.findall(r"^dependencies\s*=\s*\[(.*?)\]|^\[project\.optional-dependencies\]\n(.*?)(?=^\[)",
                            text + "\n[", flags=re.S | re.M)
        body = "\n".join(re.sub(r"#.*", "", a + b) for a, b in blocks)
        return re.findall(r'"([^"]+)"', body)
    project = tomllib.loads(text).get("project", {})
    return list(project.get("dependencies", [])) + [
        r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]


def listed_modules(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{top-level module a test would import: the distribution pyproject.toml lists}."""
    out = {}
    for req in _requirements(pyproject.read_text(encoding="utf-8")):
        dist = re.split(r"[\s\[<>=!~;@(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")
        if dist and dist not in NOT_ON_CPU:
            out[IMPORT_NAMES.get(dist, dist.replace("-", "_"))] = dist
    return out


_GUARDS: list[dict] = []  # one per running session, innermost last (a pytester session runs inside this one)


def pytest_configure(config):
    try:
        listed = listed_modules(Path(config.rootpath) / "pyproject.toml")
    except (OSError, ValueError):
        listed = listed_modules()
    config._missing_listed = {"listed": listed, "found": {}, "root": Path(config.rootpath).resolve()}
    _GUARDS.append(config._missing_listed)


def pytest_unconfigure(config):
    guard = getattr(config, "_missing_listed", None)
    if guard in _GUARDS:
        _GUARDS.remove(guard)


def _note(module: str, reason: str) -> None:
    """Record `module` (a test file) if `reason` is a failed import (or a too-old version) of a listed package."""
    m = _MISSING.search(reason or "")
    if not m or not _GUARDS:
        return
    guard = _GUARDS[-1]
    top = (m.group(1) or m.group(2)).split(".")[0]
    if top in guard["listed"]:
        guard["found"].setdefault((module, guard["listed"][top]), reason.strip().splitlines()[0])


def _rel(path) -> str:
    root = _GUARDS[-1]["root"] if _GUARDS else Path.cwd()
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)


_importorskip = pytest.importorskip


def _guarded_importorskip(modname, *args, **kwargs):
    """pytest.importorskip that also records the miss when the caller catches the skip and carries on (a test that
    quietly leaves out the part that needs the package)."""
    try:
        return _importorskip(modname, *args, **kwargs)
    except pytest.skip.Exception as e:
        _note(_rel(sys._getframe(1).f_globals.get("__file__", "?")), str(e))
        raise


pytest.importorskip = _guarded_importorskip


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr or "")


def pytest_collectreport(report):
    if report.skipped:
        _note(report.nodeid.split("::")[0], _skip_reason(report))


def pytest_runtest_logreport(report):
    if report.skipped:
        _note(report.nodeid.split("::")[0], _skip_reason(report))


def _missing_lines(config) -> list[str]:
    guard = getattr(config, "_missing_listed", None) or {"found": {}}
    return [f"{where}: skipped for want of '{dist}', which pyproject.toml lists ({reason}); install it "
            f"(`make venv` installs the test extra)" for (where, dist), reason in sorted(guard["found"].items())]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _missing_lines(session.config) and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------------------------------ what did not run
# Every skip is named in the summary with its reason, so a run says what it did not test. The browser tests of the
# HTML report need Debian's chromium (CI installs it, `.ci/run`); without it they are listed with how to install it.
CHROMIUM_HINT = "apt-get install chromium"


def _skipped(terminalreporter) -> list[tuple[str, str]]:
    """(node id, reason) of every skipped test or module of this session, in the order they ran."""
    out = []
    for rep in terminalreporter.stats.get("skipped", []):
        reason = _skip_reason(rep)
        out.append((rep.nodeid or str(getattr(rep, "fspath", "?")), reason.removeprefix("Skipped: ")))
    return out


def skip_summary(skipped: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(section title, lines) naming what did not run: the browser tests apart, with how to install chromium."""
    browser = [n for n, r in skipped if "chromium" in r.lower()]
    other = [(n, r) for n, r in skipped if "chromium" not in r.lower()]
    sections = []
    if browser:
        sections.append((f"not run: {len(browser)} browser test(s), chromium is not installed",
                         [f"install it to run them: {CHROMIUM_HINT} (CI installs it, .ci/run)", *browser]))
    if other:
        sections.append((f"not run: {len(other)} other skipped test(s)", [f"{n}: {r}" for n, r in other]))
    return sections


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for title, lines in skip_summary(_skipped(terminalreporter)):
        terminalreporter.section(title, sep="=", yellow=True, bold=True)
        for line in lines:
            terminalreporter.line(line, yellow=True)
    lines = _missing_lines(config)
    if lines:
        terminalreporter.section("skipped for a missing listed package: FAILED", sep="=", red=True, bold=True)
        for line in lines:
            terminalreporter.line(line, red=True)


def make_random_lora_model(seed: int = 0, vocab: int = 97, hidden: int = 32, layers: int = 2, r: int = 4, dtype=torch.float32):
    """A random Llama with a LoRA adapter whose B is non-zero (a fresh adapter's B is 0, which hides A's gradient)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(cfg).to(dtype)
    lcfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return with_random_lora_b(get_peft_model(base, lcfg))


def with_random_lora_b(model, std: float = 0.05):
    """A fresh adapter's B is 0, which hides A's gradient: draw B at random (seeded by the caller) and go to eval."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    model.eval()
    return model


@pytest.fixture
def random_lora_model():
    return make_random_lora_model()
import gradian.runtime as _r; _r.quiet_libraries()


def words(s: str) -> str:
    """Text with every run of white space made one space (CLI output compared whatever the wrapping)."""
    return " ".join(s.split())
