"""The self-contained HTML report (``report.html``).

One file, readable offline: styles inline, plots as inline SVG built in :mod:`gradian.report.plots`, no scripts and no
network fetches (a Content-Security-Policy meta tag forbids both, as a second line of defence).

Security: training and eval text is untrusted. The Jinja environment autoescapes everything; the template never
marks data ``|safe``. Span highlighting splits a row's text into three plain strings (before, span, after) in
Python and the template escapes each one separately around a ``<mark>``. The only markup handed to the template
pre-built is the SVG from :mod:`gradian.report.plots`, which escapes every piece of text it draws.

The page reads the typed report (`schema.Report`); a dict (report.json as `json.loads` gives it) goes through the
readers' one gate first, `read.report_from`, which names the first key that is not as the schema has it.

API::

    render_html(report, verify=None, fidelity=None, scores=None) -> str
    write_html(report, path, verify=None, fidelity=None, scores=None) -> Path   # atomic: temp file + os.replace
    load_run(run_dir) -> Run(report, verify | None, fidelity | None, scores | None)
    write_run_html(run_dir) -> Path                                 # load_run, then write RUN_DIR/report.html
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import jinja2
import numpy as np

from ..errors import GradianError
from ..io import atomic_write_text
from .plots import fmt_num
from .read import load_report, report_from
from .schema import Report
from .sections import page_context, split_span
from .values import human_bytes, human_seconds, pct, signed

__all__ = ["Run", "render_html", "write_html", "load_run", "write_run_html", "split_span"]

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


def render_html(report: Union[Report, Mapping[str, Any]], *, verify: Mapping[str, Any] | None = None,
                fidelity: Mapping[str, Any] | None = None, scores: Optional[np.ndarray] = None) -> str:
    """Render the report (typed, or the parsed ``report.json``) as one self-contained HTML page; ``scores``, every
    row's score (scores.npy), draws the histogram from them all and places planted rows outside the ranking."""
    typed = report if isinstance(report, Report) else report_from(report, "report")
    env = environment()
    return env.get_template(TEMPLATE_NAME).render(**page_context(typed, verify, fidelity, scores))


def write_html(report: Union[Report, Mapping[str, Any]], path: Path | str, **kw: Any) -> Path:
    """Render and write atomically: a temp file in the target directory, then ``os.replace``."""
    path = Path(path)
    atomic_write_text(path, render_html(report, **kw))
    return path


@dataclass(frozen=True)
class Run:
    """What a run directory holds for its page: the typed report and, when present, verify.json, fidelity.json and
    every row's score (scores.npy)."""

    report: Report
    verify: Optional[dict[str, Any]] = None
    fidelity: Optional[dict[str, Any]] = None
    scores: Optional[np.ndarray] = None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GradianError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise GradianError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_run(run_dir: Path | str) -> Run:
    """Read ``report.json`` (required, typed through `read.load_report`), ``verify.json`` and ``fidelity.json``
    (optional) and ``scores.npy`` (optional, ``allow_pickle=False``; a file that is not one float per row is left
    out) from a run dir."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GradianError(f"{run_dir}: not a directory; pass the run's output directory")
    report = load_report(run_dir)
    scores = None
    scores_path = run_dir / "scores.npy"
    if scores_path.exists():
        try:
            arr = np.load(scores_path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise GradianError(f"{scores_path}: cannot be read ({exc})") from exc
        if arr.ndim == 1 and arr.dtype.kind == "f":
            scores = arr
    return Run(report, _read_json(run_dir / "verify.json"), _read_json(run_dir / "fidelity.json"), scores)


def write_run_html(run_dir: Path | str) -> Path:
    """RUN_DIR/report.html from what the run directory holds (`load_run`): `gradian report`, and after verify and
    fidelity."""
    run = load_run(run_dir)
    return write_html(run.report, Path(run_dir) / "report.html", verify=run.verify, fidelity=run.fidelity,
                      scores=run.scores)
