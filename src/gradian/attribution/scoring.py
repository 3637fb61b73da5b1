"""Scores: the sign convention, per-item normalisation and aggregation, in one place; pure functions over arrays.

score(z) = -<q_hat, g_z>: the first-order change of the query loss caused by one SGD step on training row z
(theta' = theta - lr * g_z gives dL_q ~ -lr <g_q, g_z>), per unit of lr and unit query norm. A positive score means
training on z pushed the model toward the failure ("harmful", accused); a negative one means it pulled the model
toward the right answer ("helpful"). With the contrastive query L_q = loss(expected) - loss(generated wrong answer).
For an improvement the scores are flipped (`direction_sign`), so they rank the rows that helped it.

`attribution.basis.score` turns query gradients, training rows and a fitted preconditioner into scores (the typed
values of `attribution.values`); `attribution.windows`, `attribution.rerank` and `attribution.states` refine them,
each from arrays alone.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

HARM_SIGN = -1.0


def direction_sign(direction: str) -> float:
    """+1 for a regression, -1 for an improvement: the sign that makes a positive score mean "caused the change"."""
    return -1.0 if direction == "improvement" else 1.0


def unit_queries(q: np.ndarray) -> np.ndarray:
    """Each query gradient scaled to unit norm, so every failing item weighs the same in the average."""
    q = np.asarray(q, dtype=np.float32)
    norms = np.linalg.norm(q, axis=1, keepdims=True)
    return q / np.maximum(norms, 1e-30)


def harm_from_inner(inner: np.ndarray) -> np.ndarray:
    """Inner products <q_hat, g> [Q, N] -> harm scores."""
    return HARM_SIGN * inner


def item_scores(inner: np.ndarray, direction: str) -> np.ndarray:
    """Per-item scores [Q, N] from the inner products of the unit (preconditioned) queries with the rows."""
    return direction_sign(direction) * harm_from_inner(inner)


def harm_factor(direction: str) -> float:
    """The factor from an inner product <q_hat, g> to a score: item_scores(x) = harm_factor * x."""
    return HARM_SIGN * direction_sign(direction)


def harm_directions(unit: np.ndarray, direction: str) -> np.ndarray:
    """The directions w [Q, dim] (float64) with item_scores(<unit, g>) = <w, g>."""
    return harm_factor(direction) * np.asarray(unit, dtype=np.float32).astype(np.float64)


def aggregate(per_item: np.ndarray) -> np.ndarray:
    """Average the per-item score vectors (never the gradients: one large-norm item would dominate)."""
    return per_item.mean(axis=0) if per_item.shape[0] else np.zeros(per_item.shape[1], dtype=np.float32)


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


# Each item's median and scale are measured on at most this many rows, a seeded sample beyond it
# (`reference_rows`). Why not every row: a later question reads most rows from the per-row store's sketches, whose
# errors there exceed the items' own scale (smol_mixed, 2,000 rows: error spread 1.2x the scale), so a scale taken
# out of sketched scores was off by up to 1.8x and moved 6 of the top 50. A sample the full pass and the shortlist
# share, scored exactly by both, gives both the same z. 256 rows measure a median and MAD to about 8%: AUPRC moved
# by at most 0.003 on the bench's 300-row scenarios, and from 0.574 to 0.551 on the 2,000-row smol_mixed
# (bench/README.md, "The second question, exact on each item's reference rows").
REFERENCE_ROWS = 256
REFERENCE_SEED = 0


def reference_rows(n: int) -> np.ndarray:
    """The rows (positions, sorted) each item's median and scale are measured on: all n up to `REFERENCE_ROWS`,
    else a sample of that many drawn with `REFERENCE_SEED` (a function of n alone, so every mode draws the same)."""
    if n <= REFERENCE_ROWS:
        return np.arange(n)
    return np.sort(np.random.default_rng(REFERENCE_SEED).choice(n, REFERENCE_ROWS, replace=False))


def item_z(rank_item: np.ndarray) -> np.ndarray:
    """Each item's scores [Q, N] as robust z-scores against that item's rows (`robust_z`: the median and 1.4826 x
    MAD of the item's scores over its `reference_rows`), float64."""
    return item_z_scales(rank_item)[0]


def item_z_scales(rank_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(`item_z`, each item's scale [Q])."""
    s = np.asarray(rank_item, dtype=np.float64)
    if not len(s):
        return np.zeros((0, s.shape[1])), np.zeros(0)
    ref = reference_rows(s.shape[1])
    z, scales = [], []
    for row in s:
        _, med, sc = robust_z(row[ref])  # every row up to REFERENCE_ROWS: robust_z(row) to the bit
        z.append((row - med) / sc if sc > 0 else np.zeros_like(row))
        scales.append(sc if sc > 0 else 1.0)
    return np.stack(z), np.asarray(scales)


def combine_items(rank_item: np.ndarray, how: str) -> np.ndarray:
    """A row's ranking score from its per-item scores [Q, N] (`attribution.combine`): the mean over items, or
    `max`: the item the row stands out on most, each item's scores in robust z units of that item's own rows.

    Why z and not the raw max: items differ in how widely the bulk of rows scatters around zero (a garbled answer's
    query aligns a little with everything), and the raw max over items is then won by the noisiest item's benign
    rows (measured on a 40-row SmolLM2 fact set: AUPRC 0.771 raw, 1.000 in z; Gemma-3's facts 0.679 and 0.950)."""
    return strongest_items(rank_item)[0] if how == "max" else aggregate(rank_item)


def strongest_items(rank_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's robust z on the item it stands out on most [N], that item's index [N]): `combine_items` max and
    the item whose best exchange names a conversation's `turn`, from one z computation (`item_z`)."""
    if not len(rank_item):
        n = np.shape(rank_item)[1]
        return np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.int64)
    z = item_z(rank_item)
    return z.max(axis=0), z.argmax(axis=0)


def resolve_combine(setting: str, own_words: Sequence[bool]) -> str:
    """`attribution.combine` as a run uses it: auto is max (`combine_items`) when every failing item's query is an
    own-words one and mean otherwise.

    Why (bench/README.md, "Rank by the strongest item"): an own-words item is one fact or one turn, taught by its
    own few rows; the mean over Q items divides such a row's score by Q while every benign row keeps its small
    alignment with all of them, so on a multi-turn set where five of six failing items are collateral damage the
    row that planted the sixth ranked 55th (the max: 1st). A behaviour's items are one class of answers with one
    cause, and there the mean averages each item's sampling noise away (the max lost a rank on a language switch)."""
    if setting != "auto":
        return setting
    flags = list(own_words)
    return "max" if flags and all(flags) else "mean"


def rank(scores: np.ndarray, k: int | None = None) -> np.ndarray:
    """Positions by decreasing score; ties broken by position so the order is deterministic."""
    order = np.lexsort((np.arange(scores.size), -scores))
    return order if k is None else order[:k]


def recall_at_k(scores: np.ndarray, planted: list[int], k: int) -> float:
    if not planted:
        return float("nan")
    top = set(rank(scores, k).tolist())
    return len(top & set(planted)) / min(k, len(planted))


def auprc(scores: np.ndarray, planted: list[int]) -> float:
    from sklearn.metrics import average_precision_score

    y = np.zeros(scores.size, dtype=int)
    y[list(planted)] = 1
    if y.sum() == 0:
        return float("nan")
    return float(average_precision_score(y, scores))


def degenerate(query_norms: np.ndarray, scores: Optional[np.ndarray]) -> Optional[tuple[str, str]]:
    """(flag id, reason) when scores cannot name a cause: every query gradient is zero (the two answers a query
    contrasts are the same tokens, or have none), or every row has the same score; None otherwise."""
    qn = np.asarray(query_norms, dtype=np.float64)
    if qn.size == 0 or not np.any(qn > 0):
        return ("attribution.zero_query", f"every failing item's query gradient is zero ({qn.size} item(s)): the "
                "answers each query contrasts do not differ in any supervised token, so no row can be scored")
    if scores is not None and (not np.all(np.isfinite(scores)) or float(np.ptp(scores)) == 0.0):
        return ("attribution.flat_scores", f"every training row has the same score ({float(scores.flat[0]):.3g}) "
                "or a score is not finite: the ranking would be arbitrary")
    return None


class Combined:
    """Each row's combined ranking score (`combine_items`) when each per-item score carries an error of spread
    `sigma` [Q, N] (0 for a score known exactly): the per-item terms the combination adds (mean: the score / Q) or
    takes the largest of (max: the score in robust z units of its item's reference rows, `item_z`: they must be
    exact),
    and their spreads in the same units. What a shortlist needs: the score, what a row could
    reach (`upper`), and the chance it exceeds a cut (`exceed`, the errors taken as normal)."""

    def __init__(self, rank_item: np.ndarray, sigma: np.ndarray, how: str):
        s = np.asarray(rank_item, dtype=np.float64)
        sigma = np.asarray(sigma, dtype=np.float64)
        self.how = how
        if how == "max":
            self.terms, scale = item_z_scales(s)
            unit = scale[:, None]
        else:
            unit = np.full((s.shape[0], 1), float(max(s.shape[0], 1)))
            self.terms = s / unit
        self.spread = np.asarray(sigma, dtype=np.float64) / unit

    @property
    def score(self) -> np.ndarray:
        if not len(self.terms):
            return np.zeros(self.terms.shape[1])
        return self.terms.max(0) if self.how == "max" else self.terms.sum(0)

    def upper(self, m: float) -> np.ndarray:
        """What each row's combined score reaches with every item's error `m` spreads in its favour."""
        if not len(self.terms):
            return np.zeros(self.terms.shape[1])
        if self.how == "max":
            return (self.terms + m * self.spread).max(0)
        return self.terms.sum(0) + m * self.spread.sum(0)

    def exceed(self, cut: float) -> np.ndarray:
        """P(a row's true combined score >= cut), its errors normal and (mean) fully correlated across items."""
        from scipy.special import ndtr

        if not len(self.terms):
            return np.zeros(self.terms.shape[1])
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.how == "max":
                below = np.where(self.spread > 0, ndtr((cut - self.terms) / self.spread),
                                 (self.terms < cut).astype(np.float64))
                return 1.0 - np.prod(below, axis=0)
            spread = self.spread.sum(0)
            score = self.terms.sum(0)
            return np.where(spread > 0, ndtr((score - cut) / np.where(spread > 0, spread, 1.0)),
                            (score >= cut).astype(np.float64))
