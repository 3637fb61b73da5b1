"""`attribution.preconditioner: ekfac`: the fitted factors applied to exact (parameter-space) query gradients."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ....config import PreconditionerKind
from ....grads.layout import SiteShape, exact_widths, split_directions
from ..base import Preconditioner
from .cache import load_or_fit_factors
from .factors import DEFAULT_MEMORY_BYTES, SIDES, FactorStore
from .maths import DEFAULT_DAMPING, module_damping, precondition_module

DAMPING_RULE = ("per LoRA module (the A and the B of each site): delta = damping x the mean corrected eigenvalue of "
                "that module (kronfluence's heuristic)")


@dataclass
class EkfacPreconditioner(Preconditioner, kind=PreconditionerKind.ekfac):
    """EK-FAC, fitted (`fit_or_load`, or `fit_model` on one `create`d unfitted): `apply` preconditions exact
    queries, `to_index` projects them into the index's space."""

    store: Optional[FactorStore]
    damping: float = DEFAULT_DAMPING
    info: dict = field(default_factory=dict)  # how the factors were obtained (cache, passes, correction source)

    default_damping = DEFAULT_DAMPING
    parameter_space = True

    @classmethod
    def create(cls, *, damping: Optional[float] = None, block_dims: Optional[list[int]] = None,
               **settings) -> "EkfacPreconditioner":
        """Unfitted: `fit_model` fits it (the index's block widths do not apply: EK-FAC works per module)."""
        return cls(None, DEFAULT_DAMPING if damping is None else float(damping))

    def fit_model(self, grads, rows=None, *, root: Optional[Path] = None,
                  memory_bytes: int = DEFAULT_MEMORY_BYTES) -> "EkfacPreconditioner":
        """Fit (or load from `root`) the factors of `grads`' adapter over its training rows (`load_or_fit_factors`)."""
        self.store, self.info = load_or_fit_factors(grads, rows, root=root, memory_bytes=memory_bytes)
        return self

    @property
    def sites(self) -> list[SiteShape]:
        return self.store.sites

    def deltas(self) -> dict:
        return {(i, sd): module_damping(self.store.lam(i, sd), self.damping)
                for i in range(len(self.sites)) for sd in SIDES}

    def apply(self, Q: np.ndarray) -> np.ndarray:
        """H^-1 q for each exact query row of Q [Q, D_exact] (float64 out), site by site, module by module."""
        Q = np.atleast_2d(np.asarray(Q, dtype=np.float64))
        if self.store is None:
            raise RuntimeError("Preconditioner.apply before fit")
        widths = exact_widths(self.sites)
        if Q.shape[1] != sum(widths):
            raise ValueError(f"ekfac: queries are {Q.shape[1]} wide, the sites' exact width is {sum(widths)}")
        out = np.empty_like(Q)
        deltas = self.deltas()
        a = 0
        for i, s in enumerate(self.sites):
            na, nb = s.r * s.d_in, s.d_out * s.r
            for sd, (lo, m, n) in (("A", (a, s.r, s.d_in)), ("B", (a + na, s.d_out, s.r))):
                f = self.store.module(i, sd)
                G = Q[:, lo : lo + m * n].reshape(-1, m, n)
                P = precondition_module(G, f.left.astype(np.float64), f.right.astype(np.float64), f.lam,
                                        deltas[(i, sd)])
                out[:, lo : lo + m * n] = P.reshape(Q.shape[0], -1)
            a += na + nb
        return out

    def to_index(self, X: np.ndarray, projector) -> np.ndarray:
        """Exact directions [K, D_exact] -> the index's space with its projector (the identity when exact)."""
        X = np.atleast_2d(np.asarray(X, dtype=np.float64))
        if projector.exact:
            return X
        import torch

        parts = [projector.project(i, dA, dB) for i, (dA, dB) in enumerate(split_directions(self.sites, X))]
        return torch.cat(parts, dim=1).double().numpy()

    def describe(self) -> dict:
        lams = [d for d in self.deltas().values()]
        return {"kind": self.kind.value, "damping": float(self.damping), "damping_rule": DAMPING_RULE,
                "lambda_range": [float(min(lams)), float(max(lams))] if lams else [0.0, 0.0],
                "factors": dict(self.info)}


def fit_or_load(grads, rows, *, damping: Optional[float], root: Optional[Path] = None,
                memory_bytes: int = DEFAULT_MEMORY_BYTES) -> EkfacPreconditioner:
    """The EK-FAC preconditioner of `grads`' adapter (an `engine.ModelGradients`) over its training rows, its factors
    loaded from `root` (the index directory) or fitted and stored there (`cache.load_or_fit_factors`)."""
    return EkfacPreconditioner.create(damping=damping).fit_model(grads, rows, root=root, memory_bytes=memory_bytes)
