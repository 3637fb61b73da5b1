"""The self-contained HTML report (``report.html``).

One file, readable offline: styles inline, plots as inline SVG built in :mod:`gradian.plots`, no scripts and no
network fetches (a Content-Security-Policy meta tag forbids both, as a second line of defence).

Security: training and eval text is untrusted. The Jinja environment autoescapes everything; the template never
marks data ``|safe``. Span highlighting splits a row's text into three plain strings (before, span, after) in
Python and the template escapes each one separately around a ``<mark>``. The only markup handed to the template
pre-built is the SVG from :mod:`gradian.plots`, which escapes every piece of text it draws.

API::

    render_html(report, verify=None, fidelity=None) -> str
    write_html(report, path, verify=None, fidelity=None) -> Path     # atomic: temp file + os.replace
    load_run(run_dir) -> (report, verify | None, fidelity | None)
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from . import __version__
from .errors import GradianError
from .plots import capability_svg, fmt_num, histogram_from_scores, histogram_svg

__all__ = ["render_html", "write_html", "load_run", "split_span"]

TEMPLATE_NAME = "report.html.j2"
TEMPLATE_DIR = Path(__file__).with_name("templates")

# Long rows are trimmed around their highlighted span; the full text stays in the training file.
MAX_ROW_CHARS = 4000
CONTEXT_CHARS = 1500
MAX_ITEMS_SHOWN = 500
MAX_POSITIONS_SHOWN = 40

_LEVEL_ORDER = {"error": 0, "warning": 1, "info": 2}


# ------------------------------------------------------------------------------------------------ environment


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=True,  # every {{ }} is escaped, whatever the template's file name
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    for name, fn in (("num", fmt_num), ("pct", _pct), ("bytes", _human_bytes), ("secs", _human_seconds),
                     ("signed", _signed)):
        env.filters[name] = _missing_as_dash(fn)
    return env


def _missing_as_dash(fn: Any) -> Any:
    """Number filters show a dash for a field the report does not have."""

    def wrapped(x: Any, *a: Any) -> str:
        return "–" if isinstance(x, jinja2.Undefined) else fn(x, *a)

    wrapped.__name__ = getattr(fn, "__name__", "filter")
    return wrapped


def _pct(x: Any, digits: int = 1) -> str:
    v = _float(x)
    return "–" if v is None else f"{v * 100:.{digits}f}%"


def _signed(x: Any) -> str:
    v = _float(x)
    if v is None:
        return "–"
    s = fmt_num(v, 3)
    return s if s.startswith("-") or v == 0 else "+" + s


def _human_bytes(x: Any) -> str:
    v = _float(x)
    if v is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # pragma: no cover


def _human_seconds(x: Any) -> str:
    v = _float(x)
    if v is None:
        return "–"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.1f} s"
    m, s = divmod(v, 60)
    if m < 120:
        return f"{int(m)} min {s:.0f} s"
    h, m = divmod(m, 60)
    return f"{int(h)} h {int(m)} min"


def _float(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _str(x: Any) -> str:
    return "" if x is None else str(x)


def _dict(x: Any) -> dict[str, Any]:
    return dict(x) if isinstance(x, Mapping) else {}


def _list(x: Any) -> list[Any]:
    if x is None or isinstance(x, (str, bytes, Mapping)):
        return []
    try:
        return list(x)
    except TypeError:
        return []


# ------------------------------------------------------------------------------------------------ spans


def split_span(text: str, start: Any, end: Any, span_text: str | None = None) -> tuple[str, str, str]:
    """Split ``text`` into (before, span, after) as plain strings for separate escaping.

    Offsets are character offsets into ``text``. When they do not match the span's own text (a report written
    against a differently rendered row), the span text is searched for instead; failing that, nothing is
    highlighted. Very long rows are trimmed around the span with an ellipsis.
    """
    text = _str(text)
    s, e = _int(start), _int(end)
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


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested settings as dotted keys with display strings."""
    rows: list[tuple[str, str]] = []
    if isinstance(d, Mapping):
        if not d and prefix:
            rows.append((prefix, "{}"))
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            rows.extend(_flatten(v, key))
        return rows
    rows.append((prefix or "value", _display(d)))
    return rows


def _display(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float) or type(v).__name__.startswith(("float", "int", "uint")):
        return fmt_num(v)
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        if all(not isinstance(x, (Mapping, list, tuple)) for x in v):
            shown = ", ".join(_display(x) for x in v[:MAX_POSITIONS_SHOWN])
            more = f", … ({len(v)} in all)" if len(v) > MAX_POSITIONS_SHOWN else ""
            return f"[{shown}{more}]"
        try:
            s = json.dumps(v, default=str)
        except (TypeError, ValueError):
            s = str(v)
        return s if len(s) <= 400 else s[:400] + " …"
    return str(v)


def _banner(report: Mapping[str, Any], cap: Mapping[str, Any]) -> dict[str, Any]:
    verdict = _str(report.get("verdict")).strip() or "unknown"
    metric = _str(cap.get("metric")) or "the metric"
    conf = _float(cap.get("confidence"))
    conf_txt = f"{conf * 100:.0f}%" if conf is not None else "confidence"
    ci = _list(cap.get("ci"))
    lo = _float(ci[0]) if len(ci) > 0 else None
    hi = _float(ci[1]) if len(ci) > 1 else None
    base, tuned, delta = _float(cap.get("base")), _float(cap.get("tuned")), _float(cap.get("delta"))
    if delta is None and base is not None and tuned is not None:
        delta = tuned - base
    n = _int(cap.get("n"))
    mdd = _float(cap.get("min_detectable_delta"))
    n_acc = len(_list(report.get("ranking")))

    def change() -> str:
        if base is None or tuned is None:
            return ""
        s = f"{metric} went from {fmt_num(base, 3)} (base) to {fmt_num(tuned, 3)} (fine-tuned)"
        if delta is not None:
            s += f", a change of {_signed(delta)}"
        if lo is not None and hi is not None:
            s += f" ({conf_txt} interval {fmt_num(lo, 3)} to {fmt_num(hi, 3)})"
        if n is not None:
            s += f" over {n} eval items"
        return s + "."

    details: list[str] = []
    if verdict == "attributed":
        title, tone = "Attributed", "attributed"
        default = "The capability changed and the training rows that pushed it are ranked below."
        if change():
            details.append(change())
        if n_acc:
            details.append(f"The {n_acc} highest-scoring training rows are listed as the accused below.")
    elif verdict == "declined":
        title, tone = "Declined: no attribution", "declined"
        default = ("The capability did not change measurably, so there is nothing to attribute; "
                   "no training rows are accused.")
        if change():
            details.append(change())
        if lo is not None and hi is not None:
            details.append(
                f"The {conf_txt} interval for the change, [{fmt_num(lo, 3)}, {fmt_num(hi, 3)}], "
                + ("includes zero." if lo <= 0 <= hi else "does not clear the significance test.")
            )
        if mdd is not None:
            details.append(
                f"The smallest change this eval set can reliably detect is about {fmt_num(mdd, 3)}; "
                "a larger eval set detects smaller changes."
            )
    elif verdict == "smoke_test":
        title, tone = "Smoke test: not evidence", "smoke"
        default = ("This run exercised the pipeline end to end; the ranking below is not evidence "
                   "about which rows caused a change.")
        if change():
            details.append(change())
        details.append("Treat the ranking as a check that attribution runs, not as a finding.")
    else:
        title, tone = f"Verdict: {verdict}", "unknown"
        default = "This report has a verdict this version of gradian does not know."
    return {
        "verdict": verdict,
        "title": title,
        "tone": tone,
        "text": _str(report.get("verdict_text")).strip() or default,
        "details": details,
    }


def _capability(cap: Mapping[str, Any]) -> dict[str, Any]:
    items = []
    for i, it in enumerate(_list(cap.get("items"))):
        it = _dict(it)
        bc, tc = it.get("base_correct"), it.get("tuned_correct")
        if bc is None and tc is None and cap.get("metric") in ("exact_match", "contains"):
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
                "prompt": _str(it.get("prompt")),
                "expected": _str(it.get("expected")),
                "base_generated": _str(it.get("base_generated")),
                "generated": _str(it.get("generated")),
                "base_correct": bc,
                "tuned_correct": tc,
                "status": status,
                "_order": order,
                "_i": i,
            }
        )
    items.sort(key=lambda r: (r["_order"], r["_i"]))
    counts = {k: sum(1 for r in items if r["status"] == k) for k in ("regressed", "improved", "same", "unknown")}
    ci = _list(cap.get("ci"))
    return {
        "present": bool(cap),
        "metric": _str(cap.get("metric")) or "metric",
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
    truth = _dict(report.get("truth"))
    planted = {p for p in (_int(x) for x in _list(truth.get("planted"))) if p is not None}
    spans_by_pos: dict[int, dict[str, Any]] = {}
    for sp in _list(report.get("spans")):
        sp = _dict(sp)
        pos = _int(sp.get("position"))
        if pos is None:
            continue
        cur = spans_by_pos.get(pos)
        if cur is None or (_float(sp.get("score")) or -math.inf) > (_float(cur.get("score")) or -math.inf):
            spans_by_pos[pos] = sp
    rows = []
    for i, r in enumerate(_list(report.get("ranking"))):
        r = _dict(r)
        pos = _int(r.get("position"))
        text = r.get("text")
        full = text is not None
        text = _str(text if text is not None else r.get("preview"))
        span = r.get("top_span")
        span = _dict(span) if span else (spans_by_pos.get(pos) if pos is not None else None)
        if span:
            before, mid, after = split_span(text, span.get("start"), span.get("end"), span.get("text"))
        else:
            before, mid, after = split_span(text, None, None, None)
        bl, tl = _float(r.get("base_loss")), _float(r.get("tuned_loss"))
        rows.append(
            {
                "rank": r.get("rank", i + 1),
                "position": r.get("position"),
                "id": _str(r.get("id")),
                "score": r.get("score"),
                "base_loss": bl,
                "tuned_loss": tl,
                "loss_change": (tl - bl) if (bl is not None and tl is not None) else None,
                "before": before,
                "mark": mid,
                "after": after,
                "span_score": (span or {}).get("score") if mid else None,
                "full_text": full,
                "planted": pos in planted if truth else None,
            }
        )
    return rows, planted


def _scores_plot(report: Mapping[str, Any], rows: list[dict[str, Any]], planted: set[int]) -> dict[str, Any]:
    summary = _dict(report.get("scores_summary"))
    hist = None
    all_scores = report.get("all_scores")
    planted_missed: list[dict[str, Any]] = []
    if all_scores is not None:
        try:
            hist = histogram_from_scores(all_scores)
        except (TypeError, ValueError):
            hist = None
    if hist is None:
        h = _dict(summary.get("histogram"))
        if h.get("edges") is not None and h.get("counts") is not None:
            hist = {"edges": _list(h.get("edges")), "counts": _list(h.get("counts"))}
    accused = [
        {"score": r["score"], "rank": r["rank"], "id": r["id"], "planted": bool(r["planted"])} for r in rows
    ]
    # Planted rows that did not make the ranking: report their rank when every score is known.
    in_ranking = {_int(r["position"]) for r in rows}
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
    for c in _list(report.get("clusters")):
        c = _dict(c)
        positions = [p for p in _list(c.get("positions"))]
        ranks = sorted(r for r in (rank_by_pos.get(_int(p)) for p in positions) if r is not None)
        out.append(
            {
                "id": c.get("id"),
                "size": c.get("size", len(positions)),
                "score": c.get("score"),
                "p_value": c.get("p_value"),
                "positions": positions[:MAX_POSITIONS_SHOWN],
                "positions_more": max(len(positions) - MAX_POSITIONS_SHOWN, 0),
                "ranks": ranks[:MAX_POSITIONS_SHOWN],
                "preview": _str(c.get("preview")),
            }
        )
    return out


def _spans(report: Mapping[str, Any], rank_by_pos: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    for sp in _list(report.get("spans")):
        sp = _dict(sp)
        rows.append(
            {
                "position": sp.get("position"),
                "rank": rank_by_pos.get(_int(sp.get("position"))),
                "start": sp.get("start"),
                "end": sp.get("end"),
                "text": _str(sp.get("text")),
                "score": sp.get("score"),
            }
        )
    rows.sort(key=lambda r: -(_float(r["score"]) if _float(r["score"]) is not None else -math.inf))
    return rows[:100]


def _query(report: Mapping[str, Any], rank_by_pos: dict[int, Any]) -> dict[str, Any]:
    q = _dict(report.get("query"))
    items = []
    for it in _list(q.get("items")):
        it = _dict(it)
        top = []
        for r in _list(it.get("ranking"))[:5]:
            r = _dict(r)
            top.append({"position": r.get("position"), "score": r.get("score"),
                        "rank": rank_by_pos.get(_int(r.get("position")))})
        items.append(
            {
                "item": it.get("item"),
                "prompt": _str(it.get("prompt")),
                "expected": _str(it.get("expected")),
                "generated": _str(it.get("generated")),
                "base_generated": _str(it.get("base_generated")),
                "top": top,
            }
        )
    ck = _dict(q.get("checkpoints"))
    checkpoints = [_str(x) for x in (ck.get("labels") or [])] if isinstance(ck.get("labels"), list) else []
    return {"formulation": _str(q.get("formulation")), "rows": items[:MAX_ITEMS_SHOWN], "total": len(items),
            "checkpoints": checkpoints}


def _fidelity(index: Mapping[str, Any], fidelity: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Fidelity figures in groups: those recorded with the index build, and those from fidelity.json."""
    groups: list[dict[str, Any]] = []
    inner = index.get("fidelity")
    if isinstance(inner, Mapping) and inner:
        groups.append({"title": "measured with the index build", "rows": _flatten(inner)})
    if isinstance(fidelity, Mapping) and fidelity:
        groups.append({"title": "from fidelity.json (leave-one-out / LDS)", "rows": _flatten(fidelity)})
    return groups


def _verify(verify: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(verify, Mapping):
        return None
    acc = _dict(verify.get("accused"))
    ci = _list(acc.get("ci"))
    controls = [_dict(c) for c in _list(verify.get("controls"))]
    confirmed = verify.get("confirmed")
    return {
        "top_k": verify.get("top_k"),
        "accused_capability": acc.get("capability"),
        "accused_reverted": acc.get("reverted_fraction"),
        "accused_ci": [ci[0] if len(ci) > 0 else None, ci[1] if len(ci) > 1 else None],
        "controls": controls,
        "control_mean": verify.get("control_mean_reverted"),
        "confirmed": confirmed,
        "tone": "attributed" if confirmed is True else ("declined" if confirmed is False else "unknown"),
        "statement": _str(verify.get("statement")),
    }


def _timings(timings: Any) -> dict[str, Any]:
    rows = []
    for k, v in _dict(timings).items():
        f = _float(v)
        rows.append({"step": str(k), "seconds": f})
    vals = [r["seconds"] for r in rows if r["seconds"] is not None]
    mx = max(vals) if vals else 0.0
    for r in rows:
        r["frac"] = (r["seconds"] / mx) if (mx > 0 and r["seconds"] is not None) else 0.0
    total = sum(vals) if vals else None
    return {"rows": rows, "total": total}


def _context(report: Mapping[str, Any], verify: Mapping[str, Any] | None,
             fidelity: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(report, Mapping):
        raise TypeError(f"report must be a mapping (the parsed report.json), not {type(report).__name__}")
    cap = _dict(report.get("capability"))
    rows, planted = _ranking(report)
    rank_by_pos = {p: r["rank"] for r in rows if (p := _int(r["position"])) is not None}
    flags = [_dict(f) for f in _list(report.get("flags"))]
    flags.sort(key=lambda f: _LEVEL_ORDER.get(_str(f.get("level")), 3))
    flag_counts = {lvl: sum(1 for f in flags if f.get("level") == lvl) for lvl in ("error", "warning", "info")}
    index = _dict(report.get("index"))
    projection = index.get("projection")
    metrics = _dict(report.get("metrics"))
    truth = _dict(report.get("truth"))
    return {
        "version": __version__,
        # No wall-clock time of its own: the same report renders to the same bytes.
        "created_at": _str(report.get("created_at") or report.get("created")),
        "schema": _str(report.get("schema")) or "unknown",
        "banner": _banner(report, cap),
        "flags": flags,
        "flag_counts": flag_counts,
        "cap": _capability(cap),
        "cap_svg": capability_svg(cap) if cap else None,
        "rows": rows,
        "has_truth": bool(truth),
        "planted_total": len(planted),
        "planted_found": sum(1 for r in rows if r["planted"]),
        "scores": _scores_plot(report, rows, planted),
        "clusters": _clusters(report, rank_by_pos),
        "spans": _spans(report, rank_by_pos),
        "query": _query(report, rank_by_pos),
        "index": index,
        "projection": _dict(projection) if isinstance(projection, Mapping) else None,
        "fidelity_groups": _fidelity(index, fidelity),
        "settings_rows": _flatten(_dict(report.get("settings"))),
        "timings": _timings(report.get("timings")),
        "verify": _verify(verify),
        "metrics": metrics,
    }


# ------------------------------------------------------------------------------------------------ public API


def render_html(report: Mapping[str, Any], *, verify: Mapping[str, Any] | None = None,
                fidelity: Mapping[str, Any] | None = None) -> str:
    """Render the report (the parsed ``report.json``) as one self-contained HTML page."""
    env = _environment()
    return env.get_template(TEMPLATE_NAME).render(**_context(report, verify, fidelity))


def write_html(report: Mapping[str, Any], path: Path | str, **kw: Any) -> Path:
    """Render and write atomically: a temp file in the target directory, then ``os.replace``."""
    path = Path(path)
    html = render_html(report, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(html)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
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
    loaded (``allow_pickle=False``) into ``report["all_scores"]`` so the histogram is drawn from the full data
    and planted rows outside the ranking can be placed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GradianError(f"{run_dir}: not a directory; pass the run's output directory")
    report = _read_json(run_dir / "report.json", required=True)
    assert report is not None
    schema = _str(report.get("schema"))
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
            report["all_scores"] = arr
    return report, verify, fidelity
