"""tests/conftest.py fails the session when a test is skipped because a package pyproject.toml lists could not be
imported (what ships is what CI tests); skips for anything else stay skips."""

from __future__ import annotations

import sys

import pytest

import conftest

FAKE = "gradian_listed_but_missing_pkg"  # listed in the inner session's pyproject.toml, installed nowhere
PYPROJECT = f"""
[project]
name = "inner"
version = "0"
dependencies = ["numpy>=1"]

[project.optional-dependencies]
extra = ["{FAKE.replace('_', '-')}>=1.0"]
"""


def _run(pytester, **files):
    pytester.makefile(".toml", pyproject=PYPROJECT)
    pytester.makepyfile(**files)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[conftest])


def test_a_module_skipped_for_a_listed_package_fails_the_session(pytester):
    res = _run(pytester, test_mod=f"""
import pytest
pytest.importorskip("{FAKE}")

def test_x():
    pass
""")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    out = res.stdout.str()
    assert "skipped for a missing listed package" in out
    assert f"test_mod.py: skipped for want of '{FAKE.replace('_', '-')}'" in out


def test_a_test_skipped_for_a_listed_package_fails_the_session(pytester):
    res = _run(pytester, test_inner=f"""
import pytest

def test_ok():
    pass

def test_needs_it():
    pytest.importorskip("{FAKE}.sub")
""")
    res.assert_outcomes(passed=1, skipped=1)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    assert f"test_inner.py: skipped for want of '{FAKE.replace('_', '-')}'" in res.stdout.str()


def test_a_caught_skip_of_a_listed_package_fails_the_session(pytester):
    """A test that catches the skip and carries on without the package also left the feature untested."""
    res = _run(pytester, test_caught=f"""
import pytest

def test_falls_back():
    try:
        pytest.importorskip("{FAKE}")
    except pytest.skip.Exception:
        return
""")
    res.assert_outcomes(passed=1)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    assert "test_caught.py: skipped for want of" in res.stdout.str()


def test_other_skips_stay_skips(pytester):
    res = _run(pytester, test_other="""
import pytest
pytest.importorskip("a_package_nobody_lists_xyz")

def test_x():
    pass
""", test_plain="""
import pytest

@pytest.mark.skip(reason="no chromium")
def test_y():
    pass

def test_z():
    pass
""")
    res.assert_outcomes(passed=1, skipped=2)
    assert res.ret == pytest.ExitCode.OK
    assert "missing listed package" not in res.stdout.str()


def test_the_listed_set_is_pyproject_toml(monkeypatch):
    listed = conftest.listed_modules()
    for module, dist in [("bitsandbytes", "bitsandbytes"), ("gguf", "gguf"), ("jsonschema", "jsonschema"),
                         ("trl", "trl"), ("yaml", "pyyaml"), ("sklearn", "scikit-learn"), ("torch", "torch")]:
        assert listed.get(module) == dist, module
    assert "unsloth" not in listed  # CUDA-only at import: its skip on a CPU machine is not a failure
    # Python 3.10 has no tomllib: the fallback reads the same set
    monkeypatch.setitem(sys.modules, "tomllib", None)
    assert conftest.listed_modules() == listed


def test_the_test_extra_is_installed():
    """What `make venv` installs: every package of the test extra imports here (the quantization tests need
    bitsandbytes, the real-model fixtures gguf)."""
    import importlib
    import re

    text = conftest.PYPROJECT.read_text(encoding="utf-8")
    line = re.search(r"^test\s*=\s*\[(.*?)\]", text, flags=re.M | re.S).group(1)
    dists = [re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in re.findall(r'"([^"]+)"', line)]
    assert {"bitsandbytes", "gguf"} <= set(dists), dists
    for dist in dists:
        importlib.import_module(conftest.IMPORT_NAMES.get(dist, dist.replace("-", "_")))


def test_the_summary_names_what_did_not_run(pytester):
    """Browser tests skipped for want of chromium are named with how to install it; any other skip with its reason."""
    res = _run(pytester, test_page="""
import pytest

@pytest.mark.skipif(True, reason="chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
def test_in_the_browser():
    pass

@pytest.mark.skip(reason="running as root: chmod 000 does not stop reads")
def test_unreadable():
    pass

def test_plain():
    pass
""")
    res.assert_outcomes(passed=1, skipped=2)
    assert res.ret == pytest.ExitCode.OK
    out = res.stdout.str()
    assert "not run: 1 browser test(s), chromium is not installed" in out
    assert "install it to run them: apt-get install chromium" in out
    assert "test_page.py::test_in_the_browser" in out
    assert "not run: 1 other skipped test(s)" in out
    assert "test_page.py::test_unreadable: running as root: chmod 000 does not stop reads" in out
