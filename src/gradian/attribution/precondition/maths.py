"""The reference maths of the preconditioners fitted on index rows, over in-memory gradients G [N, D] of one block
(tests and benchmarks check the streamed classes against these)."""

from __future__ import annotations

import numpy as np


def mean_eigenvalue(G: np.ndarray) -> float:
    """tr((1/N) G^T G) / D: the mean eigenvalue of the empirical Fisher of the rows of G."""
    n, d = G.shape
    return float(np.square(G, dtype=np.float64).sum() / max(n * d, 1))


def diagonal_inverse(q: np.ndarray, second_moment: np.ndarray, lam: float) -> np.ndarray:
    """q / (m + lambda), per coordinate."""
    return np.asarray(q, dtype=np.float64) / (np.asarray(second_moment, dtype=np.float64) + lam)


def fisher_inverse_dense(q: np.ndarray, G: np.ndarray, lam: float) -> np.ndarray:
    """Reference: (G^T G / N + lambda I)^-1 q by a dense solve (q: [D] or [Q, D])."""
    G = np.asarray(G, dtype=np.float64)
    n, d = G.shape
    H = G.T @ G / n + lam * np.eye(d)
    return np.linalg.solve(H, np.asarray(q, dtype=np.float64).T).T


def fisher_inverse_woodbury(q: np.ndarray, G: np.ndarray, lam: float) -> np.ndarray:
    """(G^T G / N + lambda I)^-1 q through the N x N kernel: (q - G^T (N lambda I + G G^T)^-1 G q) / lambda."""
    G = np.asarray(G, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    n = G.shape[0]
    K = G @ G.T
    alpha = np.linalg.solve(K + n * lam * np.eye(n), G @ q.T)
    return (q - (G.T @ alpha).T) / lam


def datainf_inverse(q: np.ndarray, G: np.ndarray, lam: float) -> np.ndarray:
    """DataInf: (1 / (N lambda)) sum_i (q - <q, g_i> / (lambda + ||g_i||^2) g_i)."""
    G = np.asarray(G, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    n = G.shape[0]
    c = (q @ G.T) / (lam + np.square(G).sum(1))  # [Q, N] (or [N])
    return (q - (c @ G) / n) / lam
