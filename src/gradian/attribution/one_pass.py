"""Exact scores of every training row in one forward+backward pass per row, with no index.

The failing items are few, so their exact (parameter-space) query gradients are computed first; then each training
row's exact LoRA gradient is formed once, from one batched backward, and reduced on the spot to what scoring needs:
its inner product with every preconditioned unit query and its norm in the preconditioner's metric (unit rows).
No projection is fitted, no index is written and nothing is re-ranked: the scores are exact.

The preconditioner is fitted on the rows held in memory before the rest are streamed (`plan_pass`): every row when
(unique rows x exact width x 4 bytes) fits `memory_bytes` (then this is exactly the maths of an exact index: the
same rows, the same batches, the same bits), else a seeded sample of as many rows as fit, whose gradients are
scored from memory and never recomputed (the diagonal's per-coordinate second moment is then a sample mean over a
few hundred rows: a vanishing share of a 100k-row pass, and no pass of its own).

Conversations (`turns`): a chat row of several exchanges is also scored per exchange, from the same backward
(`grads.capture.Segments`: the part of the row's gradient that the exchange's positions contribute), each exchange
at unit norm in the preconditioner's metric, and ranked by its best exchange (`best_turns`): one planted reply
among benign ones is not diluted by the rest of its conversation. `per_item` stays the whole row's score (what spans add
up to). A held conversation's exchanges are held too, and count against `memory_bytes`.

Memory is `memory_bytes` for the held rows plus one batch and the [Q, D] directions: it does not grow with rows.
Under torchrun batch j is rank j % N's; held rows and streamed results are gathered so that every rank holds one
process's bits (`distributed.gather_by_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ..distributed import current, gather_by_index
from ..grads.capture import Segments
from ..grads.layout import exact_widths
from ..progress import progress_bar
from ..setup.batches import length_order, owned_batches
from ..store.rows import RowSource
from .precondition import Preconditioner
from .scoring import Scores, aggregate, harm_directions, item_scores, unit_queries

# The default budget of the rows held in memory (the preconditioner's sample): the size `grads.projection_dim: auto`
# allows an exact index on disk.
DEFAULT_HELD_BYTES = 2 << 30
HELD_MIN_ROWS = 64  # never fit a preconditioner on fewer rows than this when the rows exist


@dataclass(frozen=True)
class PassPlan:
    """Which rows a pass computes (one per distinct row content) and which of them it holds in memory."""

    unique: tuple[int, ...]  # the first position of each distinct row, by (length, position)
    held: tuple[int, ...]  # positions held in memory (every unique row, or a seeded sample of them), in length order
    # (the batches); the held array keeps them in position order (`held_positions`), the order an index reads
    streamed: tuple[int, ...]  # the other unique positions, in length order
    copies: tuple[int, ...]  # for every row, the unique position whose gradient it shares

    @property
    def all_held(self) -> bool:
        return not self.streamed

    @property
    def held_positions(self) -> list[int]:
        return sorted(self.held)


def plan_pass(toks, width: int, memory_bytes: int, seed: int, extra: Optional[Sequence[int]] = None) -> PassPlan:
    """Rows with the same content (`Tokenized.row_key`) are computed once; every unique row is held when they fit
    `memory_bytes` (float32; a row costs 1 + `extra[p]` vectors: its exchanges), else a seeded sample of
    max(HELD_MIN_ROWS, fitting) rows with supervised tokens."""
    first: dict = {}
    copies = []
    for p, t in enumerate(toks):
        copies.append(first.setdefault(t.row_key(), p))
    unique = length_order(toks, sorted(first.values()))
    cost = [1 + (int(extra[p]) if extra is not None else 0) for p in unique]
    per_row = max(float(np.mean(cost)), 1.0) if cost else 1.0
    fit = max(int(memory_bytes // max(4 * width * per_row, 1)), 0)
    if len(unique) <= fit:
        return PassPlan(tuple(unique), tuple(unique), (), tuple(copies))
    cand = [p for p in sorted(first.values()) if toks[p].n_supervised > 0]
    k = min(len(cand), max(HELD_MIN_ROWS, fit))
    pick = np.random.default_rng([int(seed), 0x68656C64]).choice(len(cand), size=k, replace=False)
    held = set(cand[j] for j in pick.tolist())
    return PassPlan(tuple(unique), tuple(p for p in unique if p in held),
                    tuple(p for p in unique if p not in held), tuple(copies))


@dataclass(frozen=True)
class Turns:
    """Per-exchange parts of some rows' gradients: `vecs[m]` is exchange `turn[m]` of row `owner[m]`."""

    owner: tuple[int, ...]  # row positions
    turn: tuple[int, ...]  # exchange index within its row
    vecs: np.ndarray  # float32 [M, D]


def position_turns(labels: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Per input position, the exchange of the token it predicts (the next one; the last position its own): the
    positions whose outputs carry an exchange's losses are that exchange's segment."""
    if labels is None:
        return None
    lab = np.asarray(labels, dtype=np.int64)
    return np.concatenate([lab[1:], lab[-1:]]) if lab.size else lab


def n_turns(labels: Optional[np.ndarray]) -> int:
    return 0 if labels is None or not len(labels) else int(np.max(labels)) + 1


def exact_batches(grads, positions: Sequence[int], label: str, turns: Optional[Sequence] = None
                  ) -> Iterator[tuple[int, list[int], np.ndarray, Optional[Turns]]]:
    """(batch index, positions, exact gradients float32 [B, D], the exchanges of its conversations or None) of
    this rank's batches of `positions` (in the order given), one batched backward each. `turns[p]`: row p's
    per-token exchange labels (`setup.alignment.token_exchanges`), None for a row scored whole."""
    toks = grads.toks
    exact = grads.exact()
    device = next(grads.model.parameters()).device
    with progress_bar(label, total=len(positions), split=True) as bar:
        for j, part, ids, attn, sup in owned_batches(toks, list(positions), grads.batch_size, grads.pad_id, device,
                                                     current().owns):
            labels = [None] * len(part) if turns is None else [position_turns(turns[p]) for p in part]
            if all(lab is None for lab in labels):
                vecs, _ = exact.vectors(ids, attn, sup)
                got = None
            else:
                seg = Segments.from_labels(labels, ids.shape[1], device)
                vecs, u, _ = exact.segment_vectors(ids, attn, sup, seg)
                got = Turns(tuple(part[b] for b in seg.owner.tolist()), tuple(seg.index),
                            u.detach().cpu().numpy().astype(np.float32, copy=False))
            yield j, part, vecs.detach().cpu().numpy().astype(np.float32, copy=False), got
            bar.advance(len(part))


def held_rows(grads, plan: PassPlan, turns: Optional[Sequence] = None) -> tuple[np.ndarray, Optional[Turns]]:
    """(float32 [len(plan.held), D]: the held rows' exact gradients in position order (`plan.held_positions`), the
    held conversations' exchanges in the same order or None), on every rank."""
    out = np.empty((len(plan.held), grads.exact_width), dtype=np.float32)
    row = {p: i for i, p in enumerate(plan.held_positions)}
    owner = [p for p in plan.held_positions for _ in range(n_turns(None if turns is None else turns[p]))]
    at = {}
    for m, p in enumerate(owner):
        at.setdefault(p, m)
    tv = np.empty((len(owner), grads.exact_width), dtype=np.float32) if owner else None

    def put(part, v, t: Optional[Turns]):
        out[[row[p] for p in part]] = v
        if t is not None:
            tv[[at[o] + k for o, k in zip(t.owner, t.turn)]] = t.vecs

    if not current().active:
        # one process: each batch goes straight into its rows (no second copy of the held rows, whose size is
        # the pass's memory budget)
        for _, part, v, t in exact_batches(grads, plan.held, "gradients (held)", turns):
            put(part, v, t)
    else:
        got = gather_by_index({j: (part, v, t) for j, part, v, t in
                               exact_batches(grads, plan.held, "gradients (held)", turns)})
        for j in sorted(got):
            put(*got[j])
    if tv is None:
        return out, None
    turn = [m - at[p] for m, p in enumerate(owner)]
    return out, Turns(tuple(owner), tuple(turn), tv)


def fit_on(kind, damping: Optional[float], rows: RowSource, widths: Sequence[int]) -> Preconditioner:
    """`attribution.preconditioner` fitted on `rows` (exact layout: one block per LoRA site)."""
    p = Preconditioner(kind, damping, list(widths))
    if p.is_identity:
        return p.fit(RowSource(np.zeros((0, rows.dim), dtype=np.float32)))
    return p.fit(rows)


def preconditioned_units(q: np.ndarray, pre: Preconditioner) -> tuple[np.ndarray, np.ndarray]:
    """(unit preconditioned queries float32 [Q, D], their norms before scaling), as `scoring.score` makes them."""
    if pre.is_identity:
        return unit_queries(q), np.linalg.norm(np.asarray(q, dtype=np.float32), axis=1)
    qp = pre.apply(q)
    return unit_queries(qp), np.linalg.norm(qp, axis=1)


def _norms(v: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    sq = np.square(np.asarray(v, dtype=np.float64))
    return np.sqrt((sq @ weights) if weights is not None else sq.sum(1))


def unit_sketch(sketch, rows: np.ndarray) -> np.ndarray:
    """float32 [n, k]: the rows at unit norm, sketched, renormalised (what `explain.clusters.unit_rows` computes
    with a sketch), so clusters of streamed rows are found as they would be from an index."""
    return _unit(sketch.apply(_unit(np.asarray(rows, dtype=np.float32))))


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(n > 0, n, 1.0)).astype(np.float32)


def streamed_inner(grads, positions: Sequence[int], unit: np.ndarray, weights: Optional[np.ndarray],
                   sketch=None, turns: Optional[Sequence] = None
                   ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], dict]:
    """(inner [Q, n] float32, norms [n] float64, sketches [n, k] or None, {position: (inner [Q, U], norms [U]) of
    its exchanges}) of the rows at `positions`, from one backward per batch; no gradient is kept past its batch."""
    got, tgot = {}, {}
    for j, part, v, t in exact_batches(grads, positions, "gradients (scored)", turns):
        sk = None if sketch is None else unit_sketch(sketch, v)
        got[j] = (part, unit @ v.T, _norms(v, weights), sk)
        if t is not None:
            tgot[j] = turn_parts(t, unit, weights)
    if current().active:
        got = gather_by_index(got)
        tgot = gather_by_index(tgot)
    per_turn = {p: x for j in sorted(tgot) for p, x in tgot[j].items()}
    n = len(positions)
    inner = np.zeros((unit.shape[0], n), dtype=np.float32)
    norms = np.zeros(n)
    sk_out = None if sketch is None else np.zeros((n, sketch.k), dtype=np.float32)
    at = 0
    for j in sorted(got):
        part, ip, nm, sk = got[j]
        inner[:, at : at + len(part)] = ip
        norms[at : at + len(part)] = nm
        if sk_out is not None:
            sk_out[at : at + len(part)] = sk
        at += len(part)
    return inner, norms, sk_out, per_turn


TURN_CHUNK = 32  # exchange vectors reduced at a time (their float64 squares are a copy of the chunk)


def turn_parts(t: Turns, unit: np.ndarray, weights: Optional[np.ndarray]) -> dict:
    """{row position: (inner [Q, U] float32, norms [U] float64)} of its exchanges, in exchange order."""
    M = t.vecs.shape[0]
    ip = np.zeros((unit.shape[0], M), dtype=np.float32)
    nm = np.zeros(M)
    for a in range(0, M, TURN_CHUNK):
        v = t.vecs[a : a + TURN_CHUNK]
        ip[:, a : a + v.shape[0]] = unit @ v.T
        nm[a : a + v.shape[0]] = _norms(v, weights)
    out: dict = {}
    for m, p in enumerate(t.owner):
        out.setdefault(p, []).append(m)
    return {p: (ip[:, ms], nm[ms]) for p, ms in out.items()}


def best_turns(per_item: np.ndarray, parts: dict, direction: str, copies: Sequence[int]) -> tuple[np.ndarray, dict]:
    """(rank_item [Q, N]: per_item with each conversation's column replaced by each item's best exchange's unit
    score, {row: {"best": [Q] each item's best exchange, "scores": [Q, U] unit scores}}).

    Each item takes its own best exchange (the aggregate is the mean of those): one conversation can hold the cause
    of some items in one reply and of others in another, and a planted reply usually explains a few of the failing
    items only. Measured against one exchange for all items (the max over exchanges of the mean): smol_multiturn
    AUPRC 0.824 against 0.794, smol_multiturn_refusal 0.820 against 0.823 (bench/README.md)."""
    rank_item = per_item.copy()
    found = {}
    for r, c in enumerate(copies):
        if c not in parts:
            continue
        ip, nm = parts[c]
        sc = item_scores(ip, direction) * np.where(nm > 0, 1.0 / np.maximum(nm, 1e-300), 0.0)[None, :]
        rank_item[:, r] = sc.max(axis=1).astype(rank_item.dtype)
        found[r] = {"best": sc.argmax(axis=1).astype(np.int64), "scores": sc.astype(np.float32)}
    return rank_item, found


@dataclass(frozen=True)
class OnePass:
    """What one pass yields besides the scores: the rows it held (the preconditioner's sample; every row when
    `plan.all_held`) and, when not every row was held, a unit CountSketch of every row (the clusters' features)."""

    plan: PassPlan
    held: RowSource
    sketches: Optional[np.ndarray]

    def cluster_features(self, n: int):
        """What `explain.clusters` groups rows on: the exact rows (a RowSource in training order) when held, else
        the rows' sketches."""
        if self.plan.all_held:
            where = {p: j for j, p in enumerate(self.plan.held_positions)}
            pick = [where[c] for c in self.plan.copies]
            # no copy of the rows when each is its own (no duplicated content): they are already in training order
            return self.held if pick == list(range(self.held.n)) else self.held.subset(pick)
        return self.sketches

    def describe(self) -> dict:
        return {"mode": "one pass, exact scores (no index)", "unique_rows": len(self.plan.unique),
                "held_rows": len(self.plan.held), "streamed_rows": len(self.plan.streamed),
                "width": int(self.held.dim),
                "preconditioner_rows": "every row" if self.plan.all_held else
                f"a seeded sample of {len(self.plan.held)} rows held in memory"}


def score_one_pass(grads, qitems, settings, *, memory_bytes: int = DEFAULT_HELD_BYTES,
                   sketch_dim: Optional[int] = None, turns: Optional[Sequence] = None) -> tuple[Scores, OnePass]:
    """Per-item exact scores [Q, N] of every row (`Scores`, in the exact layout: `w` and `unit` are [Q, D_exact])
    from the exact query gradients and one backward per distinct row. `turns[p]`: row p's per-token exchange
    labels (None: scored whole); used with unit rows only (a raw score is the sum of its exchanges')."""
    toks = grads.toks
    widths = exact_widths(grads.sites)
    width = int(sum(widths))
    if turns is not None and (not settings.unit_rows or all(t is None for t in turns)):
        turns = None
    plan = plan_pass(toks, width, memory_bytes, settings.seed,
                     None if turns is None else [n_turns(t) for t in turns])
    q = grads.query_vectors(qitems, exact=True)
    held_arr, held_turns = held_rows(grads, plan, turns)
    held = RowSource(held_arr)
    pre = fit_on(settings.preconditioner, settings.damping, held, widths)
    unit, qnorms = preconditioned_units(q, pre)
    weights = pre.metric_weights()
    Q = unit.shape[0]
    inner_u = np.zeros((Q, len(toks)), dtype=np.float32)
    norms_u = np.zeros(len(toks))
    h_idx = plan.held_positions
    inner_u[:, h_idx] = held.inner(unit)
    norms_u[h_idx] = held.row_norms(weights)
    parts = {} if held_turns is None else turn_parts(held_turns, unit, weights)
    sketches = None
    if plan.streamed:
        from ..explain.clusters import SKETCH_DIM, CountSketch

        sketch = CountSketch(width, sketch_dim or SKETCH_DIM, settings.seed)
        s_idx = list(plan.streamed)
        ip, nm, sk, tp = streamed_inner(grads, s_idx, unit, weights, sketch, turns)
        inner_u[:, s_idx], norms_u[s_idx] = ip, nm
        parts.update(tp)
        sketches = np.zeros((len(toks), sketch.k), dtype=np.float32)
        sketches[s_idx] = sk
        for a, b, rows in held.chunks():
            sketches[h_idx[a:b]] = unit_sketch(sketch, rows)
    copies = list(plan.copies)
    inner, norms = inner_u[:, copies], norms_u[copies]
    if sketches is not None:
        sketches = sketches[copies]
    per_item = item_scores(inner, settings.direction)
    scale = None
    if settings.unit_rows:
        scale = np.where(norms > 0, 1.0 / np.maximum(norms, 1e-300), 0.0)
        per_item = (per_item * scale[None, :]).astype(per_item.dtype)
    rank_item, found = best_turns(per_item, parts, settings.direction, copies) if parts else (per_item, {})
    sc = Scores(per_item=per_item, w=harm_directions(unit, settings.direction), unit=unit, norms=qnorms,
                precond=pre, rank_item=rank_item, rank_agg=aggregate(rank_item), row_scale=scale, turns=found)
    return sc, OnePass(plan, held, sketches)
