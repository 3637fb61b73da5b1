"""Scoring the training rows for a set of failing items: the pure steps of `scoring`, `windows` and `rerank`, fed
by the few things only the model can compute.

`ModelGradients` is that model side, bound to one adapter: query gradients (in the index space, or exact), exact
row gradients against parameter-space directions, and per-token contributions along them. `score_items` runs the
steps in order (preconditioned scores, best windows of long rows, exact re-ranking and the self-check of a projected
index) from a `RowSource` over the index and small typed `ScoringSettings`; `attribute`, `fidelity` and the
checkpoint average all call it, each with its own model side.

Nothing here holds (exact width x rows) or (exact width x items): exact rows are streamed batch by batch, and
parameter-space directions (`attribution.directions`) and exact query gradients come in fixed blocks of items of at
most `directions.DIRECTION_BYTES`, one pass over the rows scored per block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from ..grads.capture import GradientCapture
from ..grads.layout import exact_widths, site_shapes
from ..grads.tangents import token_contributions
from ..progress import progress_bar
from ..projection import Projector
from ..distributed import current, gather_by_index
from ..setup.batches import owned_batches
from ..store.rows import RowSource
from . import directions as dirs_
from . import ekfac
from . import rerank as rr
from . import windows as win
from .directions import BackProjected
from .precondition import Preconditioner, preconditioner_class
from .queries import query_vectors
from .scoring import Scores, aggregate, item_scores, score, score_directions


@dataclass(frozen=True)
class ScoringSettings:
    direction: str  # "regression" | "improvement"
    preconditioner: str = "diagonal"
    damping: Optional[float] = None
    rerank: int = 200  # projected index: the top rows re-scored exactly
    fidelity_sample: int = 512  # projected index: rows of the projected-vs-exact self-check
    seed: int = 0
    windows: bool = True  # best-window scores of long rows
    unit_rows: bool = True  # rows scaled to unit norm in the preconditioner's metric (`scoring.row_scales`)
    per_turn: bool = True  # one pass, unit rows: conversations ranked by their best exchange (`one_pass`)

    @classmethod
    def from_config(cls, cfg, direction: str, **overrides) -> "ScoringSettings":
        a, g = cfg.attribution, cfg.grads
        base = dict(direction=direction, preconditioner=a.preconditioner, damping=a.damping, rerank=g.rerank,
                    fidelity_sample=g.fidelity_sample, seed=cfg.seed, unit_rows=a.unit_rows,
                    per_turn=a.per_turn)
        return cls(**{**base, **overrides})


@dataclass
class ModelGradients:
    """What scoring needs from the model, for one adapter: `capture` maps batches to index-space vectors."""

    capture: GradientCapture
    tokenizer: object
    eval_items: list
    toks: list
    chat: bool
    batch_size: int
    max_len: int
    chunk: int
    timings: dict = field(default_factory=dict)
    _exact: Optional[GradientCapture] = None

    @classmethod
    def from_session(cls, s, capture: GradientCapture) -> "ModelGradients":
        g = s.cfg.grads
        return cls(capture, s.tokenizer, s.eval_items, s.toks, s.chat, g.batch_size, g.max_seq_length,
                   g.loss_chunk_tokens, s.log.timings)

    @property
    def model(self):
        return self.capture.model

    @property
    def sites(self):
        return self.capture.sites

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0

    def exact(self) -> GradientCapture:
        """A capture of this adapter with no projection (parameter space)."""
        if self._exact is None:
            self._exact = GradientCapture(self.model, self.sites, Projector(site_shapes(self.sites)), chunk=self.chunk)
        return self._exact

    def query_vectors(self, qitems, *, exact: bool = False) -> np.ndarray:
        cap = self.exact() if exact else self.capture
        return query_vectors(cap, self.tokenizer, self.eval_items, qitems, chat=self.chat, max_len=self.max_len,
                             batch_size=self.batch_size).numpy()

    @property
    def exact_width(self) -> int:
        return sum(exact_widths(self.sites))

    def exact_queries(self, qitems) -> Callable[[Sequence[int]], np.ndarray]:
        """ks -> exact (parameter-space) query gradients of items ks, float32 [len(ks), D_exact]. Computed in the
        fixed blocks of `directions.blocks` (so an item's vector has the same bits whichever caller asks) and only
        the last block is kept (at most `directions.DIRECTION_BYTES`): [Q, D_exact] is never held for all items,
        and re-ranking, windows and spans of up to a block of items share one computation."""
        qitems = list(qitems)
        size = dirs_.block_size(self.exact_width)
        cache: dict = {}

        def block(b: int) -> np.ndarray:
            if b not in cache:
                cache.clear()  # the previous block goes before the next is computed
                cache[b] = self.query_vectors(qitems[b * size : (b + 1) * size], exact=True)
            return cache[b]

        def get(ks: Sequence[int]) -> np.ndarray:
            ks = [int(k) for k in ks]
            out = None
            for b in sorted({k // size for k in ks}):
                lo, blk = b * size, block(b)
                if [k - lo for k in ks] == list(range(blk.shape[0])):
                    return blk  # the whole block, in order (callers never write into it)
                if out is None:
                    out = np.empty((len(ks), blk.shape[1]), dtype=np.float32)
                js = [j for j, k in enumerate(ks) if k // size == b]
                out[js] = blk[[ks[j] - lo for j in js]]
            return out if out is not None else np.zeros((0, self.exact_width), dtype=np.float32)

        return get

    def exact_inner(self, dirs, positions: Sequence[int], block_sq: Optional[np.ndarray] = None) -> np.ndarray:
        """Directions (an [Q, D_exact] array or `directions.Directions`) @ exact gradients of the rows at
        `positions` -> [Q, len(positions)] float32. Streamed: no exact row vector is kept, and the directions are
        taken in blocks of at most `directions.DIRECTION_BYTES` (one capture pass over the rows per block).
        `block_sq` ([len(positions), sites], float64), when given, receives each row's squared exact norm per LoRA
        site (taken in the first pass)."""
        dirs = dirs_.as_directions(dirs)
        out = np.zeros((dirs.n, len(positions)), dtype=np.float32)
        widths = exact_widths(self.sites)
        edges = np.concatenate([[0], np.cumsum(widths)]).astype(int)
        device = next(self.model.parameters()).device
        pos = list(positions)
        rows = [self.toks[p] for p in pos]
        order = sorted(range(len(pos)), key=lambda j: (len(rows[j].input_ids), pos[j]))
        exact = self.exact()
        groups = dirs_.blocks(dirs.n, dirs.width)
        ranks = current()  # under torchrun batch j is rank j % N's; the blocks are gathered, each one process's bits
        with progress_bar("exact re-rank", total=len(pos) * len(groups), split=True) as bar:
            for g_i, ks in enumerate(groups):
                d32 = dirs.rows(ks)
                got = {}
                for j, js, ids, attn, sup in owned_batches(rows, order, self.batch_size, self.pad_id, device,
                                                           ranks.owns):
                    vecs, _ = exact.vectors(ids, attn, sup)
                    v = vecs.detach().cpu().numpy()
                    sq = None
                    if block_sq is not None and g_i == 0:
                        sq = np.stack([np.square(v[:, a:b], dtype=np.float64).sum(1)
                                       for a, b in zip(edges[:-1], edges[1:])], axis=1)
                    got[j] = (js, d32 @ v.T, sq)
                    bar.advance(len(js))
                if ranks.active:
                    got = gather_by_index(got)
                for js, blk, sq in got.values():
                    out[ks[0] : ks[-1] + 1, js] = blk
                    if sq is not None:
                        block_sq[js] = sq
                del d32
        return out

    def contributions(self, dirs, positions: Sequence[int], items: Optional[Sequence[int]] = None) -> dict:
        """{(position, k): per-token contributions} along direction k (every direction, or one per row: `items`) of
        an [K, D_exact] array or a `directions.Directions`, taken in blocks of directions."""
        dirs = dirs_.as_directions(dirs)
        toks = [self.toks[p] for p in positions]
        if items is None:
            jobs = [(j, k) for j in range(len(positions)) for k in range(dirs.n)]
        else:
            jobs = [(j, int(k)) for j, k in enumerate(items)]
        out: dict = {}
        for ks in dirs_.blocks(dirs.n, dirs.width):
            lo, hi = ks[0], ks[-1] + 1
            sub = [(j, k - lo) for j, k in jobs if lo <= k < hi]
            if not sub:
                continue
            need = sorted({k for _, k in sub})  # only the directions these jobs use
            where = {k: i for i, k in enumerate(need)}
            d = dirs.rows([lo + k for k in need])
            res = token_contributions(self.model, self.sites, toks, d, pad_id=self.pad_id,
                                      batch_size=self.batch_size, jobs=[(j, where[k]) for j, k in sub],
                                      chunk=self.chunk)
            out.update({(positions[j], lo + need[i]): v for (j, i), v in res.items()})
            del d
        return out


def block_dims_of(index) -> Optional[list[int]]:
    """The per-site block widths an index records (None when unknown or inconsistent with its width)."""
    bd = (index.meta or {}).get("block_dims") if hasattr(index, "meta") else None
    return list(bd) if bd and sum(bd) == index.dim else None


def fit_preconditioner(kind: str, damping: Optional[float], rows: RowSource,
                       block_dims: Optional[list[int]]) -> Preconditioner:
    """`attribution.preconditioner` fitted on the rows (streamed)."""
    p = Preconditioner(kind, damping, block_dims)
    if p.is_identity:
        return p.fit(RowSource(np.zeros((0, rows.dim), dtype=np.float32)))
    return p.fit(rows)


def score_items(grads: ModelGradients, rows: RowSource, qitems, settings: ScoringSettings, *,
                block_dims: Optional[list[int]] = None) -> Scores:
    """Per-item scores [Q, N] of every row, with the best windows of long rows and, for a projected index, the top
    `settings.rerank` rows re-scored exactly and a sample of rows measuring projected-vs-exact agreement."""
    t0 = time.time()
    projector = grads.capture.projector
    q_ex = None
    if preconditioner_class(settings.preconditioner).parameter_space:
        sc, q, q_ex = _ekfac_scores(grads, rows, qitems, settings)
    else:
        q = grads.query_vectors(qitems)
        pre = fit_preconditioner(settings.preconditioner, settings.damping, rows, block_dims)
        sc = score(q, rows, pre, settings.direction, unit_rows=settings.unit_rows)
    grads.timings["precondition"] = round(time.time() - t0, 3)
    if settings.windows:
        sc = _windows(grads, sc, projector, skip=win.projected_windows_overwritten(
            projector.exact, rows.n, settings.rerank, sc.w.shape[0]))
    if projector.exact or (settings.rerank == 0 and settings.fidelity_sample == 0):
        return sc
    # EK-FAC's exact queries are already preconditioned (in memory: [Q, D_exact]); the others come in blocks
    exact_q = q_ex if q_ex is not None else grads.exact_queries(qitems)
    proj_scale = None if sc.row_scale is None else sc.row_scale.copy()  # index-space norms, for the self-check
    e, r = rr.exact_directions(sc, q, exact_q, projector.site_dims(), exact_widths(grads.sites),
                               settings.direction)
    sc = replace(sc, e=e, r=r)
    n = rows.n
    cand = rr.candidates(sc.rank_agg, settings.rerank)
    sample = rr.fidelity_sample(n, settings.fidelity_sample, settings.seed)
    need = np.union1d(cand, sample).astype(int)
    block_sq = np.zeros((need.size, len(grads.sites))) if sc.row_scale is not None else None
    ex = grads.exact_inner(sc.e, need.tolist(), block_sq)
    if sc.r is not None:
        ex = ex + rows.subset(need).inner(sc.r.astype(np.float32))
    exact_scale = None
    if block_sq is not None:
        # each row's exact norm in the preconditioner's metric: its exact candidates' scores, windows and spans
        # are scaled by it (the other rows keep their index-space norm)
        exact_scale = rr.exact_row_scales(sc.precond, block_sq, rows.subset(need), projector.site_dims())
        ex = (ex * exact_scale[None, :]).astype(np.float32)
    col = {int(p): j for j, p in enumerate(need)}
    if cand.size:
        cols = [col[int(p)] for p in cand]
        if exact_scale is not None:
            rs = sc.row_scale.copy()
            rs[cand] = exact_scale[cols]
            sc = replace(sc, row_scale=rs)
        sc = rr.put_exact_items(sc, cand, ex[:, cols])
        exact_agg = aggregate(ex[:, cols])
        if settings.windows:
            sc, exact_agg = _candidate_windows(grads, sc, projector, cand, exact_agg)
        sc = rr.put_exact_order(sc, cand, exact_agg)
    if sample.size >= 2:
        ex_s = ex[:, [col[int(p)] for p in sample]]
        proj_s = item_scores(rows.subset(sample).inner(sc.unit), settings.direction)
        if proj_scale is not None:
            proj_s = proj_s * proj_scale[sample][None, :]
        sc = replace(sc, fidelity=rr.self_check(ex_s, proj_s, sample, sc.order, n, q.shape[0], int(cand.size)))
    return sc


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
        n_ = rows.row_norms()
        scale = np.where(n_ > 0, 1.0 / np.maximum(n_, 1e-300), 0.0)
    return score_directions(unit, norms, rows, pre, settings.direction, scale), q, qp_ex


def _windows(grads: ModelGradients, sc: Scores, projector, *, skip: bool = False) -> Scores:
    """`sc` with the best windows of the long rows along the index-space directions; with `skip`
    (`windows.projected_windows_overwritten`) only the bookkeeping: the exact re-rank computes every one of them."""
    long_rows = win.long_rows(grads.toks)
    sc = replace(sc, long_rows=long_rows)
    if not long_rows:
        return sc
    t0 = time.time()
    Q = sc.w.shape[0]
    if Q > win.WINDOW_ITEMS_MAX:  # never with `skip`: the rows with per-item windows then depend on these scores
        res = scaled_contributions(sc, grads.contributions(BackProjected(projector, sc.w.mean(0, keepdims=True)), long_rows))
        sc = win.aggregate_windows(sc, long_rows, res)
    item_rows = win.item_window_rows(sc, long_rows, Q)
    sc = replace(sc, window_items=len(item_rows) == len(long_rows), window_item_rows=list(item_rows))
    if skip:
        return sc
    res = scaled_contributions(sc, grads.contributions(BackProjected(projector, sc.w), item_rows))
    sc = win.apply_item_windows(sc, item_rows, res, Q, aggregate=Q <= win.WINDOW_ITEMS_MAX)
    grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return sc


def _candidate_windows(grads: ModelGradients, sc: Scores, projector, cand: np.ndarray,
                       exact_agg: np.ndarray) -> tuple[Scores, np.ndarray]:
    # in row order, not the candidates' order: which rows share a forward batch (the last bits of their
    # contributions) then does not depend on the projected scores that ordered the candidates
    long_c = sorted(int(p) for p in cand if win.is_long(grads.toks[int(p)]))
    if not long_c:
        return sc, exact_agg
    t0 = time.time()
    dirs = rr.parameter_directions(sc, projector, exact_part=True)
    item_rows = set(sc.window_item_rows)
    jobs_rows = [p for p in long_c if p in item_rows]
    res = scaled_contributions(sc, grads.contributions(dirs, jobs_rows)) if jobs_rows else {}
    agg_only = [p for p in long_c if p not in item_rows]
    res_agg = scaled_contributions(sc, grads.contributions(dirs.mean(), agg_only)) if agg_only else {}
    sc, out = win.candidate_windows(sc, cand, long_c, res, res_agg, exact_agg, sc.w.shape[0])
    grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return sc, out


def scaled_contributions(sc: Scores, contribs: dict) -> dict:
    """Per-token contributions {(position, k): c} in the units of the row's score: times its `row_scale`."""
    if sc.row_scale is None:
        return contribs
    return {key: c * sc.scale_of(key[0]) for key, c in contribs.items()}
