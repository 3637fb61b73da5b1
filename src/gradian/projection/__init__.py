"""Stage 4b, projection: LoRA-aware projections that keep the rank side of each gradient exact and compress the wide
side (`projector.Projector`: data-aware by default, `random` kinds beside it)."""

from ..grads.layout import SiteShape
from .auto import AUTO_EXACT_MAX_BYTES, AUTO_EXACT_MAX_WIDTH, AUTO_WIDTH, ProjectionChoice, choose_projection
from .data_aware import BASIS_FILE, GRAM_MAX_D, STAGE2_WIDTH, Basis, BasisFitter, fit_basis
from .projector import DEFAULT_FIT_ROWS, KINDS, PROJECTION_VERSION, Projector, back_project
from .random import BLOCK_ROWS, SJLT_NNZ, SparseJL, random_matrix

__all__ = ["AUTO_EXACT_MAX_BYTES", "AUTO_EXACT_MAX_WIDTH", "AUTO_WIDTH", "BASIS_FILE", "ProjectionChoice",
           "choose_projection", "BLOCK_ROWS", "Basis", "BasisFitter", "DEFAULT_FIT_ROWS", "GRAM_MAX_D", "KINDS",
           "PROJECTION_VERSION", "Projector", "SJLT_NNZ", "STAGE2_WIDTH", "SiteShape", "SparseJL", "back_project",
           "fit_basis", "random_matrix"]
