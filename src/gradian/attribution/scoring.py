"""Scores: the sign convention, per-item normalisation and aggregation, in one place; pure functions over arrays.

score(z) = -<q_hat, g_z>: the first-order change of the query loss caused by one SGD step on training row z
(theta' = theta - lr * g_z gives dL_q ~ -lr <g_q, g_z>), per unit of lr and unit query norm. A positive score means
training on z pushed the model toward the failure ("harmful", accused); a negative one means it pulled the model
toward the right answer ("helpful"). With the contrastive query L_q = loss(expected) - loss(generated wrong answer).
For an improvement the scores are flipped (`direction_sign`), so they rank the rows that helped it.

`score` turns query gradients, training rows and a fitted preconditioner into a `Scores` (per-item scores [Q, N]
and the harm-signed directions that reproduce them, `per_item = w @ g`); `attribution.windows`,
`attribution.rerank` and `attribution.checkpoints` refine it, each from arrays alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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


def item_z(rank_item: np.ndarray) -> np.ndarray:
    """Each item's scores [Q, N] as robust z-scores against that item's own rows (`robust_z`: the median and
    1.4826 x MAD of the item's scores over every row), float64."""
    return np.stack([robust_z(r)[0] for r in np.asarray(rank_item)]) if len(rank_item) else \
        np.zeros((0, np.shape(rank_item)[1]))


def combine_items(rank_item: np.ndarray, how: str) -> np.ndarray:
    """A row's ranking score from its per-item scores [Q, N] (`attribution.combine`): the mean over items, or
    `max`: the item the row stands out on most, each item's scores in robust z units of that item's own rows.

    Why z and not the raw max: items differ in how widely the bulk of rows scatters around zero (a garbled answer's
    query aligns a little with everything), and the raw max over items is then won by the noisiest item's benign
    rows (measured on a 40-row SmolLM2 fact set: AUPRC 0.771 raw, 1.000 in z; Gemma-3's facts 0.679 and 0.950)."""
    return strongest_items(rank_item)[0] if how == "max" else aggregate(rank_item)


def strongest_items(rank_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's robust z on the item it stands out on most [N], that item's index [N]): `combine_items` max and
    the item whose best exchange names a conversation's `turn`, from one z computation."""
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


@dataclass(frozen=True)
class Scores:
    """Per-item scores of every training row and what reproduces them.

    Directions are harm-signed and include the per-item normalisation: a row's per-item score is <w_i, g_row> in
    index space, or, for a re-ranked candidate of a projected index, <r_i, g_row> (index space) + <e_i,
    g_row_exact> (parameter space), times the row's `row_scale` (1 / its norm) when rows are unit-normalised."""

    per_item: np.ndarray  # [Q, N] total scores (exact for re-ranked candidates)
    w: np.ndarray  # [Q, dim] index-space directions
    unit: np.ndarray  # [Q, dim] float32 unit (preconditioned) queries, what the index is scored against
    norms: np.ndarray  # [Q] norms of the (preconditioned) query gradients before the unit scaling
    precond: object  # the fitted `Preconditioner`
    rank_item: Optional[np.ndarray] = None  # [Q, N] scores the per-item rankings use (best window for long rows)
    rank_agg: Optional[np.ndarray] = None  # [N] the score the ranking uses
    order: Optional[np.ndarray] = None  # the ranking order when it is not rank(rank_agg) (exact re-ranking)
    fidelity: Optional[dict] = None  # projected-vs-exact self-check
    cand: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # re-ranked candidates
    r: Optional[np.ndarray] = None  # [Q, dim] index-space part of a candidate's exact score
    e: Optional[np.ndarray] = None  # [Q, D_exact] parameter-space part
    long_rows: list = field(default_factory=list)
    windows: dict = field(default_factory=dict)  # position -> {"tokens": (a, b), "score": best window (aggregate)}
    window_items: bool = False  # per-item window scores computed for every long row
    window_item_rows: list = field(default_factory=list)  # the long rows with per-item window scores
    # 1 / |g_z| per row (unit rows; exact for re-ranked candidates): a row's score is <w, g_z> * row_scale[z], and
    # its windows' and spans' contributions are scaled the same way. None: raw inner products.
    row_scale: Optional[np.ndarray] = None
    # conversations ranked by their best exchange (one pass, unit rows): position -> {"best": [Q] exchange index of
    # each item's best, "scores": [Q, U] each exchange's unit score}; `rank_item` holds the best, `per_item` the row
    turns: dict = field(default_factory=dict)

    def scale_of(self, p: int) -> float:
        return 1.0 if self.row_scale is None else float(self.row_scale[p])

    def with_scores(self, per_item: np.ndarray, rank_item: np.ndarray) -> "Scores":
        """These scores replaced (an average over checkpoints, the optimizer-aware scores): the ranking follows
        them, and an exact re-rank's order of the old ones is dropped."""
        return replace(self, per_item=per_item, rank_item=rank_item, rank_agg=aggregate(rank_item), order=None)


def row_scales(rows, preconditioner) -> np.ndarray:
    """1 / |g_z| of every row in the preconditioner's metric (`Preconditioner.metric_weights`); 0 for a zero row.

    Why unit rows (a cosine in the preconditioner's metric) are the default: on real pretrained models raw inner
    products rank rows by the size of their gradient, so high-loss, long or chatty rows dominate, and a row the
    fine-tune memorised (the planted fact it learned) has a small gradient at the final adapter whatever it caused.
    Measured on SmolLM2-135M-Instruct's planted facts at the final adapter: AUPRC 0.84 with raw preconditioned
    inner products, 1.00 with unit rows (bench/README.md)."""
    norms = rows.row_norms(preconditioner.metric_weights())
    return np.where(norms > 0, 1.0 / np.maximum(norms, 1e-300), 0.0)


def score(queries: np.ndarray, rows, preconditioner, direction: str, *, unit_rows: bool = True) -> Scores:
    """Per-item scores of every row for each query gradient (float32 [Q, dim] in the rows' space), through a fitted
    preconditioner (q <- H^-1 q, then unit norm), each row scaled to unit norm in the preconditioner's metric
    unless `unit_rows` is false. `rows` is a `store.rows.RowSource` (its `inner` is the one matmul against the
    index)."""
    q = np.asarray(queries)
    if preconditioner.is_identity:
        unit = unit_queries(q)
        norms = np.linalg.norm(q.astype(np.float32), axis=1)
    else:
        qp = preconditioner.apply(q)
        norms = np.linalg.norm(qp, axis=1)
        unit = unit_queries(qp)
    scale = row_scales(rows, preconditioner) if unit_rows else None
    return score_directions(unit, norms, rows, preconditioner, direction, scale)


def score_directions(unit: np.ndarray, norms: np.ndarray, rows, preconditioner, direction: str,
                     row_scale: Optional[np.ndarray] = None) -> Scores:
    """`score` from queries already preconditioned and scaled: `unit` [Q, dim] in the rows' space (float32), the
    norms [Q] they were scaled by. A preconditioner that works in parameter space (EK-FAC) preconditions the exact
    query, projects it and scales it by the exact norm, so projected and exact scores share one scale."""
    unit = np.asarray(unit, dtype=np.float32)
    per_item = item_scores(rows.inner(unit), direction)
    if row_scale is not None:
        per_item = (per_item * row_scale[None, :]).astype(per_item.dtype)
    return Scores(per_item=per_item, w=harm_directions(unit, direction), unit=unit, norms=norms,
                  precond=preconditioner, rank_item=per_item, rank_agg=aggregate(per_item),
                  row_scale=None if row_scale is None else np.asarray(row_scale, dtype=np.float64))
