"""What each section of the HTML page shows, read from the typed report (`schema.Report`: past `read.report_from`
every value has its schema type; every text is escaped later by the template). `page_context` is the template's
whole input; the banner is built in `banner`, numbers are formatted in `values`. verify.json and fidelity.json, the
documents of the verbs that come after `attribute`, are shown as they are (`_verify`, `_fidelity`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..attribution.formulation import Formulation
from ..capability.metrics import is_binary_metric
from ..version import __version__
from .banner import accused, banner, ranking_caption
from .plots import Bins, RugMark, capability_svg, fmt_num, histogram_from_scores, histogram_svg
from .ranking_schema import RankedTurn
from .schema import Capability, IndexSummary, Report
from .values import MAX_POSITIONS_SHOWN, as_dict, as_list, as_str, finite, flatten, given

# Long rows are trimmed around their highlighted span; the full text stays in the training file.
MAX_ROW_CHARS = 4000
CONTEXT_CHARS = 1500
MAX_ITEMS_SHOWN = 500

_LEVEL_ORDER = {"error": 0, "warning": 1, "info": 2}


# ------------------------------------------------------------------------------------------------ spans


def split_span(text: str, start: Optional[int], end: Optional[int],
               span_text: str | None = None) -> tuple[str, str, str]:
    """Split ``text`` into (before, span, after) as plain strings for separate escaping.

    Offsets are character offsets into ``text``. When they do not match the span's own text (a report written
    against a differently rendered row), the span text is searched for instead; failing that, nothing is
    highlighted. Very long rows are trimmed around the span with an ellipsis.
    """
    s, e = start, end
    ok = s is not None and e is not None and 0 <= s < e <= len(text)
    if ok and span_text is not None and text[s:e] != span_text:
        ok = False
    if not ok and span_text:
        i = text.find(span_text)
        if i >= 0:
            s, e, ok = i, i + len(span_text), True
    if not ok:
        before, mid, after = text, "", ""
    else:
        before, mid, after = text[:s], text[s:e], text[e:]
    if len(before) + len(mid) + len(after) > MAX_ROW_CHARS:
        if len(before) > CONTEXT_CHARS:
            before = "… " + before[-CONTEXT_CHARS:]
        if len(mid) > MAX_ROW_CHARS:
            mid = mid[:MAX_ROW_CHARS] + " …"
        if len(after) > CONTEXT_CHARS:
            after = after[:CONTEXT_CHARS] + " …"
    return before, mid, after


# ------------------------------------------------------------------------------------------------ context


def _item_status(bc: Optional[bool], tc: Optional[bool]) -> tuple[str, int]:
    if bc is True and tc is False:
        return "regressed", 0
    if bc is False and tc is True:
        return "improved", 1
    if bc is None or tc is None:
        return "unknown", 3
    return "same", 2


def _capability(cap: Optional[Capability]) -> dict[str, Any]:
    items = []
    binary = cap is not None and is_binary_metric(cap.metric)
    for i, it in enumerate(cap.items if cap is not None else ()):
        bc, tc = it.base_correct, it.tuned_correct
        if bc is None and tc is None and binary and it.base_score is not None and it.tuned_score is not None:
            # capability.json carries per-item metric values; for 0/1 metrics they are the correct marks
            bc, tc = it.base_score >= 1.0, it.tuned_score >= 1.0
        status, order = _item_status(bc, tc)
        items.append({"item": it.item, "prompt": it.prompt, "expected": it.expected,
                      "base_generated": it.base_generated, "generated": it.generated, "base_correct": bc,
                      "tuned_correct": tc, "status": status, "_order": order, "_i": i})
    items.sort(key=lambda r: (r["_order"], r["_i"]))
    counts = {k: sum(1 for r in items if r["status"] == k) for k in ("regressed", "improved", "same", "unknown")}
    return {
        "present": cap is not None,
        **_figures(cap),
        # not "items": Jinja would find dict.items first
        "changed_rows": [r for r in items if r["status"] != "same"][:MAX_ITEMS_SHOWN],
        "same_rows": [r for r in items if r["status"] == "same"][:MAX_ITEMS_SHOWN],
        "items_total": len(items),
        "counts": counts,
    }


def _figures(cap: Optional[Capability]) -> dict[str, Any]:
    """The capability's summary figures as the cards show them (each None without a capability)."""
    if cap is None:
        return {"metric": "metric", "n": None, "base": None, "tuned": None, "delta": None, "ci": [None, None],
                "confidence": None, "significant": None, "mdd": None}
    return {"metric": cap.metric or "metric", "n": cap.n, "base": cap.base, "tuned": cap.tuned, "delta": cap.delta,
            "ci": list(cap.ci), "confidence": cap.confidence, "significant": cap.significant,
            "mdd": cap.min_detectable_delta}


def _ranking(report: Report) -> tuple[list[dict[str, Any]], set[int]]:
    has_truth = given(report.truth)
    planted = set(report.truth.planted or ()) if report.truth is not None else set()
    spans_by_pos = {}
    for sp in report.spans:
        cur = spans_by_pos.get(sp.position)
        if cur is None or (finite(sp.score) or -math.inf) > (finite(cur.score) or -math.inf):
            spans_by_pos[sp.position] = sp
    evidence = {e.position: e for e in ((report.accused.evidence or []) if report.accused is not None else [])}
    rows = []
    for r in report.ranking:
        span = r.top_span or spans_by_pos.get(r.position)
        before, mid, after = (split_span(r.text, span.start, span.end, span.text) if span else
                              split_span(r.text, None, None, None))
        bl, tl = finite(r.base_loss), finite(r.tuned_loss)
        rows.append(
            {
                "rank": r.rank,
                "position": r.position,
                "id": r.id,
                "score": r.score,
                # what the histogram of scores.npy is drawn from: the ranking score (best window or exchange, the
                # max over items), which is not the whole-row mean for every row
                "rank_score": r.window_score if r.window_score is not None else r.score,
                "base_loss": bl,
                "tuned_loss": tl,
                "loss_change": (tl - bl) if (bl is not None and tl is not None) else None,
                "before": before,
                "mark": mid,
                "after": after,
                "span_score": span.score if mid else None,
                "planted": r.position in planted if has_truth else None,
                # a report written before the accused rule accuses its whole ranking
                "accused": r.accused if r.accused is not None else True,
                "turn": _turn_note(r.turn),
                "evidence": _evidence_note(evidence.get(r.position)),
            }
        )
    return rows, planted


def _evidence_note(e) -> Optional[str]:
    """"explains eval items 4, 5: statistic 283.0 > 15.6" for an accused row (`Accused.evidence`)."""
    if e is None:
        return None
    items = ", ".join(str(i) for i in e.items)
    return (f"explains eval item{'' if len(e.items) == 1 else 's'} {items}: statistic {fmt_num(e.statistic)} > "
            f"{fmt_num(e.threshold)}")


def _turn_note(turn: Optional[RankedTurn]) -> Optional[str]:
    """"ranked by exchange 2 of 4" for a conversation ranked by its best exchange."""
    if turn is None:
        return None
    return f"ranked by exchange {turn.turn + 1} of {turn.turns}"


def _scores_plot(report: Report, rows: list[dict[str, Any]], planted: set[int],
                 scores: Optional[np.ndarray]) -> dict[str, Any]:
    summary = report.scores_summary
    hist = histogram_from_scores(scores) if scores is not None else None
    if hist is None and summary.histogram is not None:
        hist = Bins(list(summary.histogram.edges), list(summary.histogram.counts))
    marks = [RugMark(r["rank_score"], r["rank"], r["id"], bool(r["planted"])) for r in rows]
    # Planted rows that did not make the ranking: report their rank when every score is known.
    in_ranking = {r["position"] for r in rows}
    planted_missed: list[dict[str, Any]] = []
    if planted and scores is not None:
        arr = np.asarray(scores, dtype=np.float64).ravel()
        order = np.argsort(-arr, kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(1, len(order) + 1)
        planted_missed = [{"position": p, "rank": int(rank_of[p]), "score": float(arr[p])}
                          for p in sorted(planted - in_ranking) if 0 <= p < len(arr)]
    return {
        "svg": histogram_svg(hist, marks),
        "summary": summary,
        "has_hist": hist is not None,
        "planted_missed": planted_missed,
        "planted_missed_unknown": sorted(planted - in_ranking) if (planted and scores is None) else [],
    }


def _clusters(report: Report, rank_by_pos: dict[int, int]) -> list[dict[str, Any]]:
    out = []
    for c in report.clusters:
        ranks = sorted(r for r in (rank_by_pos.get(p) for p in c.positions) if r is not None)
        out.append(
            {
                "id": c.id,
                "size": c.size,
                "score": c.score,
                "p_value": c.p_value,
                "positions": c.positions[:MAX_POSITIONS_SHOWN],
                "positions_more": max(len(c.positions) - MAX_POSITIONS_SHOWN, 0),
                "ranks": ranks[:MAX_POSITIONS_SHOWN],
                "preview": c.preview,
            }
        )
    return out


def _spans(report: Report, rank_by_pos: dict[int, int]) -> list[dict[str, Any]]:
    rows = [{"position": sp.position, "rank": rank_by_pos.get(sp.position), "start": sp.start, "end": sp.end,
             "text": sp.text, "score": sp.score} for sp in report.spans]
    rows.sort(key=lambda r: -(finite(r["score"]) if finite(r["score"]) is not None else -math.inf))
    return rows[:100]


def _query(report: Report, rank_by_pos: dict[int, int]) -> dict[str, Any]:
    q = report.query
    items = []
    for it in q.items:
        top = [{"position": r.position, "score": r.score, "rank": rank_by_pos.get(r.position)}
               for r in it.ranking[:5]]
        items.append({"item": it.item, "prompt": it.prompt, "expected": it.expected, "generated": it.generated,
                      "base_generated": it.base_generated, "top": top})
    checkpoints = list(q.checkpoints.labels) if q.checkpoints is not None else []
    # what the scores follow, as the formulation's class says it (the template compares no formulation name)
    summary = Formulation(q.formulation).kind.summary if q.formulation else ""
    return {"formulation": q.formulation, "summary": summary, "rows": items[:MAX_ITEMS_SHOWN], "total": len(items),
            "checkpoints": checkpoints, "combine": q.combine or ""}


def _fidelity(index: Optional[IndexSummary], fidelity: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Fidelity figures in groups: those recorded with the index build, and those from fidelity.json."""
    groups: list[dict[str, Any]] = []
    inner = index.fidelity if index is not None else None
    if given(inner):
        groups.append({"title": "measured with the index build",
                       "rows": flatten(inner.model_dump(by_alias=True, exclude_unset=True))})
    if isinstance(fidelity, Mapping) and fidelity:
        groups.append({"title": "from fidelity.json (leave-one-out / LDS)", "rows": flatten(fidelity)})
    return groups


def _verify(verify: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """verify.json (its own document, written by `validate.verify`), each value coerced."""
    if not isinstance(verify, Mapping):
        return None
    acc = as_dict(verify.get("accused"))
    ci = as_list(acc.get("ci"))
    controls = [as_dict(c) for c in as_list(verify.get("controls"))]
    confirmed = verify.get("confirmed")
    return {
        "top_k": verify.get("top_k"),
        "accused_capability": acc.get("capability"),
        "accused_reverted": acc.get("reverted_fraction"),
        "accused_ci": [ci[0] if len(ci) > 0 else None, ci[1] if len(ci) > 1 else None],
        "controls": controls,
        "control_mean": verify.get("control_mean_reverted"),
        "confirmed": confirmed,
        # verify's confirmed (True), not confirmed (False) or inconclusive (None), in the banner's tones
        "title": {"confirmed": "Confirmed", "not_confirmed": "Not confirmed", "not_reproduced": "Not reproduced",
                  "inconclusive": "Inconclusive"}.get(as_str(verify.get("verdict")) or "",
                                                      "Confirmed" if confirmed is True else
                                                      ("Not confirmed" if confirmed is False else "Verify result")),
        "tone": "attributed" if confirmed is True else ("declined" if confirmed is False else "unknown"),
        "statement": as_str(verify.get("statement")),
    }


def _timings(timings: dict[str, float]) -> dict[str, Any]:
    rows = [{"step": k, "seconds": finite(v)} for k, v in timings.items()]
    vals = [r["seconds"] for r in rows if r["seconds"] is not None]
    mx = max(vals) if vals else 0.0
    for r in rows:
        r["frac"] = (r["seconds"] / mx) if (mx > 0 and r["seconds"] is not None) else 0.0
    total = sum(vals) if vals else None
    return {"rows": rows, "total": total}


def page_context(report: Report, verify: Mapping[str, Any] | None, fidelity: Mapping[str, Any] | None,
                 scores: Optional[np.ndarray] = None) -> dict[str, Any]:
    """The template's input: the typed report, verify.json and fidelity.json when the run has them, and every
    row's score (scores.npy) when known (the histogram is then drawn from them, and planted rows outside the
    ranking are placed)."""
    rows, planted = _ranking(report)
    rank_by_pos = {r["position"]: r["rank"] for r in rows}
    flags = sorted(report.flags, key=lambda f: _LEVEL_ORDER.get(f.level, 3))
    flag_counts = {lvl: sum(1 for f in flags if f.level == lvl) for lvl in ("error", "warning", "info")}
    index = report.index
    return {
        "version": __version__,
        "schema": report.schema_id,
        "banner": banner(report),
        "flags": flags,
        "flag_counts": flag_counts,
        "cap": _capability(report.capability),
        "cap_svg": capability_svg(report.capability) if report.capability is not None else None,
        "rows": rows,
        "accused": accused(report),
        # the training rows: the index's count, else the scores' (the one pass and a smoke test build no index)
        "rows_total": index.examples if index is not None else (report.scores_summary.n or None),
        "ranking_lead": ranking_caption(report).lead,
        "has_truth": given(report.truth),
        "planted_total": len(planted),
        "planted_found": sum(1 for r in rows if r["planted"]),
        "scores": _scores_plot(report, rows, planted, scores),
        "clusters": _clusters(report, rank_by_pos),
        "spans": _spans(report, rank_by_pos),
        "query": _query(report, rank_by_pos),
        "index": index,
        "projection": index.projection if index is not None else None,
        "fidelity_groups": _fidelity(index, fidelity),
        "settings_rows": flatten(report.settings),
        "timings": _timings(report.timings),
        "verify": _verify(verify),
        "metrics": report.metrics,
    }
