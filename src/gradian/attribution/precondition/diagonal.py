"""``diagonal``: H = diag(m) + lambda I, m_j = (1/N) sum_i g_ij^2 (the per-coordinate second moment; Adam's view),
lambda = damping x mean(m) over the whole index (a per-block mean over-damps the blocks with large gradients)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...config import PreconditionerKind
from ...grads.layout import block_slices
from .rows import RowPreconditioner


class DiagonalPreconditioner(RowPreconditioner, kind=PreconditionerKind.diagonal):
    default_damping = 0.1
    default_scope = "global"
    storable = True

    def apply(self, Q: np.ndarray) -> np.ndarray:
        Q = self._fitted_query(Q)
        out = np.empty_like(Q)
        for b, s in enumerate(block_slices(self.block_dims)):
            out[:, s] = Q[:, s] / (self.second_moment[s] + self.lambdas[b])
        return out

    def metric_weights(self) -> Optional[np.ndarray]:
        """The diagonal of H^-1, what rows are normalised in (`scoring.row_scales`): |g|_H^-1 = sqrt(sum_j g_j^2 /
        (m_j + lambda)). (The other kinds normalise in the Euclidean metric: a full or low-rank H^-1 per row would
        cost a solve per row.)"""
        if self.second_moment is None:
            return None
        w = np.empty(sum(self.block_dims))
        for b, s in enumerate(block_slices(self.block_dims)):
            w[s] = 1.0 / (self.second_moment[s] + self.lambdas[b])
        return w
