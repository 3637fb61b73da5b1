"""What each section of the HTML page shows, built from the report's JSON (untrusted: every value is coerced and
every text later escaped by the template). `page_context` is the template's whole input; the banner is built in
`banner`, values are coerced and formatted in `values`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

from ..capability.metrics import is_binary_metric
from ..version import __version__
from .banner import accused, banner
from .plots import capability_svg, histogram_from_scores, histogram_svg
from .values import (MAX_POSITIONS_SHOWN, as_dict, as_float, as_int, as_list, as_str, flatten, human_bytes,  # noqa: F401
                     human_seconds, pct, signed)

# Long rows are trimmed around their highlighted span; the full text stays in the training file.
MAX_ROW_CHARS = 4000
CONTEXT_CHARS = 1500
MAX_ITEMS_SHOWN = 500

_LEVEL_ORDER = {"error": 0, "warning": 1, "info": 2}


# ------------------------------------------------------------------------------------------------ spans


def split_span(text: str, start: Any, end: Any, span_text: str | None = None) -> tuple[str, str, str]:
    """Split ``text`` into (before, span, after) as plain strings for separate escaping.

    Offsets are character offsets into ``text``. When they do not match the span's own text (a report written
    against a differently rendered row), the span text is searched for instead; failing that, nothing is
    highlighted. Very long rows are trimmed around the span with an ellipsis.
    """
    text = as_str(text)
    s, e = as_int(start), as_int(end)
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


def _capability(cap: Mapping[str, Any]) -> dict[str, Any]:
    items = []
    for i, it in enumerate(as_list(cap.get("items"))):
        it = as_dict(it)
        bc, tc = it.get("base_correct"), it.get("tuned_correct")
        if bc is None and tc is None and is_binary_metric(cap.get("metric")):
            # capability.json carries per-item metric values; for 0/1 metrics they are the correct marks
            bs, ts = it.get("base_score"), it.get("tuned_score")
            if isinstance(bs, (int, float)) and isinstance(ts, (int, float)):
                bc, tc = bs >= 1.0, ts >= 1.0
        if bc is True and tc is False:
            status, order = "regressed", 0
        elif bc is False and tc is True:
            status, order = "improved", 1
        elif bc is None or tc is None:
            status, order = "unknown", 3
        else:
            status, order = "same", 2
        items.append(
            {
                "item": it.get("item", i),
                "prompt": as_str(it.get("prompt")),
                "expected": as_str(it.get("expected")),
                "base_generated": as_str(it.get("base_generated")),
                "generated": as_str(it.get("generated")),
                "base_correct": bc,
                "tuned_correct": tc,
                "status": status,
                "_order": order,
                "_i": i,
            }
        )
    items.sort(key=lambda r: (r["_order"], r["_i"]))
    counts = {k: sum(1 for r in items if r["status"] == k) for k in ("regressed", "improved", "same", "unknown")}
    ci = as_list(cap.get("ci"))
    return {
        "present": bool(cap),
        "metric": as_str(cap.get("metric")) or "metric",
        "n": cap.get("n"),
        "base": cap.get("base"),
        "tuned": cap.get("tuned"),
        "delta": cap.get("delta"),
        "ci": [ci[0] if len(ci) > 0 else None, ci[1] if len(ci) > 1 else None],
        "confidence": cap.get("confidence"),
        "significant": cap.get("significant"),
        "mdd": cap.get("min_detectable_delta"),
        # not "items": Jinja would find dict.items first
        "changed_rows": [r for r in items if r["status"] != "same"][:MAX_ITEMS_SHOWN],
        "same_rows": [r for r in items if r["status"] == "same"][:MAX_ITEMS_SHOWN],
        "items_total": len(items),
        "counts": counts,
    }


def _ranking(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], set[int]]:
    truth = as_dict(report.get("truth"))
    planted = {p for p in (as_int(x) for x in as_list(truth.get("planted"))) if p is not None}
    spans_by_pos: dict[int, dict[str, Any]] = {}
    for sp in as_list(report.get("spans")):
        sp = as_dict(sp)
        pos = as_int(sp.get("position"))
        if pos is None:
            continue
        cur = spans_by_pos.get(pos)
        if cur is None or (as_float(sp.get("score")) or -math.inf) > (as_float(cur.get("score")) or -math.inf):
            spans_by_pos[pos] = sp
    rows = []
    for i, r in enumerate(as_list(report.get("ranking"))):
        r = as_dict(r)
        pos = as_int(r.get("position"))
        text = r.get("text")
        full = text is not None
        text = as_str(text if text is not None else r.get("preview"))
        span = r.get("top_span")
        span = as_dict(span) if span else (spans_by_pos.get(pos) if pos is not None else None)
        if span:
            before, mid, after = split_span(text, span.get("start"), span.get("end"), span.get("text"))
        else:
            before, mid, after = split_span(text, None, None, None)
        bl, tl = as_float(r.get("base_loss")), as_float(r.get("tuned_loss"))
        rows.append(
            {
                "rank": r.get("rank", i + 1),
                "position": r.get("position"),
                "id": as_str(r.get("id")),
                "score": r.get("score"),
                # what the histogram of scores.npy is drawn from: the ranking score (best window or exchange, the
                # max over items), which is not the whole-row mean for every row
                "rank_score": r.get("window_score", r.get("score")),
                "base_loss": bl,
                "tuned_loss": tl,
                "loss_change": (tl - bl) if (bl is not None and tl is not None) else None,
                "before": before,
                "mark": mid,
                "after": after,
                "span_score": (span or {}).get("score") if mid else None,
                "full_text": full,
                "planted": pos in planted if truth else None,
                "accused": bool(r.get("accused", True)),
                "turn": _turn_note(r.get("turn")),
            }
        )
    return rows, planted


def _turn_note(turn: Any) -> Optional[str]:
    """"ranked by exchange 2 of 4" for a conversation ranked by its best exchange."""
    t = as_dict(turn) if turn else None
    if not t or as_int(t.get("turn")) is None:
        return None
    return f"ranked by exchange {as_int(t.get('turn')) + 1} of {as_int(t.get('turns'))}"


def _scores_plot(report: Mapping[str, Any], rows: list[dict[str, Any]], planted: set[int]) -> dict[str, Any]:
    summary = as_dict(report.get("scores_summary"))
    hist = None
    all_scores = report.get("all_scores")
    planted_missed: list[dict[str, Any]] = []
    if all_scores is not None:
        try:
            hist = histogram_from_scores(all_scores)
        except (TypeError, ValueError):
            hist = None
    if hist is None:
        h = as_dict(summary.get("histogram"))
        if h.get("edges") is not None and h.get("counts") is not None:
            hist = {"edges": as_list(h.get("edges")), "counts": as_list(h.get("counts"))}
    accused = [
        {"score": r["rank_score"], "rank": r["rank"], "id": r["id"], "planted": bool(r["planted"])} for r in rows
    ]
    # Planted rows that did not make the ranking: report their rank when every score is known.
    in_ranking = {as_int(r["position"]) for r in rows}
    if planted and all_scores is not None:
        try:
            import numpy as np

            arr = np.asarray(all_scores, dtype=np.float64).ravel()
            order = np.argsort(-arr, kind="stable")
            rank_of = np.empty_like(order)
            rank_of[order] = np.arange(1, len(order) + 1)
            for p in sorted(planted - in_ranking):
                if 0 <= p < len(arr):
                    planted_missed.append({"position": p, "rank": int(rank_of[p]), "score": float(arr[p])})
        except (TypeError, ValueError):
            planted_missed = []
    return {
        "svg": histogram_svg(hist, accused),
        "summary": summary,
        "has_hist": hist is not None,
        "planted_missed": planted_missed,
        "planted_missed_unknown": sorted(planted - in_ranking) if (planted and all_scores is None) else [],
    }


def _clusters(report: Mapping[str, Any], rank_by_pos: dict[int, Any]) -> list[dict[str, Any]]:
    out = []
    for c in as_list(report.get("clusters")):
        c = as_dict(c)
        positions = [p for p in as_list(c.get("positions"))]
        ranks = sorted(r for r in (rank_by_pos.get(as_int(p)) for p in positions) if r is not None)
        out.append(
            {
                "id": c.get("id"),
                "size": c.get("size", len(positions)),
                "score": c.get("score"),
                "p_value": c.get("p_value"),
                "positions": positions[:MAX_POSITIONS_SHOWN],
                "positions_more": max(len(positions) - MAX_POSITIONS_SHOWN, 0),
                "ranks": ranks[:MAX_POSITIONS_SHOWN],
                "preview": as_str(c.get("preview")),
            }
        )
    return out


def _spans(report: Mapping[str, Any], rank_by_pos: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    for sp in as_list(report.get("spans")):
        sp = as_dict(sp)
        rows.append(
            {
                "position": sp.get("position"),
                "rank": rank_by_pos.get(as_int(sp.get("position"))),
                "start": sp.get("start"),
                "end": sp.get("end"),
                "text": as_str(sp.get("text")),
                "score": sp.get("score"),
            }
        )
    rows.sort(key=lambda r: -(as_float(r["score"]) if as_float(r["score"]) is not None else -math.inf))
    return rows[:100]


def _query(report: Mapping[str, Any], rank_by_pos: dict[int, Any]) -> dict[str, Any]:
    q = as_dict(report.get("query"))
    items = []
    for it in as_list(q.get("items")):
        it = as_dict(it)
        top = []
        for r in as_list(it.get("ranking"))[:5]:
            r = as_dict(r)
            top.append({"position": r.get("position"), "score": r.get("score"),
                        "rank": rank_by_pos.get(as_int(r.get("position")))})
        items.append(
            {
                "item": it.get("item"),
                "prompt": as_str(it.get("prompt")),
                "expected": as_str(it.get("expected")),
                "generated": as_str(it.get("generated")),
                "base_generated": as_str(it.get("base_generated")),
                "top": top,
            }
        )
    ck = as_dict(q.get("checkpoints"))
    checkpoints = [as_str(x) for x in (ck.get("labels") or [])] if isinstance(ck.get("labels"), list) else []
    return {"formulation": as_str(q.get("formulation")), "rows": items[:MAX_ITEMS_SHOWN], "total": len(items),
            "checkpoints": checkpoints, "combine": as_str(q.get("combine"))}


def _fidelity(index: Mapping[str, Any], fidelity: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Fidelity figures in groups: those recorded with the index build, and those from fidelity.json."""
    groups: list[dict[str, Any]] = []
    inner = index.get("fidelity")
    if isinstance(inner, Mapping) and inner:
        groups.append({"title": "measured with the index build", "rows": flatten(inner)})
    if isinstance(fidelity, Mapping) and fidelity:
        groups.append({"title": "from fidelity.json (leave-one-out / LDS)", "rows": flatten(fidelity)})
    return groups


def _verify(verify: Mapping[str, Any] | None) -> dict[str, Any] | None:
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
        "title": {"confirmed": "Confirmed", "not_confirmed": "Not confirmed", "not_reproduced": "Not reproduced",
                  "inconclusive": "Inconclusive"}.get(as_str(verify.get("verdict")) or "",
                                                      "Confirmed" if confirmed is True else
                                                      ("Not confirmed" if confirmed is False else "Verify result")),
        "tone": "attributed" if confirmed is True else ("declined" if confirmed is False else "unknown"),
        "statement": as_str(verify.get("statement")),
    }


def _timings(timings: Any) -> dict[str, Any]:
    rows = []
    for k, v in as_dict(timings).items():
        f = as_float(v)
        rows.append({"step": str(k), "seconds": f})
    vals = [r["seconds"] for r in rows if r["seconds"] is not None]
    mx = max(vals) if vals else 0.0
    for r in rows:
        r["frac"] = (r["seconds"] / mx) if (mx > 0 and r["seconds"] is not None) else 0.0
    total = sum(vals) if vals else None
    return {"rows": rows, "total": total}


def page_context(report: Mapping[str, Any], verify: Mapping[str, Any] | None,
             fidelity: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(report, Mapping):
        raise TypeError(f"report must be a mapping (the parsed report.json), not {type(report).__name__}")
    cap = as_dict(report.get("capability"))
    rows, planted = _ranking(report)
    rank_by_pos = {p: r["rank"] for r in rows if (p := as_int(r["position"])) is not None}
    flags = [as_dict(f) for f in as_list(report.get("flags"))]
    flags.sort(key=lambda f: _LEVEL_ORDER.get(as_str(f.get("level")), 3))
    flag_counts = {lvl: sum(1 for f in flags if f.get("level") == lvl) for lvl in ("error", "warning", "info")}
    index = as_dict(report.get("index"))
    projection = index.get("projection")
    metrics = as_dict(report.get("metrics"))
    truth = as_dict(report.get("truth"))
    return {
        "version": __version__,
        # No wall-clock time of its own: the same report renders to the same bytes.
        "created_at": as_str(report.get("created_at") or report.get("created")),
        "schema": as_str(report.get("schema")) or "unknown",
        "banner": banner(report, cap),
        "flags": flags,
        "flag_counts": flag_counts,
        "cap": _capability(cap),
        "cap_svg": capability_svg(cap) if cap else None,
        "rows": rows,
        "accused": accused(report),
        "has_truth": bool(truth),
        "planted_total": len(planted),
        "planted_found": sum(1 for r in rows if r["planted"]),
        "scores": _scores_plot(report, rows, planted),
        "clusters": _clusters(report, rank_by_pos),
        "spans": _spans(report, rank_by_pos),
        "query": _query(report, rank_by_pos),
        "index": index,
        "projection": as_dict(projection) if isinstance(projection, Mapping) else None,
        "fidelity_groups": _fidelity(index, fidelity),
        "settings_rows": flatten(as_dict(report.get("settings"))),
        "timings": _timings(report.get("timings")),
        "verify": _verify(verify),
        "metrics": metrics,
    }
