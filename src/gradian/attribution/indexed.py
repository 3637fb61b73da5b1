"""Rows read from a gradient index (`store.build.OpenIndex`): the row source when the exact index is small enough to
keep (`grads.projection_dim: auto` on small widths), when EK-FAC's factors are fitted over one, or when an integer
`grads.projection_dim` asks for a projected index.

`score_index` runs the steps in order: preconditioned scores (`basis.score`, EK-FAC in parameter space), the best
windows of every long row (`windows.EveryLongRow`) and, for a projected index, the top `settings.rerank` rows
re-scored exactly and a sample of rows measuring projected-vs-exact agreement (`rerank`).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..store.rows import RowSource
from . import ekfac
from . import rerank as rr
from . import windows as win
from .basis import fit_preconditioner, inverse_norms, score, score_directions
from .directions import BackProjected, HarmDirections
from .engine import ModelGradients, ScoringSettings, scaled_contributions
from .precondition import preconditioner_class
from .values import Scored


def score_index(grads: ModelGradients, rows: RowSource, qitems, settings: ScoringSettings, *,
                block_dims: Optional[list[int]] = None) -> Scored:
    """Per-item scores [Q, N] of every row, with the best windows of long rows and, for a projected index, the top
    `settings.rerank` rows re-scored exactly and a sample of rows measuring projected-vs-exact agreement."""
    t0 = time.time()
    projector = grads.capture.projector
    q_ex = None
    if preconditioner_class(settings.preconditioner).parameter_space:
        st, q, q_ex = _ekfac_scores(grads, rows, qitems, settings)
    else:
        q = grads.query_vectors(qitems)
        pre = fit_preconditioner(settings.preconditioner, settings.damping, rows, block_dims)
        st = score(q, rows, pre, settings.direction, unit_rows=settings.unit_rows)
    grads.timings["precondition"] = round(time.time() - t0, 3)
    if settings.windows:
        skip = win.projected_windows_overwritten(projector.exact, rows.n, settings.rerank, st.scores.n_items)
        st = index_windows(grads, st, projector, skip=skip)
    if projector.exact or (settings.rerank == 0 and settings.fidelity_sample == 0):
        return st
    # EK-FAC's exact queries are already preconditioned (in memory: [Q, D_exact]); the others come in blocks
    return rr.rerank(grads, rows, st, q, q_ex if q_ex is not None else grads.exact_queries(qitems), settings)


def _ekfac_scores(grads: ModelGradients, rows: RowSource, qitems, settings: ScoringSettings):
    """EK-FAC works in parameter space: the exact queries are preconditioned, then projected into the index's space
    and scaled by their exact norms. Returns the scores, the index-space queries and the preconditioned exact ones
    (what an exact re-rank scores candidates with)."""
    q_ex = grads.query_vectors(qitems, exact=True)
    root = rows.index.root if rows.index is not None else None
    pre = ekfac.fit_or_load(grads, rows, damping=settings.damping, root=root)
    qp_ex = pre.apply(q_ex)
    norms = np.linalg.norm(qp_ex, axis=1)
    projector = grads.capture.projector
    q = pre.to_index(q_ex, projector)
    unit = pre.to_index(qp_ex, projector) / np.maximum(norms, 1e-30)[:, None]
    scale = None
    if settings.unit_rows:  # Euclidean row norms (EK-FAC's metric per row would cost a solve per row)
        scale = inverse_norms(rows.row_norms())
    return score_directions(unit, norms, rows, pre, settings.direction, scale), q, qp_ex


def index_windows(grads: ModelGradients, st: Scored, projector, *, skip: bool = False) -> Scored:
    """`st` with the best windows of every long row along the index-space directions (`windows.EveryLongRow`)."""
    t0 = time.time()
    basis = st.basis

    def contributions(per_item: bool, rows):
        d = HarmDirections(projector, basis) if per_item else BackProjected(projector, basis.w_mean())
        return scaled_contributions(basis, grads.contributions(d, rows))

    st = win.best_windows(st, win.long_rows(grads.toks), win.EveryLongRow(), contributions, skip=skip)
    if st.windows.long_rows and not skip:
        grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return st
