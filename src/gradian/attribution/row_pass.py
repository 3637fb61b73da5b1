"""The rows' side of the one pass (`attribution.one_pass`): exact gradients batch by batch, the held rows written to
the per-row store's held file (what the preconditioner is fitted on, read back in chunks: never in memory at
once), and every row reduced on the spot to a part of the store (`store.rowstore`): its inner products with the
unit queries, its norm in the preconditioner's metric, a sketch of its unit row in that metric (a later question
shortlists by it, `attribution.shortlist`) and a unit CountSketch (what clusters group on).

Batches are formed as always (`setup.batches.owned_batches`: by length, then position), cut where they would hold
more padded tokens than one backward may (`ModelGradients.max_batch_tokens`, `grads.budget`: long conversations),
so a pass resumed from the store recomputes exactly the batches it lacks and every row keeps its bits. Under
torchrun batch j is rank j % N's and the results are gathered, so every rank holds one process's bits
(`distributed.gather_by_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ..checks.convergence import Agreement
from ..distributed import current, gather_by_index
from ..explain.clusters import SKETCH_DIM, CountSketch
from ..grads.capture import Segments
from ..progress import progress_bar
from ..setup.batches import length_order, owned_batches
from ..store.rows import FileRows

# The store's sketch of each unit row in the preconditioner's metric (float16 on disk: 64 KB a row). A later question's
# score of a row is read from it with an error of spread about |u / sqrt(w)| / sqrt(k): measured on smol_indirect
# (SmolLM2, 2.4M dims), 4,096 left 2.4 robust-z units of error on the combined ranking score and 32,768 0.9
# (the true top 50 of 300 rows within the top 123 / 64 by sketch).
STORE_SKETCH_DIM = 32768
STORE_SKETCH_SALT = 0x5C0E  # its seed is the run's seed plus this (the clusters' sketch uses the seed itself)
PART_BATCHES = 8  # batches per part of the store (a killed pass loses at most this many)
TURN_CHUNK = 32  # exchange vectors reduced at a time (their float64 squares are a copy of the chunk)


@dataclass(frozen=True)
class Turns:
    """Per-exchange parts of some rows' gradients: `vecs[m]` is exchange `turn[m]` of row `owner[m]`."""

    owner: tuple[int, ...]  # row positions
    turn: tuple[int, ...]  # exchange index within its row
    vecs: object  # float32 [M, D] (an array, or a `FileRows` over the store's held file)


def position_turns(labels: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Per input position, the exchange of the token it predicts (the next one; the last position its own): the
    positions whose outputs carry an exchange's losses are that exchange's segment."""
    if labels is None:
        return None
    lab = np.asarray(labels, dtype=np.int64)
    return np.concatenate([lab[1:], lab[-1:]]) if lab.size else lab


def n_turns(labels: Optional[np.ndarray]) -> int:
    return 0 if labels is None or not len(labels) else int(np.max(labels)) + 1


def exact_batches(grads, positions: Sequence[int], label: str, turns: Optional[Sequence] = None,
                  skip: frozenset = frozenset()) -> Iterator[tuple[int, list[int], np.ndarray, Optional[Turns]]]:
    """(batch index, positions, exact gradients float32 [B, D], the exchanges of its conversations or None) of
    this rank's batches of `positions` (in the order given), one batched backward each; batches in `skip` (done
    already) are passed over. `turns[p]`: row p's per-token exchange labels (`setup.alignment.token_exchanges`),
    None for a row scored whole."""
    toks = grads.toks
    exact = grads.exact()
    device = next(grads.model.parameters()).device
    with progress_bar(label, total=len(positions), split=True) as bar:
        for j, part, ids, attn, sup in owned_batches(toks, list(positions), grads.batch_size, grads.pad_id, device,
                                                     current().owns, max_tokens=grads.max_batch_tokens):
            if j in skip:
                bar.advance(len(part))
                continue
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


def gradient_norms(grads) -> tuple[np.ndarray, Optional[tuple[float, int]]]:
    """A smoke test's pass (no eval set, so no query to score against): float64 [N] each row's squared exact
    gradient norm (the rows most unlike the rest come first), and the rows' gradient agreement
    (`checks.convergence.gradient_agreement`), from one streamed pass over the rows, batch by batch; nothing is
    kept and no index is built. Under torchrun each rank computes its batches and the results are gathered."""
    sq: dict[int, tuple[list[int], np.ndarray]] = {}
    agree = Agreement()
    for j, part, v, _ in exact_batches(grads, length_order(grads.toks), "gradients (smoke test)"):
        v = v.astype(np.float64)
        sq[j] = (part, np.einsum("ij,ij->i", v, v))
        agree.add(v)
    out = np.zeros(len(grads.toks), dtype=np.float64)
    for part, s in gather_by_index(sq).values():
        out[part] = s
    return out, Agreement.merged(gather_by_index({current().rank: agree}).values()).result()


def norms_of(v: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
    """float64 [n]: each row's norm in the metric `weights` (None: Euclidean)."""
    sq = np.asarray(v).astype(np.float64)  # a copy, squared in place: one [n, D] float64 array, not two
    np.square(sq, out=sq)
    return np.sqrt((sq @ weights) if weights is not None else sq.sum(1))


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(n > 0, n, 1.0)).astype(np.float32)


@dataclass
class Reducer:
    """What every row is reduced to: inner products with the unit queries `unit` [Q, D], its norm in the metric
    `weights`, the clusters' unit CountSketch and the store's sketch of its unit row in the metric (the unit row
    sqrt(w) g / |g|_w: a later question's score of the row is <unit / sqrt(w), that row>, `attribution.shortlist`).
    Both sketches come from one sparse product with the rows (`fused`: the metric's sqrt(w) folded into the second
    sketch's signs), in float32."""

    unit: np.ndarray
    weights: Optional[np.ndarray]
    cluster: CountSketch
    score: CountSketch
    _fused: object = None

    @classmethod
    def make(cls, unit, weights, width: int, seed: int, sketch_dim: Optional[int] = None) -> "Reducer":
        return cls(unit, weights, CountSketch(width, sketch_dim or SKETCH_DIM, seed),
                   CountSketch(width, STORE_SKETCH_DIM, seed + STORE_SKETCH_SALT))

    def fused(self):
        """The sparse [D, k_cluster + k_store] matrix of both sketches (float32)."""
        if self._fused is None:
            from scipy.sparse import csr_matrix

            bc, sc = self.cluster.hashes()
            bm, sm = self.score.hashes()
            if self.weights is not None:
                sm = sm * np.sqrt(self.weights)
            D = bc.size
            rows = np.concatenate([np.arange(D), np.arange(D)])
            vals = np.concatenate([sc, sm]).astype(np.float32)
            self._fused = csr_matrix((vals, (rows, np.concatenate([bc, self.cluster.k + bm]))),
                                     shape=(D, self.cluster.k + self.score.k))
        return self._fused

    def sketches(self, v: np.ndarray, norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [n, k_cluster]: each row's unit CountSketch, renormalised, as `explain.clusters.unit_rows`
        sketches; float16 [n, k_store]: the store's sketch of each unit row in the metric, zero rows 0)."""
        z = np.asarray(np.asarray(v, dtype=np.float32) @ self.fused())
        kc = self.cluster.k
        metric = z[:, kc:] / np.where(norms > 0, norms, 1.0)[:, None].astype(np.float32)
        return _unit(z[:, :kc]), metric.astype(np.float16)

    def rows(self, positions: Sequence[int], v: np.ndarray) -> dict:
        """A part's arrays for rows `positions` with exact gradients `v` (float32 [B, D])."""
        nm = norms_of(v, self.weights)
        cl, sk = self.sketches(v, nm)
        return {"positions": np.asarray(positions, dtype=np.int64), "inner": self.unit @ v.T, "norms": nm,
                "cluster": cl, "sketch": sk}

    def exchanges(self, t: Turns) -> dict:
        """A part's arrays of the exchanges `t` (in its order), reduced `TURN_CHUNK` at a time."""
        M = len(t.owner)
        ip = np.zeros((self.unit.shape[0], M), dtype=np.float32)
        nm = np.zeros(M)
        sk = np.zeros((M, self.score.k), dtype=np.float16)
        for a in range(0, M, TURN_CHUNK):
            b = min(M, a + TURN_CHUNK)
            v = t.vecs.read32(a, b) if isinstance(t.vecs, FileRows) else t.vecs[a:b]
            ip[:, a:b] = self.unit @ v.T
            nm[a:b] = norms_of(v, self.weights)
            sk[a:b] = self.sketches(v, nm[a:b])[1]
        return {"t_owner": np.asarray(t.owner, dtype=np.int64), "t_turn": np.asarray(t.turn, dtype=np.int64),
                "t_inner": ip, "t_norms": nm, "t_sketch": sk}


# ------------------------------------------------------------------------------------------------ held rows


@dataclass(frozen=True)
class HeldLayout:
    """Where the held rows and their exchanges sit in the held file: rows in position order, then each held
    conversation's exchanges (position order, exchange order)."""

    positions: tuple[int, ...]
    owner: tuple[int, ...]  # per exchange slot, its row
    turn: tuple[int, ...]

    @classmethod
    def of(cls, held_positions: Sequence[int], turns: Optional[Sequence]) -> "HeldLayout":
        owner, turn = [], []
        for p in held_positions:
            k = n_turns(None if turns is None else turns[p])
            owner += [p] * k
            turn += list(range(k))
        return cls(tuple(held_positions), tuple(owner), tuple(turn))

    @property
    def slots(self) -> int:
        return len(self.positions) + len(self.owner)

    def slots_of(self, part: Sequence[int], t: Optional[Turns]) -> list[int]:
        row = {p: i for i, p in enumerate(self.positions)}
        at: dict = {}
        for m, p in enumerate(self.owner):
            at.setdefault(p, m)
        out = [row[p] for p in part]
        if t is not None:
            out += [len(self.positions) + at[o] + k for o, k in zip(t.owner, t.turn)]
        return out


def write_held(grads, store, held: Sequence[int], layout: HeldLayout, turns: Optional[Sequence]) -> None:
    """The held rows' exact gradients (and their conversations' exchanges) into the store's held file, batch by
    batch; batches the store holds already are skipped."""
    batches = exact_batches(grads, held, "gradients (held)", turns, skip=frozenset(store.held_done()))

    def put(j, part, v, t):
        store.put_held(j, layout.slots_of(part, t), v if t is None else np.concatenate([v, t.vecs]))

    if not current().active:
        for j, part, v, t in batches:
            put(j, part, v, t)
        return
    got = gather_by_index({j: (part, v, t) for j, part, v, t in batches})
    for j in sorted(got):
        put(j, *got[j])


def held_part(reducer: Reducer, rows: FileRows, layout: HeldLayout, batch: int) -> dict:
    """The held rows' part of the store, from the held file: the inner products in blocks (`FileRows.inner`: one
    matmul when they fit), norms and sketches chunk by chunk, their exchanges `TURN_CHUNK` at a time."""
    H = len(layout.positions)
    held = rows.subset(range(H))
    nm = held.row_norms(reducer.weights)
    cl = np.zeros((H, reducer.cluster.k), dtype=np.float32)
    sk = np.zeros((H, reducer.score.k), dtype=np.float16)
    for a in range(0, H, batch):
        b = min(H, a + batch)
        cl[a:b], sk[a:b] = reducer.sketches(held.read32(a, b), nm[a:b])
    out = {"positions": np.asarray(layout.positions, dtype=np.int64), "inner": held.inner(reducer.unit),
           "norms": nm, "cluster": cl, "sketch": sk}
    if layout.owner:
        vecs = rows.subset(range(H, layout.slots))
        out.update(reducer.exchanges(Turns(layout.owner, layout.turn, vecs)))
    return out


@dataclass(frozen=True)
class RefRows:
    """The reference rows' exact gradients (`scoring.reference_rows`: what each item's median and scale are measured
    on) in the store's ref file, laid out as the held file (`HeldLayout`): written as the pass computes them, so a
    later question scores them without a backward (`attribution.shortlist`)."""

    layout: HeldLayout
    members: frozenset  # layout.positions, for membership

    @classmethod
    def of(cls, positions: Sequence[int], turns: Optional[Sequence]) -> "RefRows":
        rows = sorted(set(int(p) for p in positions))
        return cls(HeldLayout.of(rows, turns), frozenset(rows))

    def complete(self, store) -> bool:
        return store.exact_slots("ref") >= set(range(self.layout.slots))

    def put(self, store, name: str, part: Sequence[int], v: np.ndarray, t: Optional[Turns]) -> None:
        """Batch `name`'s reference rows (rows `part`, gradients `v`, exchanges `t`) into the ref file."""
        mine = self.members
        keep = [i for i, p in enumerate(part) if p in mine]
        if not keep or name in store.exact_done("ref"):
            return
        rows = [part[i] for i in keep]
        vecs = [np.asarray(v)[keep]]
        sel = None
        if t is not None:
            ms = [m for m, o in enumerate(t.owner) if o in mine]
            sel = Turns(tuple(t.owner[m] for m in ms), tuple(t.turn[m] for m in ms), None)
            if ms:
                vecs.append(np.asarray(t.vecs)[ms])
        store.put_exact("ref", name, self.layout.slots_of(rows, sel if sel is not None and sel.owner else None),
                        np.concatenate(vecs) if len(vecs) > 1 else vecs[0])

    def copy_held(self, store, held: FileRows, held_layout: HeldLayout, chunk: int) -> None:
        """The held reference rows (and their exchanges), from the held file, `chunk` rows at a time."""
        held_set = set(held_layout.positions)
        both = [p for p in self.layout.positions if p in held_set]
        at: dict = {}
        for m, o in enumerate(held_layout.owner):
            at.setdefault(o, []).append(m)
        for a in range(0, len(both), max(chunk, 1)):
            rows = both[a: a + chunk]
            name = f"h{a}"
            if name in store.exact_done("ref"):
                continue
            ms = [m for p in rows for m in at.get(p, [])]
            t = Turns(tuple(held_layout.owner[m] for m in ms), tuple(held_layout.turn[m] for m in ms), None)
            src = held_layout.slots_of(rows, t if ms else None)
            store.put_exact("ref", name, self.layout.slots_of(rows, t if ms else None),
                            held.subset(src).read32(0, len(src)))


def streamed_parts(grads, store, reducer: Reducer, streamed: Sequence[int], turns: Optional[Sequence],
                   ref: Optional[RefRows] = None) -> None:
    """The streamed rows reduced batch by batch into parts of `PART_BATCHES` batches (a part the store holds is
    not computed again); no gradient is kept past its batch, but the reference rows' (`ref`), written to the
    store's ref file."""
    done = store.done()
    n_batches = len(grads.parts(streamed))
    groups = [list(range(g, min(n_batches, g + PART_BATCHES))) for g in range(0, n_batches, PART_BATCHES)]
    skip = frozenset(j for g in groups if f"s{g[0]}" in done for j in g)
    got: dict = {}
    for j, part, v, t in exact_batches(grads, streamed, "gradients (scored)", turns, skip=skip):
        if ref is not None:
            ref.put(store, f"s{j}", part, v, t)
        got[j] = reducer.rows(part, v), (reducer.exchanges(t) if t is not None else None)
        if not current().active:
            got = _flush(store, got, groups, done)
    if current().active:
        got = gather_by_index(got)
    _flush(store, got, groups, done)


def _flush(store, got: dict, groups: list[list[int]], done: set) -> dict:
    """Write every group whose batches are all computed; returns the batches left."""
    for g in groups:
        name = f"s{g[0]}"
        if name in done or not all(j in got for j in g):
            continue
        rows = [got.pop(j) for j in g]
        part = {k: np.concatenate([r[k] for r, _ in rows], axis=1 if k == "inner" else 0) for k in rows[0][0]}
        ex = [e for _, e in rows if e is not None]
        if ex:
            part.update({k: np.concatenate([e[k] for e in ex], axis=1 if k == "t_inner" else 0) for k in ex[0]})
        store.put_part(name, part)
        done.add(name)
    return got
