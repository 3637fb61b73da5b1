"""The self-contained HTML report (``report.html``).

One file, readable offline: styles inline, plots as inline SVG built in :mod:`gradian.report.plots`, no scripts and no
network fetches (a Content-Security-Policy meta tag forbids both, as a second line of defence).

Security: training and eval text is untrusted. The Jinja environment autoescapes everything; the template never
marks data ``|safe``. Span highlighting splits a row's text into three plain strings (before, span, after) in
Python and the template escapes each one separately around a ``<mark>``. The only markup handed to the template
pre-built is the SVG from :mod:`gradian.report.plots`, which escapes every piece of text it draws.

API::

    render_html(report, verify=None, fidelity=None) -> str
    write_html(report, path, verify=None, fidelity=None) -> Path     # atomic: temp file + os.replace
    load_run(run_dir) -> (report, verify | None, fidelity | None)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from ..errors import GradianError
from ..io import atomic_write_text
from .plots import fmt_num
from .sections import human_bytes, human_seconds, pct, signed, as_str, page_context, split_span

__all__ = ["render_html", "write_html", "load_run", "split_span"]

TEMPLATE_NAME = "report.html.j2"
TEMPLATE_DIR = Path(__file__).with_name("templates")



# ------------------------------------------------------------------------------------------------ environment


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=True,  # every {{ }} is escaped, whatever the template's file name
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    for name, fn in (("num", fmt_num), ("pct", pct), ("bytes", human_bytes), ("secs", human_seconds),
                     ("signed", signed)):
        env.filters[name] = _missing_as_dash(fn)
    return env


def _missing_as_dash(fn: Any) -> Any:
    """Number filters show a dash for a field the report does not have."""

    def wrapped(x: Any, *a: Any) -> str:
        return "–" if isinstance(x, jinja2.Undefined) else fn(x, *a)

    wrapped.__name__ = getattr(fn, "__name__", "filter")
    return wrapped


# ------------------------------------------------------------------------------------------------ public API


def render_html(report: Mapping[str, Any], *, verify: Mapping[str, Any] | None = None,
                fidelity: Mapping[str, Any] | None = None) -> str:
    """Render the report (the parsed ``report.json``) as one self-contained HTML page."""
    env = environment()
    return env.get_template(TEMPLATE_NAME).render(**page_context(report, verify, fidelity))


def write_html(report: Mapping[str, Any], path: Path | str, **kw: Any) -> Path:
    """Render and write atomically: a temp file in the target directory, then ``os.replace``."""
    path = Path(path)
    atomic_write_text(path, render_html(report, **kw))
    return path


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise GradianError(f"{path}: not found; run `gradian attribute CONFIG` to write a report first")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GradianError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise GradianError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_run(run_dir: Path | str) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """Read ``report.json`` (required), ``verify.json`` and ``fidelity.json`` (optional) from a run dir.

    When ``scores.npy`` sits beside the report and the report has no ``all_scores``, every row's score is
    loaded (``allow_pickle=False``) into the returned report's ``all_scores`` so the histogram is drawn from the full data
    and planted rows outside the ranking can be placed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GradianError(f"{run_dir}: not a directory; pass the run's output directory")
    report = _read_json(run_dir / "report.json", required=True)
    assert report is not None
    schema = as_str(report.get("schema"))
    if schema and not schema.startswith("gradian.report/"):
        raise GradianError(f"{run_dir / 'report.json'}: schema '{schema}' is not a gradian report")
    verify = _read_json(run_dir / "verify.json", required=False)
    fidelity = _read_json(run_dir / "fidelity.json", required=False)
    scores_path = run_dir / "scores.npy"
    if "all_scores" not in report and scores_path.exists():
        import numpy as np

        try:
            arr = np.load(scores_path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise GradianError(f"{scores_path}: cannot be read ({exc})") from exc
        if arr.ndim == 1 and arr.dtype.kind == "f":
            report = {**report, "all_scores": arr}  # a reader's copy: report.json's dict is not edited
    return report, verify, fidelity
