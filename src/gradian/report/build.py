"""report.json (schema gradian.report/1), scores.npy and the terminal table."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

SCHEMA = "gradian.report/1"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def preview(text: str, n: int = 160) -> str:
    t = " ".join(text.split())
    return t if len(t) <= n else t[: n - 1] + "…"


def score_summary(scores: np.ndarray, bins: int = 40) -> dict:
    if scores.size == 0:
        return {"n": 0}
    counts, edges = np.histogram(scores, bins=bins)
    return {
        "n": int(scores.size), "min": float(scores.min()), "max": float(scores.max()), "mean": float(scores.mean()),
        "std": float(scores.std()), "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
    }


def write_report(out_dir: Path, report: dict[str, Any], scores: np.ndarray | None) -> Path:
    """report.json and scores.npy; report.html when the HTML renderer is available."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if scores is not None:
        atomic_save_npy(out_dir / "scores.npy", scores.astype(np.float32))
    path = out_dir / "report.json"
    atomic_write_text(path, json.dumps(report, indent=2, ensure_ascii=False, default=_json_default))
    try:
        from .html_report import write_html
    except ImportError:
        return path
    write_html(report, out_dir / "report.html")
    return path


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


def print_summary(report: dict, console: Console | None = None, rows: int = 10) -> None:
    console = console or Console()
    cap = report.get("capability") or {}
    if cap:
        lo, hi = cap["ci"]
        console.print(
            f"[bold]capability[/bold] {cap['metric']}: base {cap['base']:.3f} -> tuned {cap['tuned']:.3f}, "
            f"delta {cap['delta']:+.3f} ({int(cap['confidence'] * 100)}% CI [{lo:+.3f}, {hi:+.3f}], n={cap['n']})"
        )
    style = {"attributed": "green", "declined": "yellow", "smoke_test": "magenta"}.get(report["verdict"], "white")
    console.print(f"[bold {style}]verdict: {report['verdict']}[/] — {report.get('verdict_text', '')}")
    for f in report.get("flags", []):
        console.print(f"  [{'red' if f['level'] == 'error' else 'yellow' if f['level'] == 'warning' else 'dim'}]"
                      f"{f['level']}[/] {f['id']}: {f['message']}")
    ranking = report.get("ranking") or []
    if ranking:
        planted = set((report.get("truth") or {}).get("planted", []))
        t = Table(title="training rows that pushed the model toward the failure", show_lines=False)
        for col in ("rank", "position", "score", "base loss", "tuned loss", "preview"):
            t.add_column(col, justify="right" if col not in ("preview",) else "left", overflow="fold")
        for r in ranking[:rows]:
            mark = " [red]*planted*[/]" if r["position"] in planted else ""
            t.add_row(str(r["rank"]), str(r["position"]), f"{r['score']:.4g}",
                      _fmt(r.get("base_loss")), _fmt(r.get("tuned_loss")), _escape(r["preview"][:90]) + mark)
        console.print(t)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _escape(s: str) -> str:
    from rich.markup import escape

    return escape(s)
