"""What the preconditioners fitted on the index rows share: per-block damping from the streamed second moment.

The index vector is the concatenation of one block per LoRA site (`block_dims`); H is block-diagonal. `fit` streams
the rows once for the per-coordinate second moment m (what `diagonal` inverts and the damping of every kind is
relative to: lambda = damping x the mean of m, over the whole index or per block by `scope`), then hands the rows
to the kind's own statistics (`_fit_more`: the Fisher's Gram matrices).
"""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

import numpy as np

from ...grads.layout import block_slices
from ...store.rows import RowSource
from .base import Preconditioner, make_preconditioner

DEFAULT_MEMORY_BYTES = 1 << 30
SCOPES = ("global", "block")
DAMPING_RULE = "lambda_b = damping x mean eigenvalue (tr F_b / D_b) of each LoRA-site block"


class RowPreconditioner(Preconditioner):
    """A preconditioner fitted on the index rows (`fit(RowSource)`), applied per block to index-space queries."""

    default_scope: ClassVar[str]  # "global" | "block": what the mean eigenvalue of the damping rule is taken over

    def __init__(self, damping: Optional[float] = None, block_dims: Optional[list[int]] = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, scope: Optional[str] = None):
        self.damping = self.default_damping if damping is None else damping  # relative
        self.block_dims = block_dims
        self.memory_bytes = memory_bytes
        self.scope = self.default_scope if scope is None else scope
        if self.scope not in SCOPES:
            raise ValueError(f"damping scope must be 'global' or 'block', got {self.scope!r}")
        self.n = 0
        self.second_moment: Optional[np.ndarray] = None  # [D]
        self.lambdas: Optional[np.ndarray] = None  # [B] absolute damping per block
        self._source: Optional[RowSource] = None

    @classmethod
    def create(cls, *, damping: Optional[float] = None, block_dims: Optional[list[int]] = None,
               memory_bytes: int = DEFAULT_MEMORY_BYTES, scope: Optional[str] = None) -> "RowPreconditioner":
        return cls(damping, block_dims, memory_bytes, scope)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(damping={self.damping!r}, block_dims={self.block_dims!r}, "
                f"scope={self.scope!r}, n={self.n})")

    # ---------------------------------------------------------------------------------------------- fitting

    def fit(self, source: RowSource) -> "RowPreconditioner":
        self._source = source
        self.n = source.n
        dims = self.block_dims or [source.dim]
        if sum(dims) != source.dim:
            raise ValueError(f"block_dims sum to {sum(dims)}, the index has dim {source.dim}")
        self.block_dims = list(map(int, dims))
        self._fit_damping(source)
        return self

    def _fit_damping(self, source: RowSource) -> None:
        """The second moment and the absolute damping per block; then the kind's own statistics."""
        sl = block_slices(self.block_dims)
        m = source.sum_chunks(lambda rows: np.square(rows).sum(0), np.zeros(source.dim))
        m /= max(source.n, 1)
        self.second_moment = m
        means = np.array([m[s].mean() if s.stop > s.start else 0.0 for s in sl])
        if self.scope == "global":
            means = np.full(len(sl), m.mean() if m.size else 0.0)
        # A block with no gradient at all (mean 0) gets damping 1: H = I there, nothing to divide by.
        self.lambdas = np.where(means > 0, float(self.damping) * means, 1.0)
        self._fit_more(source, sl)

    def _fit_more(self, source: RowSource, sl: list[slice]) -> None:
        """Statistics beyond the second moment (none by default)."""

    # --------------------------------------------------------------------------------------------- applying

    @property
    def identity_scale(self) -> np.ndarray:
        """Per block 1 / lambda_b: H^-1 = (I - M_b) / lambda_b with M_b the low-rank/diagonal part (identity: 1)."""
        return 1.0 / self.lambdas

    def _fitted_query(self, Q: np.ndarray) -> np.ndarray:
        """Q as float64 rows [Q, D], once the preconditioner is fitted."""
        Q = np.atleast_2d(np.asarray(Q, dtype=np.float64))
        if self.lambdas is None:
            raise RuntimeError("Preconditioner.apply before fit")
        return Q

    def describe(self) -> dict:
        d = {"kind": self.kind.value, "damping": float(self.damping), "damping_rule": DAMPING_RULE}
        d.update(self._describe_more())
        if self.lambdas is not None:
            d["lambda_range"] = [float(self.lambdas.min()), float(self.lambdas.max())]
        return d

    def _describe_more(self) -> dict:
        """Entries of `describe` beyond kind and damping, before the lambda range (none by default)."""
        return {}

    def state(self) -> dict:
        """What `restore` needs to rebuild this fitted preconditioner (arrays; a storable kind's whole state)."""
        none = np.zeros(0)
        return {"kind": np.array(self.kind.value), "damping": np.array(float(self.damping)),
                "scope": np.array(self.scope), "block_dims": np.asarray(self.block_dims, dtype=np.int64),
                "n": np.array(int(self.n)), "memory_bytes": np.array(int(self.memory_bytes)),
                "second_moment": none if self.second_moment is None else self.second_moment,
                "lambdas": none if self.lambdas is None else self.lambdas}


def restore(state: dict) -> RowPreconditioner:
    """The fitted preconditioner `RowPreconditioner.state` describes (a storable kind: the diagonal, the identity)."""
    p = make_preconditioner(str(state["kind"]), float(state["damping"]), [int(x) for x in state["block_dims"]],
                            memory_bytes=int(state["memory_bytes"]), scope=str(state["scope"]))
    if not p.storable:
        raise ValueError(f"a {p.kind.value} preconditioner cannot be restored from its state")
    p.n = int(state["n"])
    p.second_moment = np.asarray(state["second_moment"], dtype=np.float64) if state["second_moment"].size else None
    p.lambdas = np.asarray(state["lambdas"], dtype=np.float64) if state["lambdas"].size else None
    return p


def precondition(Q: np.ndarray, G: np.ndarray, kind: str, *, damping: Optional[float] = None,
                 block_dims: Optional[Sequence[int]] = None) -> np.ndarray:
    """One-shot helper over in-memory gradients G [N, D] (tests, benchmarks)."""
    p = make_preconditioner(kind, damping, list(block_dims) if block_dims is not None else None)
    p.fit(RowSource(np.asarray(G)))
    return p.apply(Q)
