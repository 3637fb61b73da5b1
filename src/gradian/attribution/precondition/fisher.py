"""``fisher``: H = F + lambda I, F = (1/N) G^T G per block (the damped empirical Fisher), exact.

A block no wider than the number of rows (D_b <= N) is eigendecomposed in its D_b x D_b Gram ("primal"); a wider
one goes through Woodbury in the N-dimensional row space, H^-1 q = (q - G^T (N lambda I + G G^T)^-1 G q) / lambda,
which needs only the N x N kernel G G^T, built from pairs of row chunks in groups of blocks that fit
`memory_bytes`. Damping is per block: lambda_b = damping x the mean of m over block b.
"""

from __future__ import annotations

import numpy as np

from ...config import PreconditionerKind
from ...store.rows import RowSource
from ...grads.layout import block_slices
from .rows import RowPreconditioner


def kernel_groups(blocks: list[int], n: int, memory_bytes: int) -> list[list[int]]:
    """Consecutive Woodbury blocks whose N x N float64 kernels fit `memory_bytes` together (at least one each)."""
    per = 8 * n * n
    group: list[int] = []
    groups = []
    for b in blocks:
        if group and per * (len(group) + 1) > memory_bytes:
            groups.append(group)
            group = []
        group.append(b)
    if group:
        groups.append(group)
    return groups


def block_kernels(source: RowSource, sl: list[slice], group: list[int]) -> dict[int, np.ndarray]:
    """K_b = G_b G_b^T [N, N] for each block b of `group`, from pairs of row chunks (each pair read once)."""
    n = source.n
    K = {b: np.zeros((n, n)) for b in group}
    bounds = source.bounds()
    for i, (a, bnd) in enumerate(bounds):
        Ri = source.read(a, bnd)
        for j, (c, d) in enumerate(bounds[: i + 1]):
            Rj = Ri if j == i else source.read(c, d)
            for b in group:
                blk = Ri[:, sl[b]] @ Rj[:, sl[b]].T
                K[b][a:bnd, c:d] = blk
                if j != i:
                    K[b][c:d, a:bnd] = blk.T
    return K


class FisherPreconditioner(RowPreconditioner, kind=PreconditionerKind.fisher):
    # 100 x the mean eigenvalue: a small lambda lets the inverse "explain" the query with the span of the well-fit
    # training rows, which divides away the very direction the planted rows share with the failure (the package
    # docstring has the figures; tests/test_precondition.py pins them).
    default_damping = 100.0
    default_scope = "block"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._primal: dict = {}  # block -> (eigvals, eigvecs) of F_b  (D_b <= N)
        self._kernel: dict = {}  # block -> (eigvals, eigvecs) of K_b = G_b G_b^T  (D_b > N)

    def _fit_more(self, source: RowSource, sl: list[slice]) -> None:
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
        for grp in kernel_groups(kernel, n, self.memory_bytes):
            K = block_kernels(source, sl, grp)
            for b in grp:
                w, v = np.linalg.eigh(K[b])
                self._kernel[b] = (np.clip(w, 0.0, None), v)
                del K[b]

    def apply(self, Q: np.ndarray) -> np.ndarray:
        Q = self._fitted_query(Q)
        sl = block_slices(self.block_dims)
        out = np.empty_like(Q)
        for b, (w, v) in self._primal.items():
            s, lam = sl[b], self.lambdas[b]
            out[:, s] = ((Q[:, s] @ v) / (w + lam)) @ v.T
        if self._kernel:
            self._apply_kernel(Q, out, sl)
        return out

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

    def _describe_more(self) -> dict:
        return {"solver": {"primal_blocks": len(self._primal), "woodbury_blocks": len(self._kernel)}}
