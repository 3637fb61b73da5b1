"""Rows read from a gradient index (`store.build.OpenIndex`): the row source when the exact index is small enough to
keep (`grads.projection_dim: auto` on small widths), when EK-FAC's factors are fitted over one, or when an integer
`grads.projection_dim` asks for a projected index.

`score_index` runs the steps in order: preconditioned scores (`basis.score`, EK-FAC in parameter space), the best
windows of every long row (`windows.EveryLongRow`) and, for a projected index, the top `settings.rerank` rows
re-scored exactly and a sample of rows measuring projected-vs-exact agreement (`rerank`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import numpy as np

from ..grads.layout import exact_widths
from ..store.rows import RowSource
from . import ekfac
from . import rerank as rr
from . import windows as win
from .basis import fit_preconditioner, inverse_norms, score, score_directions
from .directions import BackProjected, HarmDirections
from .engine import ModelGradients, ScoringSettings, scaled_contributions
from .precondition import preconditioner_class
from .scoring import aggregate, item_scores
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
    return _rerank(grads, rows, st, q, q_ex if q_ex is not None else grads.exact_queries(qitems), settings)


def _rerank(grads: ModelGradients, rows: RowSource, st: Scored, q: np.ndarray, exact_q, settings: ScoringSettings
            ) -> Scored:
    """The top `settings.rerank` rows scored exactly (their windows too) and first in the ranking, and the
    projected-vs-exact self-check on a seeded sample."""
    projector = grads.capture.projector
    basis = st.basis
    proj_scale = None if basis.row_scale is None else basis.row_scale.copy()  # index-space norms, for the self-check
    e, r = rr.exact_directions(basis, q, exact_q, projector.site_dims(), exact_widths(grads.sites),
                               settings.direction)
    st = replace(st, rerank=replace(st.rerank, e=e, r=r))
    n = rows.n
    cand = rr.candidates(st.scores.rank_agg, settings.rerank)
    sample = rr.fidelity_sample(n, settings.fidelity_sample, settings.seed)
    need = np.union1d(cand, sample).astype(int)
    block_sq = np.zeros((need.size, len(grads.sites))) if basis.row_scale is not None else None
    ex = grads.exact_inner(e, need.tolist(), block_sq)
    if r is not None:
        ex = ex + rows.subset(need).inner(r.astype(np.float32))
    exact_scale = None
    if block_sq is not None:
        # each row's exact norm in the preconditioner's metric: its exact candidates' scores, windows and spans
        # are scaled by it (the other rows keep their index-space norm)
        exact_scale = rr.exact_row_scales(basis.precond, block_sq, rows.subset(need), projector.site_dims())
        ex = (ex * exact_scale[None, :]).astype(np.float32)
    col = {int(p): j for j, p in enumerate(need)}
    if cand.size:
        cols = [col[int(p)] for p in cand]
        if exact_scale is not None:
            rs = basis.row_scale.copy()
            rs[cand] = exact_scale[cols]
            st = replace(st, basis=replace(basis, row_scale=rs))
        st = rr.put_exact_items(st, cand, ex[:, cols])
        exact_agg = aggregate(ex[:, cols])
        if settings.windows:
            st, exact_agg = _candidate_windows(grads, st, projector, cand, exact_agg)
        st = rr.put_exact_order(st, cand, exact_agg)
    if sample.size >= 2:
        ex_s = ex[:, [col[int(p)] for p in sample]]
        proj_s = item_scores(rows.subset(sample).inner(basis.unit), settings.direction)
        if proj_scale is not None:
            proj_s = proj_s * proj_scale[sample][None, :]
        fid = rr.self_check(ex_s, proj_s, sample, st.scores.order, n, q.shape[0], int(cand.size))
        st = replace(st, rerank=replace(st.rerank, fidelity=fid))
    return st


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


def _candidate_windows(grads: ModelGradients, st: Scored, projector, cand: np.ndarray,
                       exact_agg: np.ndarray) -> tuple[Scored, np.ndarray]:
    # in row order, not the candidates' order: which rows share a forward batch (the last bits of their
    # contributions) then does not depend on the projected scores that ordered the candidates
    long_c = sorted(int(p) for p in cand if win.is_long(grads.toks[int(p)]))
    if not long_c:
        return st, exact_agg
    t0 = time.time()
    dirs = rr.parameter_directions(st.basis, st.rerank, projector, exact_part=True)
    item_rows = set(st.windows.item_rows)
    jobs_rows = [p for p in long_c if p in item_rows]
    res = scaled_contributions(st.basis, grads.contributions(dirs, jobs_rows)) if jobs_rows else {}
    agg_only = [p for p in long_c if p not in item_rows]
    res_agg = scaled_contributions(st.basis, grads.contributions(dirs.mean(), agg_only)) if agg_only else {}
    st, out = win.candidate_windows(st, cand, long_c, res, res_agg, exact_agg, st.scores.n_items)
    grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return st, out
