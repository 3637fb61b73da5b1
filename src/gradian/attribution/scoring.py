"""Scores: the sign convention, per-item normalisation and aggregation, in one place.

score(z) = -<q_hat, g_z>: the first-order change of the query loss caused by one SGD step on training row z
(theta' = theta - lr * g_z gives dL_q ~ -lr <g_q, g_z>), per unit of lr and unit query norm. A positive score means
training on z pushed the model toward the failure ("harmful", accused); a negative one means it pulled the model
toward the right answer ("helpful"). With the contrastive query L_q = loss(expected) - loss(generated wrong answer).
"""

from __future__ import annotations

import numpy as np

HARM_SIGN = -1.0


def unit_queries(q: np.ndarray) -> np.ndarray:
    """Each query gradient scaled to unit norm, so every failing item weighs the same in the average."""
    q = np.asarray(q, dtype=np.float32)
    norms = np.linalg.norm(q, axis=1, keepdims=True)
    return q / np.maximum(norms, 1e-30)


def harm_from_inner(inner: np.ndarray) -> np.ndarray:
    """Inner products <q_hat, g> [Q, N] -> harm scores."""
    return HARM_SIGN * inner


def aggregate(per_item: np.ndarray) -> np.ndarray:
    """Average the per-item score vectors (never the gradients: one large-norm item would dominate)."""
    return per_item.mean(axis=0) if per_item.shape[0] else np.zeros(per_item.shape[1], dtype=np.float32)


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
