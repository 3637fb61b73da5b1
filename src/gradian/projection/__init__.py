"""Stage 4b, projection: LoRA-aware projections that keep the rank side of each gradient exact and compress the wide
side (`projector.Projector`: data-aware by default, `random` kinds beside it)."""

from .data_aware import BASIS_FILE, Basis, BasisFitter, fit_basis
from .projector import DEFAULT_FIT_ROWS, KINDS, PROJECTION_VERSION, Projector, back_project
from .random import SparseJL, random_matrix
from ..grads.layout import SiteShape

__all__ = ["BASIS_FILE", "Basis", "BasisFitter", "DEFAULT_FIT_ROWS", "KINDS", "PROJECTION_VERSION", "Projector",
           "SiteShape", "SparseJL", "back_project", "fit_basis", "random_matrix"]
