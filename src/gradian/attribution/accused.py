"""How many rows are accused: the rows whose score stands out from the null of the training set's own scores.

Most training rows did not cause the change; their scores are the null: a bulk centred near zero whose spread is
the small, unrelated alignment of every row with the query. A cause is an outlier of that bulk. The rule, on the
ranking score (the item-averaged score, best window for long rows):

    accused = the top rows of the ranking with  (score - median) / (1.4826 x MAD) > Z_ACCUSED

median and MAD (median absolute deviation; 1.4826 x MAD is the standard deviation of a normal bulk) are robust: the
few causes do not move them, and a run with many causes (a cluster of 20 poisons in 300 rows) still leaves the bulk
to set the scale. Z_ACCUSED is calibrated on unit-normalised row scores (attribution.unit_rows, the default), over
the built-in tiny scenarios and the real-model ones (bench/real_models.py): the benign rows' largest robust z there is
2.8 to 4.9, the planted rows' median 4.7 to 30 (the tiny demo's lowest planted row 7.5); 6 keeps every benign row out
with a margin above the largest. A declined verdict accuses nobody.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

Z_ACCUSED = 6.0
MAD_TO_SD = 1.4826  # MAD x this = the standard deviation of a normal distribution


def robust_z(scores: np.ndarray) -> tuple[np.ndarray, float, float]:
    """(z, median, scale) with z = (score - median) / scale and scale = 1.4826 x MAD (the mean absolute deviation
    when more than half the rows share one score, so the MAD is 0)."""
    s = np.asarray(scores, dtype=np.float64)
    if s.size == 0:
        return s.copy(), 0.0, 0.0
    med = float(np.median(s))
    dev = np.abs(s - med)
    scale = MAD_TO_SD * float(np.median(dev))
    if scale <= 0:
        scale = float(dev.mean())
    if scale <= 0:
        return np.zeros_like(s), med, 0.0
    return (s - med) / scale, med, scale


def accused_count(scores: np.ndarray, z: float = Z_ACCUSED) -> int:
    """Rows whose robust z exceeds `z`."""
    zs, _, scale = robust_z(scores)
    return int((zs > z).sum()) if scale > 0 else 0


def accused_set(scores: np.ndarray, order: Optional[Sequence[int]] = None, *, z: float = Z_ACCUSED,
                limit: Optional[int] = None, combine: str = "mean") -> dict:
    """The accused rows: the first `accused_count` rows of the ranking `order` (default: by decreasing score), at
    most `limit` (the rows the report lists). The report's `accused` entry.

    `scores` are the items' mean ranking scores. With `combine` max the ranking is by the item each row stands out
    on most (`scoring.combine_items`), and the count is still the mean's: the max of Q noisy scores has a heavier
    upper tail than the bulk's robust scale describes, so its own outliers would include benign rows (4 of 12
    accused rows on a planted-fact set, bench/README.md), while the mean's count names how many rows stand out over
    the whole set."""
    s = np.asarray(scores, dtype=np.float64)
    zs, med, scale = robust_z(s)
    k = int((zs > z).sum()) if scale > 0 else 0
    capped = limit is not None and k > limit
    if capped:
        k = int(limit)
    if order is None:
        order = np.lexsort((np.arange(s.size), -s))
    pos = [int(p) for p in list(order)[:k]]
    return {"count": k, "positions": pos, "z_threshold": float(z), "median": med, "scale": scale,
            "capped_at_top_k": bool(capped),
            "rule": _rule(z, s.size, combine)}


def _rule(z: float, n: int, combine: str) -> str:
    null = (f"more than {z:g} robust standard deviations above the median of all {n} rows' scores (scale = 1.4826 x "
            "median absolute deviation): outliers of the null that the unrelated rows form")
    if combine == "max":
        return (f"as many rows, from the top of the ranking (each row's robust z on the failing item it stands out "
                f"on most), as there are rows whose score averaged over the failing items is {null}")
    return f"rows whose ranking score is {null}"


def none_accused(reason: str) -> dict:
    """The entry of a run that accuses nobody (declined, smoke test)."""
    return {"count": 0, "positions": [], "z_threshold": Z_ACCUSED, "median": None, "scale": None,
            "capped_at_top_k": False, "rule": reason}
