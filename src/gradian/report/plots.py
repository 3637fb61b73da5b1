"""Inline SVG plots for the HTML report.

Everything here returns a :class:`markupsafe.Markup` string holding one ``<svg>`` element, built by hand: no
plotting library, no scripts, no external references. Every piece of text that comes from a report (metric
names, ids, previews) goes through :func:`markupsafe.escape`; numbers are formatted by Python. Colours come from
CSS classes defined in the report template, so the plots follow the page's theme.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from markupsafe import Markup, escape

from .schema import Capability

__all__ = ["Bins", "RugMark", "capability_svg", "histogram_svg", "fmt_num", "histogram_from_scores"]


@dataclass(frozen=True)
class Bins:
    """A histogram: len(edges) == len(counts) + 1."""

    edges: list[float]
    counts: list[float]


@dataclass(frozen=True)
class RugMark:
    """A ranked row drawn under the histogram's axis."""

    score: Optional[float]
    rank: int
    id: str
    planted: bool = False


def fmt_num(x: Any, digits: int = 4) -> str:
    """Compact, human number formatting: ``0.4123``, ``-1.2e-05``, ``1234``; ``-`` for missing values."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    if isinstance(x, int) or type(x).__name__.startswith(("int", "uint")):
        return f"{int(v):d}"
    if v == 0:
        return "0"
    a = abs(v)
    if 1e-3 <= a < 1e5:
        s = f"{v:.{digits}g}"
    else:
        s = f"{v:.{max(digits - 1, 1)}e}"
        mant, exp = s.split("e")
        if "." in mant:
            mant = mant.rstrip("0").rstrip(".")
        s = f"{mant}e{int(exp):+03d}"
    return s


def _f(x: float) -> str:
    """Coordinates: two decimals, no exponent."""
    return f"{x:.2f}"


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            step = m * mag
            break
    start = math.ceil(lo / step - 1e-9) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9 and len(ticks) < 50:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return ticks


def _tick_label(t: float, span: float) -> str:
    if span >= 5:
        return fmt_num(round(t, 6), 3)
    return fmt_num(round(t, 10), 3)


def _svg_open(svg_id: str, w: int, h: int, label: str) -> str:
    return (
        f'<svg id="{escape(svg_id)}" class="plot" role="img" aria-label="{escape(label)}" '
        f'viewBox="0 0 {w} {h}" width="{w}" height="{h}" preserveAspectRatio="xMinYMin meet">'
        f"<title>{escape(label)}</title>"
    )


def _text(x: float, y: float, s: Any, cls: str = "", anchor: str = "start", extra: str = "") -> str:
    c = f' class="{escape(cls)}"' if cls else ""
    return f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}"{c}{extra}>{escape(s)}</text>'


# --------------------------------------------------------------------------------------------- capability


def capability_svg(cap: Capability, *, svg_id: str = "plot-capability") -> Markup:
    """Base vs fine-tuned bars (left) and the paired delta with its interval (right).

    The right panel draws zero, the delta as a dot, its confidence interval as a whisker and, when known, the
    minimum detectable delta as dashed lines on both sides of zero, so "the interval covers zero" and "the
    change is smaller than what this eval set can detect" are both visible at a glance.
    """
    metric = cap.metric or "metric"
    base = _finite(cap.base)
    tuned = _finite(cap.tuned)
    delta = _finite(cap.delta)
    if delta is None and base is not None and tuned is not None:
        delta = tuned - base
    lo, hi = _finite(cap.ci[0]), _finite(cap.ci[1])
    conf = _finite(cap.confidence)
    mdd = _finite(cap.min_detectable_delta)
    significant = cap.significant

    W, H = 1040, 260
    label = f"{metric}: base {fmt_num(base)}, fine-tuned {fmt_num(tuned)}, delta {fmt_num(delta)}"
    out = [_svg_open(svg_id, W, H, label)]

    # ---- left panel: bars on a 0..1 axis (values above 1 stretch the axis)
    top = 30.0
    bottom = H - 40.0
    left = 50.0
    pw = 300.0
    vmax = max(1.0, base or 0.0, tuned or 0.0)
    vmin = min(0.0, base or 0.0, tuned or 0.0)

    def y_of(v: float) -> float:
        return bottom - (v - vmin) / (vmax - vmin) * (bottom - top)

    out.append(_text(left, 16, f"{metric} (higher is better)", "plot-title"))
    for t in _nice_ticks(vmin, vmax, 5):
        y = y_of(t)
        out.append(f'<line class="grid" x1="{_f(left)}" x2="{_f(left + pw)}" y1="{_f(y)}" y2="{_f(y)}"/>')
        out.append(_text(left - 6, y + 4, _tick_label(t, vmax - vmin), "tick", "end"))
    out.append(f'<line class="axis" x1="{_f(left)}" x2="{_f(left + pw)}" y1="{_f(y_of(0))}" y2="{_f(y_of(0))}"/>')
    bw = 80.0
    for i, (name, val, cls) in enumerate((("base", base, "bar-base"), ("fine-tuned", tuned, "bar-tuned"))):
        cx = left + pw * (0.3 + 0.4 * i)
        x = cx - bw / 2
        out.append(_text(cx, bottom + 18, name, "tick", "middle"))
        if val is None:
            out.append(_text(cx, y_of(0) - 6, "n/a", "tick", "middle"))
            continue
        y0, y1 = sorted((y_of(0), y_of(val)))
        out.append(
            f'<rect class="{cls}" x="{_f(x)}" y="{_f(y0)}" width="{_f(bw)}" height="{_f(max(y1 - y0, 0.5))}">'
            f"<title>{escape(name)}: {escape(fmt_num(val))}</title></rect>"
        )
        out.append(_text(cx, y_of(val) - 6, fmt_num(val, 3), "value", "middle"))

    # ---- right panel: delta with interval
    rl = 420.0
    rr = W - 30.0
    cy = 120.0
    pts = [0.0] + [v for v in (delta, lo, hi) if v is not None]
    if mdd is not None:
        pts += [mdd, -mdd]
    span = max(abs(p) for p in pts) or 0.1
    span = span * 1.15
    xlo, xhi = -span, span

    def x_of(v: float) -> float:
        return rl + (v - xlo) / (xhi - xlo) * (rr - rl)

    conf_txt = f"{conf * 100:.0f}% interval" if conf is not None else "interval"
    out.append(_text(rl, 16, f"change (fine-tuned − base) with {conf_txt}", "plot-title"))
    axis_y = cy + 60
    out.append(f'<line class="axis" x1="{_f(rl)}" x2="{_f(rr)}" y1="{_f(axis_y)}" y2="{_f(axis_y)}"/>')
    for t in _nice_ticks(xlo, xhi, 6):
        x = x_of(t)
        out.append(f'<line class="grid" x1="{_f(x)}" x2="{_f(x)}" y1="{_f(40)}" y2="{_f(axis_y)}"/>')
        out.append(_text(x, axis_y + 16, _tick_label(t, xhi - xlo), "tick", "middle"))
    out.append(f'<line class="zero" x1="{_f(x_of(0))}" x2="{_f(x_of(0))}" y1="40" y2="{_f(axis_y)}"/>')
    if mdd is not None and mdd > 0:
        for s in (-1, 1):
            x = x_of(s * mdd)
            out.append(
                f'<line class="mdd" x1="{_f(x)}" x2="{_f(x)}" y1="40" y2="{_f(axis_y)}">'
                f"<title>minimum detectable delta ±{escape(fmt_num(mdd))}</title></line>"
            )
        xm = x_of(mdd)
        if xm + 120 <= W:
            out.append(_text(xm + 4, 52, f"±{fmt_num(mdd, 3)} detectable", "tick mdd-label"))
        else:
            out.append(_text(xm - 4, 52, f"±{fmt_num(mdd, 3)} detectable", "tick mdd-label", "end"))
        # A faint band for "too small to detect".
        out.append(
            f'<rect class="mdd-band" x="{_f(x_of(-mdd))}" y="40" width="{_f(x_of(mdd) - x_of(-mdd))}" '
            f'height="{_f(axis_y - 40)}"/>'
        )
    kind = "sig" if significant else "nonsig"
    if lo is not None and hi is not None:
        out.append(
            f'<line class="ci {kind}" x1="{_f(x_of(lo))}" x2="{_f(x_of(hi))}" y1="{_f(cy)}" y2="{_f(cy)}">'
            f"<title>{escape(conf_txt)} [{escape(fmt_num(lo))}, {escape(fmt_num(hi))}]</title></line>"
        )
        for v in (lo, hi):
            out.append(
                f'<line class="ci {kind}" x1="{_f(x_of(v))}" x2="{_f(x_of(v))}" '
                f'y1="{_f(cy - 9)}" y2="{_f(cy + 9)}"/>'
            )
        out.append(_text(x_of(lo), cy + 26, fmt_num(lo, 3), "tick", "middle"))
        out.append(_text(x_of(hi), cy + 26, fmt_num(hi, 3), "tick", "middle"))
    if delta is not None:
        out.append(
            f'<circle class="delta {kind}" cx="{_f(x_of(delta))}" cy="{_f(cy)}" r="6">'
            f"<title>delta {escape(fmt_num(delta))}</title></circle>"
        )
        out.append(_text(x_of(delta), cy - 14, f"Δ = {fmt_num(delta, 3)}", "value", "middle"))
    verdict = "interval excludes 0" if significant else "interval includes 0 (not significant)"
    if lo is not None and hi is not None:
        out.append(_text((rl + rr) / 2, H - 12, verdict, f"tick {kind}-label", "middle"))
    out.append("</svg>")
    return Markup("".join(out))


# --------------------------------------------------------------------------------------------- histogram


def histogram_from_scores(scores: Iterable[float], bins: int = 40) -> Optional[Bins]:
    """Histogram (edges, counts) of the finite scores; ``None`` when there are none."""
    import numpy as np

    arr = np.asarray(list(scores) if not hasattr(scores, "__array__") else scores, dtype=np.float64).ravel()
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return None
    lo, hi = float(arr.min()), float(arr.max())
    if hi <= lo:
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    counts, edges = np.histogram(arr, bins=bins, range=(lo, hi))
    return Bins([float(e) for e in edges], [int(c) for c in counts])


def histogram_svg(
    histogram: Optional[Bins],
    accused: Sequence[RugMark] = (),
    *,
    svg_id: str = "plot-scores",
    log_counts: bool = True,
) -> Markup:
    """Score distribution over all training rows, with the accused rows as a rug under the axis.

    ``accused`` holds the ranked rows' marks (score, rank, id, planted). Counts use a
    log scale by default: the accused sit in a thin tail that a linear axis would flatten to nothing.
    """
    W, H = 1040, 300
    left, right, top, bottom = 56.0, W - 24.0, 30.0, H - 92.0
    edges = list(histogram.edges) if histogram is not None else []
    counts = list(histogram.counts) if histogram is not None else []
    ok = len(edges) == len(counts) + 1 and len(counts) > 0
    label = "distribution of attribution scores over all training rows"
    out = [_svg_open(svg_id, W, H, label)]
    if not ok:
        out.append(_text(W / 2, H / 2, "no score distribution in this report", "tick", "middle"))
        out.append("</svg>")
        return Markup("".join(out))

    e = [float(x) for x in edges]
    c = [max(float(x), 0.0) for x in counts]
    acc_scores = [s for s in (_finite(a.score) for a in accused) if s is not None]
    xmin = min([e[0], *acc_scores])
    xmax = max([e[-1], *acc_scores])
    if xmax <= xmin:
        xmax = xmin + 1.0

    def x_of(v: float) -> float:
        return left + (v - xmin) / (xmax - xmin) * (right - left)

    def tr(v: float) -> float:
        return math.log10(1.0 + v) if log_counts else v

    cmax = max(tr(v) for v in c) or 1.0

    def y_of(v: float) -> float:
        return bottom - tr(v) / cmax * (bottom - top)

    scale = "log scale" if log_counts else "linear"
    out.append(_text(left, 16, f"training rows per score bin ({scale}); accused rows marked below the axis",
                     "plot-title"))
    # y grid: 1, 10, 100, ... on log scale
    if log_counts:
        ymax_count = max(c)
        k = 0
        while 10**k <= ymax_count * 1.0001 and k < 12:
            y = y_of(10**k)
            out.append(f'<line class="grid" x1="{_f(left)}" x2="{_f(right)}" y1="{_f(y)}" y2="{_f(y)}"/>')
            out.append(_text(left - 6, y + 4, fmt_num(10**k), "tick", "end"))
            k += 1
    else:
        for t in _nice_ticks(0, max(c), 4):
            y = y_of(t)
            out.append(f'<line class="grid" x1="{_f(left)}" x2="{_f(right)}" y1="{_f(y)}" y2="{_f(y)}"/>')
            out.append(_text(left - 6, y + 4, fmt_num(t), "tick", "end"))

    cutoff = min(acc_scores) if acc_scores else None
    for i, cnt in enumerate(c):
        x0, x1 = x_of(e[i]), x_of(e[i + 1])
        if cnt <= 0:
            continue
        y = y_of(cnt)
        # A bin is "accused" only when all of it lies at or above the lowest accused score.
        cls = "hbar hbar-tail" if (cutoff is not None and e[i] >= cutoff) else "hbar"
        out.append(
            f'<rect class="{cls}" x="{_f(x0 + 0.5)}" y="{_f(y)}" width="{_f(max(x1 - x0 - 1.0, 0.8))}" '
            f'height="{_f(bottom - y)}"><title>[{escape(fmt_num(e[i]))}, {escape(fmt_num(e[i + 1]))}): '
            f"{int(cnt)} rows</title></rect>"
        )
    out.append(f'<line class="axis" x1="{_f(left)}" x2="{_f(right)}" y1="{_f(bottom)}" y2="{_f(bottom)}"/>')
    for t in _nice_ticks(xmin, xmax, 10):
        x = x_of(t)
        out.append(f'<line class="axis" x1="{_f(x)}" x2="{_f(x)}" y1="{_f(bottom)}" y2="{_f(bottom + 4)}"/>')
        out.append(_text(x, bottom + 44, _tick_label(t, xmax - xmin), "tick", "middle"))
    out.append(_text((left + right) / 2, bottom + 62, "attribution score (higher = pushed the change more)",
                     "tick", "middle"))

    if cutoff is not None:
        xc = x_of(cutoff)
        out.append(f'<line class="cutoff" x1="{_f(xc)}" x2="{_f(xc)}" y1="{_f(top)}" y2="{_f(bottom)}">'
                   f"<title>lowest accused score {escape(fmt_num(cutoff))}</title></line>")
        out.append(_text(xc + 5, top + 10, f"top-{len(acc_scores)} cutoff", "tick cutoff-label", "start"))

    # Rug of accused rows: one tick each, planted rows drawn as a ring as well.
    rug_y = bottom + 12
    for a in accused:
        s = _finite(a.score)
        if s is None:
            continue
        x = x_of(s)
        tip = f"rank {a.rank}: {a.id} score {fmt_num(s)}"
        if a.planted:
            tip += " (planted)"
        out.append(
            f'<g class="rug"><title>{escape(tip)}</title>'
            f'<line class="rug-tick" x1="{_f(x)}" x2="{_f(x)}" y1="{_f(rug_y - 7)}" y2="{_f(rug_y + 7)}"/>'
            + (f'<circle class="rug-planted" cx="{_f(x)}" cy="{_f(rug_y + 13)}" r="3.5"/>' if a.planted
               else "")
            + "</g>"
        )
    legend_y = H - 8
    out.append(f'<line class="rug-tick" x1="{_f(left)}" x2="{_f(left)}" y1="{_f(legend_y - 10)}" '
               f'y2="{_f(legend_y)}"/>')
    out.append(_text(left + 6, legend_y, "accused row", "tick"))
    if any(a.planted for a in accused):
        out.append(f'<circle class="rug-planted" cx="{_f(left + 100)}" cy="{_f(legend_y - 4)}" r="3.5"/>')
        out.append(_text(left + 108, legend_y, "planted (ground truth)", "tick"))
    out.append("</svg>")
    return Markup("".join(out))
