"""A later question about the same fine-tune (another eval set, another metric, a forgotten item): the rows are not
passed over again. A first pass left every row in the per-row store (`store.rowstore`): its norm in the
preconditioner's metric and a CountSketch S b of its unit row in that metric, b = sqrt(w) g / |g|_w (w the diagonal
of the preconditioner's inverse). A unit preconditioned query u scores that row as h <u, g> / |g|_w = h <a, b> with
a = u / sqrt(w), so <S a, S b> estimates every row's score (`sketched`), with an error of spread
sqrt((|a|^2 + <a, b>^2) / k) for a k-wide CountSketch (its variance, |b| = 1).

The rows that can rank in the top `top_k` are then scored exactly, round by round (`shortlist`): first each item's
reference rows (`scoring.reference_rows`: the rows its median and scale are measured on, in a full pass too, so
both give a row the same z; a scale taken out of sketched scores was off by up to 1.8x where the sketch errs by more
than the scale), from the exact gradients the first pass kept of them (`stored_rows`, the store's ref file: no
backward), and the top rows by their sketched ranking score, from one backward each (`exact_rows`), then
every row whose ranking score
(combined over the items as the run combines them, `scoring.Combined`) could reach the top-k cut with each item's
error `SHORTLIST_Z` spreads in its favour, until none is left. The spread is the sketch's variance, checked on the
rows scored both ways (`ShortlistInfo.calibration`: their errors over it, which scales it, by no less than
`CALIBRATION_MIN`: the variance is a bound that concentrated vectors stay well under). What the
shortlist can miss is stated, not assumed away: the expected number of rows left out whose true ranking score
reaches the cut, the errors taken as normal with those spreads. Rows outside the shortlist keep their sketched
scores (the report says how many rows are exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..distributed import current, gather_by_index
from ..setup.batches import length_order
from ..store.rows import FileRows
from .basis import inverse_norms, scaled_items
from .one_pass import OnePass, PassState, best_turns, features_of, item_parts, reference_of
from .row_pass import RefRows, exact_batches, norms_of
from .scoring import Combined, aggregate, rank, reference_rows
from .values import Basis, Exchanges, Scored, Scores

SHORTLIST_FIRST = 64  # the first round: this many rows (or the top-k) by their sketched ranking score
SHORTLIST_Z = 3.0  # a row left out could not reach the cut with every item's error this many spreads in its favour
SHORTLIST_ROUNDS = 8
ITEM_TOP = 3  # each item's top rows are scored exactly too (spans and the per-item lists start there)
CALIBRATION_MIN = 0.5  # the measured errors scale the predicted spread, down to half of it


@dataclass(frozen=True)
class ShortlistInfo:
    rows: int
    exact: int
    sketch_dim: int
    calibration: float  # rms of the exact rows' sketch errors over their predicted spread
    cut: float  # the top-k cut: the k-th best combined ranking score
    expected_missed: float
    top_k: int
    rounds: int
    store: str
    reference: int  # the distinct rows each item's median and scale are measured on (`scoring.reference_rows`)
    stored: int = 0  # rows scored from the exact gradients the store keeps (the reference rows), no backward

    def describe(self) -> dict:
        kept = (f"; {self.stored} from the exact gradients the store keeps of them, the others from one backward "
                f"each") if self.stored else ""
        rule = (f"the {self.reference} rows each item's median and scale are measured on and the rows whose ranking "
                f"score could reach the top-{self.top_k} cut with each item's sketch error "
                f"{SHORTLIST_Z:g} spreads in its favour were scored exactly ({self.exact} of {self.rows}, "
                f"{self.rounds} rounds{kept}); the others keep their sketched scores; were the errors normal with the "
                f"sketch's spread (its errors on the rows scored both ways were {self.calibration:.2f} of it), "
                f"{self.expected_missed:.2g} of the rows left out would belong in the top {self.top_k}")
        return {"mode": "per-row store of an earlier pass: shortlist scored exactly", "store": self.store,
                "unique_rows": self.rows, "exact_rows": self.exact, "stored_exact_rows": self.stored,
                "sketch_dim": self.sketch_dim,
                "shortlist": {"top_k": self.top_k, "cut": self.cut, "margin_spreads": SHORTLIST_Z,
                              "calibration": self.calibration, "rounds": self.rounds,
                              "expected_missed": self.expected_missed, "reference_rows": self.reference,
                              "rule": rule}}


@dataclass
class Rows:
    """Each distinct row's inner products with the unit queries [Q, n], its norm, its exchanges' parts."""

    inner: np.ndarray
    norms: np.ndarray
    parts: dict


def sketched(store, ps: PassState, n: int) -> tuple[Rows, np.ndarray]:
    """(every row's inner products estimated from the store's sketches: <u, g> = <a, b> |g|_w, and |a| of each
    query [Q]: the spread of a unit score's sketch error is about |a| / sqrt(k))."""
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
    return out, np.linalg.norm(a, axis=1)


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


def stored_rows(store, ps: PassState, ref: RefRows) -> Rows:
    """The reference rows scored exactly from the exact gradients the store keeps of them (the ref file): no
    backward; their exchanges alike."""
    shape = store.m["ref"]["shape"]
    rows = FileRows(store.exact_path("ref"), shape[1], n_file=shape[0])
    lay = ref.layout
    H = len(lay.positions)
    held = rows.subset(range(H))
    n = len(ps.plan.copies)
    out = Rows(np.zeros((ps.unit.shape[0], n), dtype=np.float32), np.zeros(n), {})
    pos = list(lay.positions)
    out.inner[:, pos], out.norms[pos] = held.inner(ps.unit), held.row_norms(ps.reducer.weights)
    if lay.owner:
        ex = rows.subset(range(H, lay.slots))
        out.parts.update(item_parts(ex.inner(ps.unit), ex.row_norms(ps.reducer.weights), lay.owner))
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
    keep = set(p)
    into.inner[:, p], into.norms[p] = got.inner[:, p], got.norms[p]
    into.parts.update({q: v for q, v in got.parts.items() if q in keep})


def _spread(rank_item: np.ndarray, amag: np.ndarray, norms: np.ndarray, exact: np.ndarray, k: int,
            settings) -> np.ndarray:
    """[Q, N]: each score's sketch error spread, sqrt((|a|^2 n^2 + s^2) / k) with n the row's norm (1 for unit
    rows); 0 for a row scored exactly."""
    n2 = 1.0 if settings.unit_rows else np.square(norms)[None, :]
    sig = np.sqrt((np.square(amag)[:, None] * n2 + np.square(rank_item)) / k)
    sig[:, exact] = 0.0
    return sig


def score_shortlist(grads, store, ps: PassState, settings, turns: Optional[Sequence], top_k: int
                    ) -> tuple[Scored, OnePass, ShortlistInfo]:
    """The scores of every row for a question the store's parts do not answer (module docstring)."""
    plan, n = ps.plan, len(grads.toks)
    copies = np.asarray(plan.copies)
    mixed, amag = sketched(store, ps, n)
    k, K = min(top_k, n), int(ps.reducer.score.k)
    exact: set[int] = set()
    _, rank_a, _, _ = _scores(mixed, plan, settings)
    comb = Combined(rank_a, _spread(rank_a, amag, mixed.norms[copies], np.zeros(n, bool), K, settings),
                    settings.combine)
    want = set(copies[rank(comb.score, max(SHORTLIST_FIRST, k))].tolist())
    reference = set(copies[reference_rows(n)].tolist())
    want |= reference  # every item's median and scale: exact, as in a full pass
    ref = reference_of(plan, turns, ps.width)  # those the pass kept the exact gradients of
    stored = 0
    if store.exact_path("ref") is not None and ref.layout.positions and ref.complete(store):
        got = stored_rows(store, ps, ref)
        _merge(mixed, got, ref.layout.positions)
        exact |= set(ref.layout.positions)
        stored = len(ref.layout.positions)
    calib, cut, rounds = 1.0, float("-inf"), 0
    while (want - exact or rounds == 0) and rounds < SHORTLIST_ROUNDS:
        new = sorted(want - exact)
        if new:
            _merge(mixed, exact_rows(grads, ps, new, turns), new)
        exact |= set(new)
        rounds += 1
        is_exact = np.isin(copies, list(exact))
        _, rank_m, _, _ = _scores(mixed, plan, settings)
        calib = max(CALIBRATION_MIN, _calibration(rank_a, rank_m, is_exact, amag, mixed.norms[copies], K, settings))
        comb = Combined(rank_m, calib * _spread(rank_m, amag, mixed.norms[copies], is_exact, K, settings),
                        settings.combine)
        order = rank(np.where(is_exact, comb.score, -np.inf))
        cut = float(comb.score[order[k - 1]]) if k and is_exact.sum() >= k else float("-inf")
        left = np.flatnonzero(~is_exact & (comb.upper(SHORTLIST_Z) >= cut))
        left = left[np.argsort(-comb.upper(SHORTLIST_Z)[left], kind="stable")][: max(SHORTLIST_FIRST, 2 * k)]
        want = exact | set(copies[left].tolist()) | {int(copies[r]) for row in rank_m for r in rank(row, ITEM_TOP)}
    per_item, rank_item, found, scale = _scores(mixed, plan, settings)
    is_exact = np.isin(copies, list(exact))
    missed = float(comb.exceed(cut)[~is_exact].sum()) if np.isfinite(cut) else float((~is_exact).sum())
    info = ShortlistInfo(len(plan.unique), len(exact), K, calib, cut, missed, k, rounds, str(store.root),
                         len(reference), stored)
    st = Scored(Scores(per_item, rank_item, aggregate(rank_item)),
                Basis(ps.unit, ps.qnorms, ps.pre, settings.direction, scale), exchanges=Exchanges(found))
    features, agree = _features(store, plan, n)
    return st, OnePass(plan, ps.width, features, agree, str(store.root), 0), info


def _calibration(rank_a: np.ndarray, rank_m: np.ndarray, is_exact: np.ndarray, amag: np.ndarray,
                 norms: np.ndarray, K: int, settings) -> float:
    """rms over the rows scored both ways of their sketch errors over the predicted spread (1 when none)."""
    if not is_exact.any():
        return 1.0
    sig = _spread(rank_a, amag, norms, np.zeros(is_exact.size, bool), K, settings)[:, is_exact]
    err = (rank_a - rank_m)[:, is_exact]
    ok = sig > 0
    return float(np.sqrt(np.mean(np.square(err[ok] / sig[ok])))) if ok.any() else 1.0


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
