"""report.json (schema gradian.report/1) and scores.npy: the report's pieces that are not the page or the terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..io import atomic_save_npy, atomic_write_text
from ..verdict import Verdict

SCHEMA = "gradian.report/1"


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
    """report.json and scores.npy; then report.html, rendered from report.json's text read back as the typed report
    (as `read.load_report` reads it), so the page shows what any reader of the file gets."""
    from pydantic import ValidationError

    from .html import write_html
    from .read import schema_problem
    from .schema import Report

    out_dir.mkdir(parents=True, exist_ok=True)
    if scores is not None:
        atomic_save_npy(out_dir / "scores.npy", scores.astype(np.float32))
    path = out_dir / "report.json"
    text = json.dumps(report, indent=2, ensure_ascii=False, default=_json_default)
    atomic_write_text(path, text)
    try:
        typed = Report.model_validate_json(text)
    except ValidationError as e:  # the writer and the schema disagree: gradian's bug, not the user's input
        raise RuntimeError(f"{schema_problem(e, str(path))}: report.json was written but does not match "
                           "gradian.report/1 (gradian/report/schema.py), so report.html was not; please report "
                           "this") from None
    write_html(typed, out_dir / "report.html")
    return path


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


def capability_json(cap, eval_items) -> dict:
    """capability.json and report.json `capability`: the summary and, per eval item, both answers and scores."""
    d = cap.summary()
    d["items"] = [
        {"item": it.position, "prompt": it.question_text(), "expected": it.answer, "base_generated": bg,
         "generated": tg, "base_score": bsc, "tuned_score": tsc}
        for it, bg, tg, bsc, tsc in zip(eval_items or [], cap.base_generated, cap.tuned_generated, cap.base_scores,
                                        cap.tuned_scores)
    ]
    return d


def verdict_text(verdict: Verdict, cap, n_items: int, direction: str, why: str | None = None) -> str:
    if verdict is Verdict.smoke_test:
        return ("No eval set, so there is no capability to attribute: the ranking shows the rows with the largest "
                "gradients (outliers), not causes.")
    assert cap is not None
    lo, hi = cap.ci
    if verdict is Verdict.declined and why:
        moved = "fell" if cap.delta < 0 else "rose"
        return (f"{cap.metric} {moved} from {cap.base:.2f} to {cap.tuned:.2f} (delta {cap.delta:+.3f}), but the "
                f"scores cannot name a cause: {why}. No training rows are accused.")
    if verdict is Verdict.declined:
        return (f"The fine-tune did not move {cap.metric} measurably: delta {cap.delta:+.3f} with a "
                f"{int(cap.confidence * 100)}% interval [{lo:+.3f}, {hi:+.3f}] that includes zero (the smallest delta "
                f"{cap.n} items can detect is about {cap.min_detectable_delta:.2f}). No training rows are accused.")
    moved = "fell" if cap.delta < 0 else "rose"
    return (f"{cap.metric} {moved} from {cap.base:.2f} to {cap.tuned:.2f} (delta {cap.delta:+.3f}, "
            f"{int(cap.confidence * 100)}% interval [{lo:+.3f}, {hi:+.3f}]). The rows below are ranked by how much "
            f"training on them pushed the model toward the {n_items} {direction} item(s).")
