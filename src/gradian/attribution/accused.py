"""Which rows are accused, each with its evidence: one statistic decides both how many rows and which.

The statistic. Each failing item's scores are put in robust z units of that item's own rows (`robust_z`: the
median and 1.4826 x MAD over its reference rows, `scoring.reference_rows`), so items whose bulk scatters widely do
not dominate. A row's statistic
is then the strongest evidence any set of items gives against it:

    A_row = max over k of (sum of the row's k highest item z-scores) / sqrt(k)

(a scan over the row's items, best first). A row that planted one fact stands out on the one or two items that
ask it, and A is its z there; a row among many that taught one behaviour, a format or a refusal, stands out a
little on every item, and the sum over the items adds that evidence up (k = all items, A = sqrt(Q) x its mean z).
The items of the best k are the items the row explains: its evidence in the report.

The count. The accused rows are those above the widest drop in the ranking by A, among the rows with A above
`A_MIN`: the largest ratio A_(k) / A_(k+1) of consecutive rows, if it is at least `MIN_DROP`; otherwise nobody.
Why a drop and not a fixed threshold: the rows that did not cause the change are not a thin null around zero. On
a real fine-tune the rows of the failing task itself (true facts of the same kind as the planted wrong one, the
rows that taught the answer's form) stand 20 to 80 robust standard deviations out on the items they resemble,
above any fixed threshold, and their number grows with the data (issue 42: 24 of 50 accused rows innocent on a
2,000-row set). They form a continuum; a cause stands above the rows it could be confused with, by a drop.
The threshold a row had to pass is the geometric mean of the two sides of that drop.

A declined run, a smoke test or flat scores accuse nobody (`nobody`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .scoring import item_z, robust_z  # noqa: F401 (robust_z: read by the benches from here)

A_MIN = 6.0  # an accused row stands at least this many robust SD out on its items
MIN_DROP = 1.3  # the drop below the accused rows: at least this ratio between consecutive rows' statistics
MAX_SHARE = 3  # the drop is looked for among the top 1/MAX_SHARE of the rows (at most MAX_ROWS)
MAX_ROWS = 500
ALPHA = 0.01  # how unlikely the drop must be among rows that caused nothing (`widest_drop`)
TAIL_ROWS = 20  # the rows below the drop whose spread says how heavy the tail is

# Kept for readers of older reports: the robust z a row's score had to exceed under the rule before issue 42.
Z_ACCUSED = A_MIN


def scan(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(A [N], k [N]): each row's best sum of its k highest item z-scores over sqrt(k), and that k."""
    if not z.shape[0]:
        return np.zeros(z.shape[1]), np.zeros(z.shape[1], dtype=np.int64)
    top = -np.sort(-z, axis=0)
    sums = np.cumsum(top, axis=0) / np.sqrt(np.arange(1, z.shape[0] + 1))[:, None]
    k = sums.argmax(axis=0)
    return sums[k, np.arange(z.shape[1])], k + 1


@dataclass(frozen=True)
class Drop:
    """Where the ranking by the statistic drops: `count` rows above it, the ratio of the rows on its two sides, and
    how likely a drop that wide is among rows that caused nothing (`p`, corrected for the rows it was chosen from)."""

    count: int
    ratio: float
    p: float


def widest_drop(stat: np.ndarray, *, a_min: float = A_MIN, min_drop: float = MIN_DROP, alpha: float = ALPHA,
                tail_rows: int = TAIL_ROWS) -> Drop:
    """The widest drop of `stat` among the rows above `a_min` (looked for in the top third of the rows, at most
    MAX_ROWS): the largest ratio x_(k) / x_(k+1) of consecutive sorted values. It counts (`Drop.count` > 0) when
    the ratio is at least `min_drop` and the drop is unlikely in a tail as heavy as the rows below it.

    Why the second condition: the rows that caused nothing have a heavy upper tail (a row's largest z over many
    items, on gradients whose scores are far from normal), and in a heavy tail the top rows are far apart by
    nature: under Student-t noise with 3 to 4 degrees of freedom a drop of 1.3 over the rows above 6 appears in half
    the runs. Whatever the tail, its top values behave like a Pareto tail's, where k x ln(x_(k) / x_(k+1)) is
    exponential with mean H, the Hill estimate of the tail's scale from the `tail_rows` rows below the drop
    (Renyi's representation). So p = exp(-k ln(ratio) / H) x (the number of rows above `a_min`, the candidates),
    and the drop counts when p < `alpha` (measured: 0 to 7 % of pure-noise runs then accuse a row, against 50 %)."""
    x = np.sort(np.asarray(stat, dtype=np.float64))[::-1]
    n = min(max(1, x.size // MAX_SHARE), MAX_ROWS, max(x.size - 1, 0))
    best, at = 0.0, 0
    for k in range(1, n + 1):
        if x[k - 1] <= a_min:
            break
        ratio = x[k - 1] / x[k] if x[k] > 0 else np.inf
        if ratio > best:
            best, at = ratio, k
    if at == 0 or best < min_drop:
        return Drop(0, float(best), 1.0)
    below = x[at: at + tail_rows + 1]
    if below.size < 3 or below[-1] <= 0:  # too few rows, or the drop reaches the bulk: no tail to compare with
        return Drop(at, float(best), 0.0)
    hill = float(np.mean(np.log(below[:-1] / below[-1])))
    candidates = int((x > a_min).sum())
    p = min(1.0, float(np.exp(-at * np.log(best) / max(hill, 1e-12))) * max(candidates, 1))
    return Drop(at if p < alpha else 0, float(best), p)


@dataclass(frozen=True)
class Evidence:
    """Why one row is accused: the failing items it explains (eval positions, strongest first), its statistic and
    the threshold it passed, and its robust z on its strongest item."""

    position: int
    items: tuple[int, ...]
    statistic: float
    threshold: float
    item_z: float

    def to_report(self) -> dict:
        return {"position": self.position, "items": list(self.items), "statistic": round(self.statistic, 4),
                "threshold": round(self.threshold, 4), "item_z": round(self.item_z, 4)}


@dataclass(frozen=True)
class Accusation:
    """The accused rows (by decreasing statistic) with their evidence, and the rule in words."""

    evidence: tuple[Evidence, ...]
    threshold: Optional[float]  # what a row's statistic had to exceed (None: nobody could be)
    drop: Optional[Drop]  # the drop below the accused rows: its ratio and how likely it is among innocent rows
    capped: bool
    rule: str

    @property
    def positions(self) -> list[int]:
        return [e.position for e in self.evidence]

    @property
    def count(self) -> int:
        return len(self.evidence)

    def to_report(self) -> dict:
        out = {"count": self.count, "positions": self.positions, "z_threshold": A_MIN, "median": None,
               "scale": None, "capped_at_top_k": self.capped, "rule": self.rule,
               "evidence": [e.to_report() for e in self.evidence]}
        if self.threshold is not None:
            out["threshold"] = round(self.threshold, 4)
        if self.drop is not None and np.isfinite(self.drop.ratio):
            out["drop"] = round(self.drop.ratio, 4)
            out["drop_p"] = float(f"{self.drop.p:.3g}")
        return out


RULE = ("A row's statistic is its robust z-scores on the failing items it stands out on most, summed over the best "
        "set of items and divided by the square root of their number. Accused: the rows above the widest drop in "
        "that statistic among the rows above {a_min:g}, when the drop is at least {drop:g}x and less likely than "
        "{alpha:g} in a tail as heavy as the rows below it.")


def accuse(per_item: np.ndarray, items: Sequence[int], *, limit: Optional[int] = None) -> Accusation:
    """The accused rows of per-item ranking scores [Q, N] (`Scores.rank_item`: harm-signed, best window or
    exchange per item) of the failing `items` (their eval positions), at most `limit`; each item's z against its
    reference rows (`scoring.item_z`)."""
    z = item_z(np.asarray(per_item, dtype=np.float64))
    stat, k = scan(z)
    found = widest_drop(stat)
    count = found.count
    order = np.lexsort((np.arange(stat.size), -stat))
    rule = RULE.format(drop=MIN_DROP, a_min=A_MIN, alpha=ALPHA)
    if count == 0:
        return Accusation((), None, None, False, rule)
    below = float(stat[order[count]]) if count < stat.size else 0.0
    threshold = float(np.sqrt(stat[order[count - 1]] * max(below, 1e-12))) if below > 0 else float(A_MIN)
    capped = limit is not None and count > limit
    keep = order[: limit if capped else count]
    ev = []
    for p in keep.tolist():
        best = np.argsort(-z[:, p], kind="stable")[: int(k[p])]
        ev.append(Evidence(int(p), tuple(int(items[i]) for i in best), float(stat[p]), threshold,
                           float(z[best[0], p])))
    return Accusation(tuple(ev), threshold, found, capped, rule)


def nobody(reason: str) -> Accusation:
    """The accusation of a run that accuses nobody (declined, smoke test, flat scores)."""
    return Accusation((), None, None, False, reason)
