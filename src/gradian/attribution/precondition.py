"""Preconditioners for the query side: q <- H^-1 q, with H built from the training gradients in index space.

Every method is *per block*: the index vector is the concatenation of one block per LoRA site (widths in the index
meta's ``block_dims``), and H is block-diagonal, one damped matrix per site, as in EK-FAC/LoGra/DataInf. With the
N training gradients g_i of a block (rows of G, N x D_b):

* ``identity``  H = I.
* ``diagonal``  H = diag(m) + lambda I, m_j = (1/N) sum_i g_ij^2 (per-coordinate second moment; Adam's view).
* ``fisher``    H = F + lambda I, F = (1/N) G^T G (damped empirical Fisher). Exact: a D_b x D_b Cholesky solve when
  D_b <= N, else Woodbury in the N-dimensional row space,
  H^-1 q = (q - G^T (N lambda I + G G^T)^-1 G q) / lambda, which needs only the N x N kernel G G^T.
* ``datainf``   DataInf's closed form (Kwon et al. 2024): the inverse of each rank-one term, averaged,
  H^-1 q ~ (1/N) sum_i (q - <q, g_i> / (lambda + ||g_i||^2) g_i) / lambda, one streaming pass.

Damping ``lambda`` is relative to the mean eigenvalue of the second-moment matrix, tr(F) / D = the mean of m:
``diagonal`` takes it over the whole index (lambda = damping x mean(m); a per-block mean over-damps the blocks with
large gradients), ``fisher`` and ``datainf`` per block (lambda_b = damping x mean of m over block b; DataInf's own
rule is 0.1 x this). The defaults (`DEFAULT_DAMPING`) were chosen on the built-in scenarios (figures in
tests/test_precondition.py, which pins them): a small lambda lets the inverse "explain" the query with the span of
the well-fit training rows, which divides away exactly the direction the planted rows share with the failure
(with N << D_b, F has N non-zero eigenvalues, each about D_b / N times the mean, so 0.1 x mean is a nearly
unregularised pseudo-inverse on that span: recall@10 on the demo falls to 0.74 and AUPRC to 0.83, against 1.0 at the
default 100).

Statistics are streamed from the index in row chunks (`RowSource`); what is held is the per-block second moments
(D floats), the Fisher Gram matrices (min(N, D_b)^2 per block, processed in block groups that fit
`memory_bytes`), and the queries. Every method is linear in q, so scores against a preconditioned query stay
inner products, and ``identity_scale`` (1 / lambda_b per block) lets an exact re-rank correct the projection error of
the identity part (H^-1 = (I - M) / lambda with M the low-rank or diagonal part; see `attribution.rerank`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..grads.layout import block_slices
from ..store.rows import RowSource

KINDS = ("identity", "diagonal", "fisher", "datainf")
# Relative damping (x the mean eigenvalue, over the whole index for `diagonal`, per block for `fisher`/`datainf`)
# per method; chosen by the benchmark on the built-in scenarios (see the module docstring and
# tests/test_precondition.py). DataInf's 0.1 is its paper's rule; its ranking barely depends on it here.
DEFAULT_KIND = "diagonal"  # the benchmark's choice for attribution.preconditioner
DEFAULT_DAMPING = {"identity": 0.0, "diagonal": 0.1, "fisher": 100.0, "datainf": 0.1}
DEFAULT_SCOPE = {"identity": "global", "diagonal": "global", "fisher": "block", "datainf": "block"}
DEFAULT_MEMORY_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------ pure reference maths


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


# ------------------------------------------------------------------------------------------- preconditioner


@dataclass
class Preconditioner:
    """q <- H^-1 q per block; `fit` streams the statistics, `apply` the queries."""

    kind: str = "identity"
    damping: Optional[float] = None  # relative; None -> DEFAULT_DAMPING[kind]
    block_dims: Optional[list[int]] = None
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    scope: Optional[str] = None  # "global" | "block": what the mean eigenvalue of the damping rule is taken over
    n: int = 0
    second_moment: Optional[np.ndarray] = None  # [D]
    lambdas: Optional[np.ndarray] = None  # [B] absolute damping per block
    _primal: dict = field(default_factory=dict)  # block -> (eigvals, eigvecs) of F_b  (D_b <= N)
    _kernel: dict = field(default_factory=dict)  # block -> (eigvals, eigvecs) of K_b = G_b G_b^T  (D_b > N)
    _source: Optional[RowSource] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"attribution.preconditioner: unknown kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.damping is None:
            self.damping = DEFAULT_DAMPING[self.kind]
        if self.scope is None:
            self.scope = DEFAULT_SCOPE[self.kind]
        if self.scope not in ("global", "block"):
            raise ValueError(f"damping scope must be 'global' or 'block', got {self.scope!r}")

    # ---------------------------------------------------------------------------------------------- fitting

    def fit(self, source: RowSource) -> "Preconditioner":
        self._source = source
        self.n = source.n
        dims = self.block_dims or [source.dim]
        if sum(dims) != source.dim:
            raise ValueError(f"block_dims sum to {sum(dims)}, the index has dim {source.dim}")
        self.block_dims = list(map(int, dims))
        if self.kind == "identity":
            self.lambdas = np.ones(len(dims))
            return self
        sl = block_slices(self.block_dims)
        m = source.sum_chunks(lambda rows: np.square(rows).sum(0), np.zeros(source.dim))
        m /= max(source.n, 1)
        self.second_moment = m
        means = np.array([m[s].mean() if s.stop > s.start else 0.0 for s in sl])
        if self.scope == "global":
            means = np.full(len(sl), m.mean() if m.size else 0.0)
        # A block with no gradient at all (mean 0) gets damping 1: H = I there, nothing to divide by.
        self.lambdas = np.where(means > 0, float(self.damping) * means, 1.0)
        if self.kind == "fisher":
            self._fit_fisher(source, sl)
        return self

    def _fit_fisher(self, source: RowSource, sl: list[slice]) -> None:
        n = source.n
        primal = [b for b, s in enumerate(sl) if (s.stop - s.start) <= n]
        kernel = [b for b, s in enumerate(sl) if (s.stop - s.start) > n]
        if primal:
            grams = {b: np.zeros((sl[b].stop - sl[b].start,) * 2) for b in primal}
            for _, _, rows in source.chunks():
                for b in primal:
                    x = rows[:, sl[b]]
                    grams[b] += x.T @ x
            for b in primal:
                w, v = np.linalg.eigh(grams[b] / max(n, 1))
                self._primal[b] = (np.clip(w, 0.0, None), v)
        # Kernel blocks: N x N Gram per block, in groups that fit the memory budget, from pairs of row chunks.
        per = 8 * n * n
        group: list[int] = []
        groups = []
        for b in kernel:
            if group and per * (len(group) + 1) > self.memory_bytes:
                groups.append(group)
                group = []
            group.append(b)
        if group:
            groups.append(group)
        bounds = source.bounds()
        for grp in groups:
            K = {b: np.zeros((n, n)) for b in grp}
            for i, (a, bnd) in enumerate(bounds):
                Ri = source.read(a, bnd)
                for j, (c, d) in enumerate(bounds[: i + 1]):
                    Rj = Ri if j == i else source.read(c, d)
                    for b in grp:
                        blk = Ri[:, sl[b]] @ Rj[:, sl[b]].T
                        K[b][a:bnd, c:d] = blk
                        if j != i:
                            K[b][c:d, a:bnd] = blk.T
            for b in grp:
                w, v = np.linalg.eigh(K[b])
                self._kernel[b] = (np.clip(w, 0.0, None), v)
                del K[b]

    # --------------------------------------------------------------------------------------------- applying

    @property
    def identity_scale(self) -> np.ndarray:
        """Per block 1 / lambda_b: H^-1 = (I - M_b) / lambda_b with M_b the low-rank/diagonal part (identity: 1)."""
        if self.kind == "identity":
            return np.ones(len(self.block_dims or [0]))
        return 1.0 / self.lambdas

    def apply(self, Q: np.ndarray) -> np.ndarray:
        """H^-1 q for each row of Q [Q, D] (float64 out)."""
        Q = np.atleast_2d(np.asarray(Q, dtype=np.float64))
        if self.kind == "identity":
            return Q.copy()
        if self.lambdas is None:
            raise RuntimeError("Preconditioner.apply before fit")
        sl = block_slices(self.block_dims)
        out = np.empty_like(Q)
        if self.kind == "diagonal":
            for b, s in enumerate(sl):
                out[:, s] = Q[:, s] / (self.second_moment[s] + self.lambdas[b])
            return out
        if self.kind == "fisher":
            for b, (w, v) in self._primal.items():
                s, lam = sl[b], self.lambdas[b]
                out[:, s] = ((Q[:, s] @ v) / (w + lam)) @ v.T
            if self._kernel:
                self._apply_kernel(Q, out, sl)
            return out
        return self._apply_datainf(Q, sl)

    def _apply_kernel(self, Q: np.ndarray, out: np.ndarray, sl: list[slice]) -> None:
        src, n = self._source, self.n
        blocks = sorted(self._kernel)
        Gq = {b: np.zeros((n, Q.shape[0])) for b in blocks}
        for a, bnd, rows in src.chunks():
            for b in blocks:
                Gq[b][a:bnd] = rows[:, sl[b]] @ Q[:, sl[b]].T
        alpha = {}
        for b in blocks:
            w, v = self._kernel[b]
            alpha[b] = v @ ((v.T @ Gq[b]) / (w + n * self.lambdas[b])[:, None])  # (K + N lambda I)^-1 G q
        acc = {b: np.zeros((Q.shape[0], sl[b].stop - sl[b].start)) for b in blocks}
        for a, bnd, rows in src.chunks():
            for b in blocks:
                acc[b] += alpha[b][a:bnd].T @ rows[:, sl[b]]
        for b in blocks:
            out[:, sl[b]] = (Q[:, sl[b]] - acc[b]) / self.lambdas[b]

    def _apply_datainf(self, Q: np.ndarray, sl: list[slice]) -> np.ndarray:
        acc = np.zeros_like(Q)
        for _, _, rows in self._source.chunks():
            for b, s in enumerate(sl):
                g = rows[:, s]
                c = (Q[:, s] @ g.T) / (self.lambdas[b] + np.square(g).sum(1))  # [Q, rows]
                acc[:, s] += c @ g
        out = np.empty_like(Q)
        for b, s in enumerate(sl):
            out[:, s] = (Q[:, s] - acc[:, s] / max(self.n, 1)) / self.lambdas[b]
        return out

    def metric_weights(self) -> Optional[np.ndarray]:
        """Per-coordinate weights of the metric rows are normalised in (`scoring.row_scales`): the diagonal of H^-1
        for `diagonal` (|g|_H^-1 = sqrt(sum_j g_j^2 / (m_j + lambda))), None (Euclidean) for the others (a full or
        low-rank H^-1 per row would cost a solve per row)."""
        if self.kind != "diagonal" or self.second_moment is None:
            return None
        w = np.empty(sum(self.block_dims))
        for b, s in enumerate(block_slices(self.block_dims)):
            w[s] = 1.0 / (self.second_moment[s] + self.lambdas[b])
        return w

    def describe(self) -> dict:
        d = {"kind": self.kind, "damping": None if self.kind == "identity" else float(self.damping),
             "damping_rule": "lambda_b = damping x mean eigenvalue (tr F_b / D_b) of each LoRA-site block"}
        if self.kind == "fisher":
            d["solver"] = {"primal_blocks": len(self._primal), "woodbury_blocks": len(self._kernel)}
        if self.lambdas is not None and self.kind != "identity":
            d["lambda_range"] = [float(self.lambdas.min()), float(self.lambdas.max())]
        return d


def precondition(Q: np.ndarray, G: np.ndarray, kind: str, *, damping: Optional[float] = None,
                 block_dims: Optional[Sequence[int]] = None) -> np.ndarray:
    """One-shot helper over in-memory gradients G [N, D] (tests, benchmarks)."""
    p = Preconditioner(kind, damping, list(block_dims) if block_dims is not None else None)
    p.fit(RowSource(np.asarray(G)))
    return p.apply(Q)
