"""Projected-vs-exact agreement of scores, and the exact re-ranking of projected candidates (pure functions)."""

from __future__ import annotations

import numpy as np
from scipy.stats import pearsonr, spearmanr

from .scoring import rank


def topk_recall(exact: np.ndarray, approx: np.ndarray, k: int) -> float:
    k = min(k, exact.size)
    return len(set(rank(exact, k).tolist()) & set(rank(approx, k).tolist())) / k


def spearman_within_top(exact: np.ndarray, approx: np.ndarray, frac: float = 0.05, min_rows: int = 10) -> float:
    """Rank agreement among the rows that matter: the exact top `frac` (at least `min_rows` rows)."""
    k = min(exact.size, max(min_rows, int(np.ceil(frac * exact.size))))
    top = rank(exact, k)
    return float(spearmanr(exact[top], approx[top]).statistic)


def agreement(exact: np.ndarray, approx: np.ndarray) -> dict:
    """Mean over queries (rows of [Q, N]) of each figure."""
    exact, approx = np.atleast_2d(exact), np.atleast_2d(approx)
    figs = {"top10_recall": [], "top50_recall": [], "spearman_top5pct": [], "pearson": [], "spearman": []}
    for e, a in zip(exact, approx):
        figs["top10_recall"].append(topk_recall(e, a, 10))
        figs["top50_recall"].append(topk_recall(e, a, 50))
        figs["spearman_top5pct"].append(spearman_within_top(e, a))
        figs["pearson"].append(float(pearsonr(e, a).statistic))
        figs["spearman"].append(float(spearmanr(e, a).statistic))
    return {k: float(np.nanmean(v)) for k, v in figs.items()}


def rerank_order(approx: np.ndarray, candidates: np.ndarray, exact_candidate_scores: np.ndarray) -> np.ndarray:
    """Candidates first, ordered by their exact scores; every other row after them by its approximate score."""
    cand_order = candidates[np.lexsort((candidates, -exact_candidate_scores))]
    rest = np.setdiff1d(rank(approx), candidates, assume_unique=False)
    rest = rest[np.lexsort((rest, -approx[rest]))]
    return np.concatenate([cand_order, rest])


def order_scores(order: np.ndarray) -> np.ndarray:
    """Pseudo-scores whose descending order is `order` (for rank-based agreement figures)."""
    out = np.empty(order.size, dtype=np.float64)
    out[order] = -np.arange(order.size, dtype=np.float64)
    return out
