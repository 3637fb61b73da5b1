"""A later question about the same fine-tune (another eval set, another metric, a forgotten item): the rows are not
passed over again. A first pass left every row in the per-row store (`store.rowstore`): its norm in the
preconditioner's metric and a CountSketch of its unit row in that metric, b = sqrt(w) g / |g|_w. A unit
preconditioned query u scores that row as h <u, g> / |g|_w = h <u / sqrt(w), b>, so the sketches give every row's
score up to the sketch's error (`sketched`); the rows that can rank in the top `top_k` are then scored exactly, from
one backward each (`exact_rows`), until no row left out comes within `SHORTLIST_Z` measured sketch errors of the
top-k cut (`shortlist`).

What the shortlist can miss is stated, not assumed away: the spread of the sketch's error on the combined ranking
score is measured on the rows scored both ways, and the expected number of rows left out that belong in the top
k, were that error normal with that spread, is reported (`ShortlistInfo.describe`). Rows outside the shortlist keep
their sketched scores (the report says how many rows are exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..distributed import current, gather_by_index
from ..setup.batches import length_order
from .basis import inverse_norms, scaled_items
from .one_pass import OnePass, PassState, best_turns, features_of, item_parts
from .row_pass import exact_batches, norms_of
from .scoring import aggregate, combine_items, rank
from .values import Basis, Exchanges, Scored, Scores

SHORTLIST_MIN = 64  # rows scored exactly at least (and twice the top-k)
SHORTLIST_Z = 4.0  # every row whose sketched score comes within this many sketch errors of the top-k cut
SHORTLIST_ROUNDS = 6
ITEM_TOP = 10  # each item's top rows (the report's per-item lists) are scored exactly too


@dataclass(frozen=True)
class ShortlistInfo:
    rows: int
    exact: int
    sketch_dim: int
    error: float  # rms sketch error of the combined ranking score, on the rows scored both ways
    cut: float  # the top-k cut: the k-th best combined score
    expected_missed: float
    top_k: int
    store: str

    def describe(self) -> dict:
        return {"mode": "per-row store of an earlier pass: shortlist scored exactly", "store": self.store,
                "unique_rows": self.rows, "exact_rows": self.exact, "sketch_dim": self.sketch_dim,
                "shortlist": {"top_k": self.top_k, "sketch_error": self.error, "cut": self.cut,
                              "margin_errors": SHORTLIST_Z, "expected_missed": self.expected_missed,
                              "rule": (f"every row whose sketched score comes within {SHORTLIST_Z:g} sketch errors "
                                       f"({self.error:.3g}, measured on the {self.exact} rows scored both ways) of "
                                       f"the top-{self.top_k} cut is scored exactly; the other rows keep their "
                                       f"sketched scores; were the sketch's error normal with that spread, "
                                       f"{self.expected_missed:.2g} of the rows left out would belong in the top "
                                       f"{self.top_k}")}}


@dataclass
class Rows:
    """Each distinct row's inner products with the unit queries [Q, n], its norm, its exchanges' parts."""

    inner: np.ndarray
    norms: np.ndarray
    parts: dict


def sketched(store, ps: PassState, n: int) -> Rows:
    """Every row's inner products estimated from the store's sketches: <u, g> = <u / sqrt(w), b> |g|_w."""
    a = np.asarray(ps.unit, dtype=np.float64)
    w = ps.reducer.weights
    if w is not None:
        a = a / np.sqrt(w)[None, :]
    sa = ps.reducer.score.apply(a)  # [Q, k]
    out = Rows(np.zeros((sa.shape[0], n), dtype=np.float32), np.zeros(n), {})
    for arr in store.parts():
        pos = arr["positions"]
        out.inner[:, pos] = (sa @ arr["sketch"].astype(np.float32).T) * arr["norms"][None, :].astype(np.float32)
        out.norms[pos] = arr["norms"]
        if "t_owner" in arr:
            ti = (sa @ arr["t_sketch"].astype(np.float32).T) * arr["t_norms"][None, :].astype(np.float32)
            out.parts.update(item_parts(ti, arr["t_norms"], arr["t_owner"]))
    return out


def exact_rows(grads, ps: PassState, positions: Sequence[int], turns: Optional[Sequence]) -> Rows:
    """The rows at `positions` scored exactly: one backward per batch (length order), nothing kept past it."""
    pos = length_order(grads.toks, sorted(int(p) for p in positions))
    got = {}
    for j, part, v, t in exact_batches(grads, pos, "gradients (shortlist)", turns):
        ex = ps.reducer.exchanges(t) if t is not None else None
        got[j] = (part, ps.unit @ v.T, norms_of(v, ps.reducer.weights), ex)
    if current().active:
        got = gather_by_index(got)
    n = len(grads.toks)
    out = Rows(np.zeros((ps.unit.shape[0], n), dtype=np.float32), np.zeros(n), {})
    for part, ip, nm, ex in got.values():
        out.inner[:, part], out.norms[part] = ip, nm
        if ex is not None:
            out.parts.update(item_parts(ex["t_inner"], ex["t_norms"], ex["t_owner"]))
    return out


def _scores(rows: Rows, plan, settings) -> tuple[np.ndarray, np.ndarray, dict, Optional[np.ndarray]]:
    copies = list(plan.copies)
    inner, norms = rows.inner[:, copies], rows.norms[copies]
    scale = inverse_norms(norms) if settings.unit_rows else None
    per_item = scaled_items(inner, settings.direction, scale)
    rank_item, found = best_turns(per_item, rows.parts, settings.direction, copies) if rows.parts else \
        (per_item, {})
    return per_item, rank_item, found, scale


def _merge(into: Rows, got: Rows, positions: Sequence[int]) -> None:
    p = list(positions)
    into.inner[:, p], into.norms[p] = got.inner[:, p], got.norms[p]
    into.parts.update({q: v for q, v in got.parts.items() if q in set(p)})


def score_shortlist(grads, store, ps: PassState, settings, turns: Optional[Sequence], top_k: int
                    ) -> tuple[Scored, OnePass, ShortlistInfo]:
    """The scores of every row for a question the store's parts do not answer (module docstring)."""
    plan, n = ps.plan, len(grads.toks)
    copies = np.asarray(plan.copies)
    approx = sketched(store, ps, n)
    _, rank_a, _, _ = _scores(approx, plan, settings)
    comb_a = combine_items(rank_a, settings.combine)
    mixed = Rows(approx.inner.copy(), approx.norms.copy(), dict(approx.parts))
    exact: set[int] = set()
    k = min(top_k, n)
    want = set(copies[rank(comb_a, max(SHORTLIST_MIN, 2 * k))].tolist())
    want |= {int(copies[r]) for row in rank_a for r in rank(row, ITEM_TOP)}
    error = cut = 0.0
    for _ in range(SHORTLIST_ROUNDS):
        new = sorted(want - exact)
        if new:
            _merge(mixed, exact_rows(grads, ps, new, turns), new)
            exact |= set(new)
        _, rank_m, _, _ = _scores(mixed, plan, settings)
        comb_m = combine_items(rank_m, settings.combine)
        is_exact = np.isin(copies, list(exact))
        error = float(np.sqrt(np.mean(np.square(comb_m[is_exact] - comb_a[is_exact])))) if is_exact.any() else 0.0
        order = rank(comb_m)
        cut = float(comb_m[order[k - 1]]) if k else float("inf")
        band = np.flatnonzero(~is_exact & (comb_a >= cut - SHORTLIST_Z * error))
        want = set(copies[band].tolist()) | set(copies[order[:k]].tolist())
        want |= {int(copies[r]) for row in rank_m for r in rank(row, ITEM_TOP)}
        if not (want - exact):
            break
    per_item, rank_item, found, scale = _scores(mixed, plan, settings)
    is_exact = np.isin(copies, list(exact))
    missed = _expected_missed(comb_a[~is_exact], cut, error)
    info = ShortlistInfo(len(plan.unique), len(exact), int(ps.reducer.score.k), error, cut, missed, k,
                         str(store.root))
    st = Scored(Scores(per_item, rank_item, aggregate(rank_item)),
                Basis(ps.unit, ps.qnorms, ps.pre, settings.direction, scale), exchanges=Exchanges(found))
    features, agree = _features(store, plan, n)
    return st, OnePass(plan, ps.width, features, agree, str(store.root), 0), info


def _expected_missed(approx: np.ndarray, cut: float, error: float) -> float:
    """Sum over the rows left out of P(score >= cut) when the score is the sketched one plus a normal error."""
    if error <= 0 or not approx.size:
        return 0.0 if not approx.size or np.all(approx < cut) else float(np.sum(approx >= cut))
    z = (approx.astype(np.float64) - cut) / error
    return float(sum(0.5 * math.erfc(-x / math.sqrt(2.0)) for x in z))


def _features(store, plan, n: int):
    clusters = None if plan.all_held else np.zeros((n, 0), dtype=np.float32)
    agree = None
    for arr in store.parts():
        if clusters is not None:
            if clusters.shape[1] != arr["cluster"].shape[1]:
                clusters = np.zeros((n, arr["cluster"].shape[1]), dtype=np.float32)
            clusters[arr["positions"]] = arr["cluster"]
        if "agreement" in arr and np.isfinite(arr["agreement"][0]):
            agree = (float(arr["agreement"][0]), int(arr["agreement"][1]))
    return features_of(store, plan, clusters, True), agree
