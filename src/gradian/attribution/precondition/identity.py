"""``identity``: H = I. Queries are scored as they are; nothing is fitted."""

from __future__ import annotations

import numpy as np

from ...config import PreconditionerKind
from ...store.rows import RowSource
from .rows import DAMPING_RULE, RowPreconditioner


class IdentityPreconditioner(RowPreconditioner, kind=PreconditionerKind.identity):
    default_damping = 0.0
    default_scope = "global"
    is_identity = True
    storable = True

    def _fit_damping(self, source: RowSource) -> None:
        self.lambdas = np.ones(len(self.block_dims))  # nothing read from the rows

    @property
    def identity_scale(self) -> np.ndarray:
        return np.ones(len(self.block_dims or [0]))

    def apply(self, Q: np.ndarray) -> np.ndarray:
        return np.atleast_2d(np.asarray(Q, dtype=np.float64)).copy()

    def precondition_queries(self, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The queries as given (their float32 bits: the unit queries are those of the raw gradients)."""
        q = np.asarray(Q)
        return q, np.linalg.norm(q.astype(np.float32), axis=1)

    def describe(self) -> dict:
        return {"kind": self.kind.value, "damping": None, "damping_rule": DAMPING_RULE}
