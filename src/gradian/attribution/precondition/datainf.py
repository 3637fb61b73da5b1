"""``datainf``: DataInf's closed form (Kwon et al. 2024): the inverse of each rank-one term, averaged,
H^-1 q ~ (1/N) sum_i (q - <q, g_i> / (lambda + ||g_i||^2) g_i) / lambda, one streaming pass per application."""

from __future__ import annotations

import numpy as np

from ...config import PreconditionerKind
from ...grads.layout import block_slices
from .rows import RowPreconditioner


class DataInfPreconditioner(RowPreconditioner, kind=PreconditionerKind.datainf):
    default_damping = 0.1  # x the mean eigenvalue per block: DataInf's own rule; its ranking barely depends on it
    default_scope = "block"

    def apply(self, Q: np.ndarray) -> np.ndarray:
        Q = self._fitted_query(Q)
        sl = block_slices(self.block_dims)
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
