"""EK-FAC's maths for one Linear module, pure functions over arrays: the Kronecker eigenbasis, the corrected
eigenvalues, the damping and the preconditioned query, and the dense matrix tests invert as the reference."""

from __future__ import annotations

import numpy as np

DEFAULT_DAMPING = 0.1  # x the mean corrected eigenvalue of each module: kronfluence's heuristic


def eigenbasis(cov: np.ndarray) -> np.ndarray:
    """Eigenvectors (columns) of a symmetric covariance, in float64. The eigenvalues are not kept: EK-FAC replaces
    them by the corrected ones, and the count a covariance is divided by does not change its eigenvectors."""
    c = np.asarray(cov, dtype=np.float64)
    _, v = np.linalg.eigh((c + c.T) / 2)
    return v


def rotate(G: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """left^T G right for G [..., m, n] (the module gradient in the Kronecker eigenbasis)."""
    return np.swapaxes(left, -1, -2) @ G @ right


def unrotate(R: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """left R right^T: back from the eigenbasis."""
    return left @ R @ np.swapaxes(right, -1, -2)


def corrected_eigenvalues(grads: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """(1/N) sum_n (left^T G_n right)^2 for per-example module gradients G [N, m, n] (reference, in memory)."""
    R = rotate(np.asarray(grads, dtype=np.float64), left, right)
    return np.square(R).mean(0)


def module_damping(lam: np.ndarray, damping: float) -> float:
    """delta = damping x mean corrected eigenvalue; 1 for a module without any gradient (nothing to divide)."""
    m = float(np.mean(lam)) if lam.size else 0.0
    return damping * m if m > 0 else 1.0


def precondition_module(G: np.ndarray, left: np.ndarray, right: np.ndarray, lam: np.ndarray, delta: float
                        ) -> np.ndarray:
    """Q_S ((Q_S^T G Q_C) / (Lambda + delta)) Q_C^T for query gradients G [Q, m, n]."""
    return unrotate(rotate(G, left, right) / (lam + delta), left, right)


def ekfac_dense(G: np.ndarray, a_cov: np.ndarray, g_cov: np.ndarray, damping: float = DEFAULT_DAMPING) -> np.ndarray:
    """Reference for one module: the dense EK-FAC matrix (Q (x) Q) diag(Lambda + delta) (Q (x) Q)^T over vec(dW)
    (row-major dW [m, n], m outputs, n inputs), from per-example gradients G [N, m, n] and the two covariances.
    Tests invert it with a dense solve and compare with `precondition_module`."""
    qs, qc = eigenbasis(g_cov), eigenbasis(a_cov)
    lam = corrected_eigenvalues(G, qs, qc)
    K = np.kron(qs, qc)  # vec_row(Q_S R Q_C^T) = (Q_S (x) Q_C) vec_row(R)
    return K @ np.diag((lam + module_damping(lam, damping)).ravel()) @ K.T
