"""Exact re-ranking of a projected index's top rows, and projected-vs-exact agreement.

With a projected index the top `grads.rerank` rows are re-scored with exact gradients. For a preconditioned query
H^-1 = (I - M) / lambda per block (M the low-rank or diagonal part), so a candidate's exact score splits into the
identity part, scored in parameter space against its exact gradient (`e`), and the correction M, scored in index
space (`r`): score = <r, P(g)> + <e, g> (`exact_directions`). A sample of `grads.fidelity_sample` rows measures how
well the projected scores agree with exact ones (`self_check`).

`rerank` runs those steps over an index's scores (`attribution.indexed.score_index` calls it once, after the
windows); the rest are pure functions.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import numpy as np
from scipy.stats import pearsonr, spearmanr

from ..grads.layout import exact_widths, expand
from ..store.rows import RowSource
from . import windows as win
from .directions import BackProjected, Directions, ExactPart, HarmDirections
from .engine import ModelGradients, ScoringSettings, scaled_contributions
from .scoring import aggregate, harm_factor, item_scores, rank
from .values import Basis, Rerank, Scored


def topk_recall(exact: np.ndarray, approx: np.ndarray, k: int) -> float:
    k = min(k, exact.size)
    return len(set(rank(exact, k).tolist()) & set(rank(approx, k).tolist())) / k


def spearman_within_top(exact: np.ndarray, approx: np.ndarray, frac: float = 0.05, min_rows: int = 10) -> float:
    """Rank agreement among the rows that matter: the exact top `frac` (at least `min_rows` rows)."""
    k = min(exact.size, max(min_rows, int(np.ceil(frac * exact.size))))
    top = rank(exact, k)
    return float(spearmanr(exact[top], approx[top]).statistic)


def agreement(exact: np.ndarray, approx: np.ndarray) -> dict:
    """Mean over queries (rows of [Q, N]) of each figure."""
    exact, approx = np.atleast_2d(exact), np.atleast_2d(approx)
    figs = {"top10_recall": [], "top50_recall": [], "spearman_top5pct": [], "pearson": [], "spearman": []}
    for e, a in zip(exact, approx):
        figs["top10_recall"].append(topk_recall(e, a, 10))
        figs["top50_recall"].append(topk_recall(e, a, 50))
        figs["spearman_top5pct"].append(spearman_within_top(e, a))
        figs["pearson"].append(float(pearsonr(e, a).statistic))
        figs["spearman"].append(float(spearmanr(e, a).statistic))
    return {k: float(np.nanmean(v)) for k, v in figs.items()}


def rerank_order(approx: np.ndarray, candidates: np.ndarray, exact_candidate_scores: np.ndarray) -> np.ndarray:
    """Candidates first, ordered by their exact scores; every other row after them by its approximate score."""
    cand_order = candidates[np.lexsort((candidates, -exact_candidate_scores))]
    rest = np.setdiff1d(rank(approx), candidates, assume_unique=False)
    rest = rest[np.lexsort((rest, -approx[rest]))]
    return np.concatenate([cand_order, rest])


def order_scores(order: np.ndarray) -> np.ndarray:
    """Pseudo-scores whose descending order is `order` (for rank-based agreement figures)."""
    out = np.empty(order.size, dtype=np.float64)
    out[order] = -np.arange(order.size, dtype=np.float64)
    return out


def exact_directions(basis: Basis, q_index: np.ndarray, exact_queries, index_widths, exact_widths,
                     direction: str) -> tuple[ExactPart, Optional[np.ndarray]]:
    """(e, r or None): a candidate's exact score is <e_k, g_exact> (+ <r_k, P(g)>). `exact_queries(ks)` gives the
    exact query gradients of items ks (float32 [len(ks), D_exact]; an in-memory [Q, D_exact] array also serves);
    e is produced from it block by block (`attribution.directions.ExactPart`), r [Q, dim] is in index space."""
    if not callable(exact_queries):
        arr = np.asarray(exact_queries, dtype=np.float32)
        exact_queries = lambda ks: arr[list(ks)]  # noqa: E731
    pre = basis.precond
    Q = q_index.shape[0]
    if pre.is_identity:
        return ExactPart(exact_queries, np.full(Q, harm_factor(direction)), exact_widths, unit=True), None
    # the unit scaling of each preconditioned query, harm-signed: what `score` applied to H^-1 q
    c = harm_factor(direction) / np.maximum(basis.norms, 1e-30)
    if pre.parameter_space:  # preconditioned in parameter space: q_exact is H^-1 q already, nothing left in index space
        return ExactPart(exact_queries, c, exact_widths), None
    scale_idx = expand(pre.identity_scale, index_widths)
    e = ExactPart(exact_queries, c, exact_widths, scale=np.asarray(pre.identity_scale, dtype=np.float64))
    r = basis.w - c[:, None] * scale_idx[None, :] * q_index.astype(np.float64)
    return e, r


def exact_row_scales(precond, block_sq: np.ndarray, proj_rows, index_widths) -> np.ndarray:
    """1 / |g| of rows with exact gradients, in the metric the index-space scores use. With H^-1 = (I - M_b) /
    lambda_b per block (the diagonal preconditioner: M_b = diag(m / (m + lambda_b)) in index space), a row's squared
    norm is sum_b (|g_b|^2 - <P g_b, M_b P g_b>) / lambda_b: the identity part from its exact gradient (per-block
    squared norms `block_sq` [n, B]), the correction from its index row (`proj_rows`, a RowSource over the same
    rows). Other preconditioners normalise in the Euclidean metric: |g|^2 = sum_b |g_b|^2."""
    sq = np.asarray(block_sq, dtype=np.float64)
    w = precond.metric_weights() if hasattr(precond, "metric_weights") else None
    if w is None:
        tot = sq.sum(1)
    else:
        lam_inv = np.asarray(precond.identity_scale, dtype=np.float64)  # 1 / lambda_b
        corr = 1.0 - w * expand(lam_inv, index_widths) ** -1  # m / (m + lambda) = 1 - lambda / (m + lambda)
        proj_sq = np.zeros_like(sq)
        edges = np.concatenate([[0], np.cumsum(index_widths)]).astype(int)
        at = 0
        for _, _, rows in proj_rows.chunks():
            r2 = np.square(rows) * corr[None, :]
            proj_sq[at : at + rows.shape[0]] = np.stack([r2[:, a:b].sum(1) for a, b in zip(edges[:-1], edges[1:])], 1)
            at += rows.shape[0]
        tot = ((sq - proj_sq) * lam_inv[None, :]).sum(1)
    tot = np.maximum(tot, 0.0)
    return np.where(tot > 0, 1.0 / np.sqrt(np.maximum(tot, 1e-300)), 0.0)


def candidates(rank_agg: np.ndarray, k: int) -> np.ndarray:
    """The rows re-scored exactly: the top k by the ranking score."""
    return rank(rank_agg, min(k, rank_agg.size))


def fidelity_sample(n: int, k: int, seed: int) -> np.ndarray:
    """The seeded sample of rows the projected-vs-exact self-check is measured on (sorted)."""
    if not k:
        return np.array([], dtype=int)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(k, n), replace=False))


def put_exact_items(st: Scored, cand: np.ndarray, exact: np.ndarray) -> Scored:
    """`st` with the candidates' exact per-item scores [Q, len(cand)] in place of their projected ones."""
    per_item = st.scores.per_item.copy()
    per_item[:, cand] = exact
    rank_item = st.scores.rank_item.copy()
    rank_item[:, cand] = exact
    return replace(st, scores=replace(st.scores, per_item=per_item, rank_item=rank_item),
                   rerank=replace(st.rerank, cand=cand.astype(np.int64)))


def put_exact_order(st: Scored, cand: np.ndarray, exact_agg: np.ndarray) -> Scored:
    """`st` with the candidates first in the ranking, by their exact ranking scores; every other row after them."""
    rank_agg = st.scores.rank_agg.copy()
    rank_agg[cand] = exact_agg
    return replace(st, scores=replace(st.scores, order=rerank_order(st.scores.rank_agg, cand, exact_agg),
                                      rank_agg=rank_agg))


def parameter_directions(basis: Basis, rerank: Rerank, projector, exact_part: bool) -> Directions:
    """Parameter-space directions (one per item, produced block by block: `attribution.directions`) whose inner
    products with a row's exact gradient give its score: P^T w for index-scored rows; P^T r + e for a projected
    index's re-ranked candidates."""
    if not exact_part or rerank.e is None:
        return HarmDirections(projector, basis)
    if rerank.r is None:
        return rerank.e
    return BackProjected(projector, rerank.r) + rerank.e


def self_check(exact_s: np.ndarray, projected_s: np.ndarray, sample: np.ndarray, order: Optional[np.ndarray],
               n_rows: int, n_queries: int, n_rerank: int) -> dict:
    """Projected-vs-exact agreement on the sample rows: per item, on the aggregate, and of the re-ranked order a
    user reads (exact candidates first) with the exact order."""
    fid = {"sample_rows": int(sample.size), "queries": int(n_queries), "rerank_rows": int(n_rerank),
           "projected": agreement(exact_s, projected_s),
           "projected_aggregate": agreement(aggregate(exact_s)[None, :], aggregate(projected_s)[None, :]),
           "reranked": None}
    if order is not None:
        pos_in_order = np.empty(n_rows, dtype=np.int64)
        pos_in_order[order] = np.arange(n_rows)
        agg_fake = order_scores(np.argsort(pos_in_order[sample], kind="stable"))
        fid["reranked"] = agreement(aggregate(exact_s)[None, :], agg_fake[None, :])
        fid["reranked"].pop("pearson", None)
    return fid


def rerank(grads: ModelGradients, rows: RowSource, st: Scored, q: np.ndarray, exact_q, settings: ScoringSettings
            ) -> Scored:
    """The top `settings.rerank` rows scored exactly (their windows too) and first in the ranking, and the
    projected-vs-exact self-check on a seeded sample."""
    projector = grads.capture.projector
    basis = st.basis
    proj_scale = None if basis.row_scale is None else basis.row_scale.copy()  # index-space norms, for the self-check
    e, r = exact_directions(basis, q, exact_q, projector.site_dims(), exact_widths(grads.sites),
                            settings.direction)
    st = replace(st, rerank=replace(st.rerank, e=e, r=r))
    n = rows.n
    cand = candidates(st.scores.rank_agg, settings.rerank)
    sample = fidelity_sample(n, settings.fidelity_sample, settings.seed)
    need = np.union1d(cand, sample).astype(int)
    block_sq = np.zeros((need.size, len(grads.sites))) if basis.row_scale is not None else None
    ex = grads.exact_inner(e, need.tolist(), block_sq)
    if r is not None:
        ex = ex + rows.subset(need).inner(r.astype(np.float32))
    exact_scale = None
    if block_sq is not None:
        # each row's exact norm in the preconditioner's metric: its exact candidates' scores, windows and spans
        # are scaled by it (the other rows keep their index-space norm)
        exact_scale = exact_row_scales(basis.precond, block_sq, rows.subset(need), projector.site_dims())
        ex = (ex * exact_scale[None, :]).astype(np.float32)
    col = {int(p): j for j, p in enumerate(need)}
    if cand.size:
        cols = [col[int(p)] for p in cand]
        if exact_scale is not None:
            rs = basis.row_scale.copy()
            rs[cand] = exact_scale[cols]
            st = replace(st, basis=replace(basis, row_scale=rs))
        st = put_exact_items(st, cand, ex[:, cols])
        exact_agg = aggregate(ex[:, cols])
        if settings.windows:
            st, exact_agg = candidate_windows_exact(grads, st, projector, cand, exact_agg)
        st = put_exact_order(st, cand, exact_agg)
    if sample.size >= 2:
        ex_s = ex[:, [col[int(p)] for p in sample]]
        proj_s = item_scores(rows.subset(sample).inner(basis.unit), settings.direction)
        if proj_scale is not None:
            proj_s = proj_s * proj_scale[sample][None, :]
        fid = self_check(ex_s, proj_s, sample, st.scores.order, n, q.shape[0], int(cand.size))
        st = replace(st, rerank=replace(st.rerank, fidelity=fid))
    return st


def candidate_windows_exact(grads: ModelGradients, st: Scored, projector, cand: np.ndarray,
                            exact_agg: np.ndarray) -> tuple[Scored, np.ndarray]:
    """The best windows of the long candidates along their exact directions (`parameter_directions`); returns
    `st` with them and the candidates' aggregate ranking scores."""
    # in row order, not the candidates' order: which rows share a forward batch (the last bits of their
    # contributions) then does not depend on the projected scores that ordered the candidates
    long_c = sorted(int(p) for p in cand if win.is_long(grads.toks[int(p)]))
    if not long_c:
        return st, exact_agg
    t0 = time.time()
    dirs = parameter_directions(st.basis, st.rerank, projector, exact_part=True)
    item_rows = set(st.windows.item_rows)
    jobs_rows = [p for p in long_c if p in item_rows]
    res = scaled_contributions(st.basis, grads.contributions(dirs, jobs_rows)) if jobs_rows else {}
    agg_only = [p for p in long_c if p not in item_rows]
    res_agg = scaled_contributions(st.basis, grads.contributions(dirs.mean(), agg_only)) if agg_only else {}
    st, out = win.candidate_windows(st, cand, long_c, res, res_agg, exact_agg, st.scores.n_items)
    grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return st, out
