"""The `Preconditioner` interface and the registry of kinds.

One class per `attribution.preconditioner` registers itself by subclassing `Preconditioner` with ``kind=...``.
Calling the base class, ``Preconditioner(kind, damping, block_dims, ...)``, builds the kind's class, unfitted
(`make_preconditioner`): the constructor callers have always used. What a caller needs to treat the kinds apart is a
property of the class: `is_identity` (H = I: the query is used as it is) and `parameter_space` (fitted from the
model and applied to exact parameter-space queries: EK-FAC), never a comparison of `kind`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Optional

import numpy as np

from ...config import PreconditionerKind
from ...kinds import BuildsItsKind

_CLASSES: dict[PreconditionerKind, type["Preconditioner"]] = {}


class Preconditioner(metaclass=BuildsItsKind):
    """q <- H^-1 q for the query side. `apply` maps query rows; `precondition_queries` also gives their norms (what
    scores are scaled by); `describe` is the report's entry."""

    kind: ClassVar[PreconditionerKind]
    default_damping: ClassVar[float]
    is_identity: ClassVar[bool] = False  # H = I: queries are scored as they are
    # Fitted from the model and applied to exact (parameter-space) query gradients, which are then projected into
    # the index's space (EK-FAC); otherwise fitted on the index rows and applied to index-space queries.
    parameter_space: ClassVar[bool] = False
    # What it applies is its `state()` alone (the diagonal, the identity), so a per-row store can keep it; the
    # others read their rows at every `apply` (Fisher's Woodbury kernel, DataInf) or an index's factors (EK-FAC).
    storable: ClassVar[bool] = False

    damping: Optional[float]

    def __init_subclass__(cls, kind: Optional[PreconditionerKind] = None, **kw):
        super().__init_subclass__(**kw)
        if kind is not None:
            cls.kind = kind
            _CLASSES[kind] = cls

    @staticmethod
    def _build_kind(*args, **kwargs) -> "Preconditioner":
        """``Preconditioner(...)`` itself (`kinds.BuildsItsKind`): `make_preconditioner`."""
        return make_preconditioner(*args, **kwargs)

    @classmethod
    @abstractmethod
    def create(cls, *, damping: Optional[float] = None, block_dims: Optional[list[int]] = None,
               **settings) -> "Preconditioner":
        """This kind, unfitted, from the settings every kind is given (`damping` relative, None: the kind's
        default; `block_dims` the index's per-site widths)."""

    @abstractmethod
    def apply(self, Q: np.ndarray) -> np.ndarray:
        """H^-1 q for each row of Q (float64 out)."""

    @abstractmethod
    def describe(self) -> dict:
        """What the report records about the fitted preconditioner."""

    def precondition_queries(self, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(H^-1 q for each row of Q, the norm of each): scores use the unit rows, scaled by these norms."""
        qp = self.apply(Q)
        return qp, np.linalg.norm(qp, axis=1)

    def metric_weights(self) -> Optional[np.ndarray]:
        """Per-coordinate weights of the metric rows are normalised in (None: Euclidean)."""
        return None


def preconditioner_class(kind: str) -> type[Preconditioner]:
    """The class of `attribution.preconditioner` `kind`; ValueError naming the known kinds when it is none."""
    try:
        return _CLASSES[PreconditionerKind(kind)]
    except (KeyError, ValueError):
        known = ", ".join(k.value for k in PreconditionerKind if k in _CLASSES)
        raise ValueError(f"attribution.preconditioner: unknown kind {kind!r}; known: {known}") from None


def make_preconditioner(kind: str = PreconditionerKind.identity, damping: Optional[float] = None,
                        block_dims: Optional[list[int]] = None, **settings) -> Preconditioner:
    """The preconditioner `kind`, unfitted (`settings`: what that kind takes, e.g. `memory_bytes`, `scope`)."""
    return preconditioner_class(kind).create(damping=damping, block_dims=block_dims, **settings)
