"""Exact scores of every training row in one forward+backward pass per row, with no index; the pass leaves a per-row
store behind it (`store.rowstore`).

The failing items are few, so their exact (parameter-space) query gradients are computed first; then each training
row's exact LoRA gradient is formed once, from one batched backward, and reduced on the spot to what scoring needs
(`attribution.row_pass`): its inner product with every preconditioned unit query and its norm in the
preconditioner's metric (unit rows), with two sketches of it for later. No projection is fitted and nothing is
re-ranked: the scores are exact.

The preconditioner is fitted on the held rows before the rest are streamed (`plan_pass`): every row when (unique
rows x exact width x 4 bytes) fits `memory_bytes` (then this is exactly the maths of an exact index: the same rows,
the same batches, the same bits), else a seeded sample of as many rows as fit, whose gradients are scored from the
held file and never recomputed (the diagonal's per-coordinate second moment is then a sample mean over a few
hundred rows: a vanishing share of a 100k-row pass, and no pass of its own). The held rows go to the store's held
file as they are computed and are read back in chunks: `memory_bytes` is disk, not memory.

Conversations (`turns`): a chat row of several exchanges is also scored per exchange, from the same backward
(`grads.capture.Segments`: the part of the row's gradient that the exchange's positions contribute), each exchange
at unit norm in the preconditioner's metric, and ranked by its best exchange (`best_turns`): one planted reply
among benign ones is not diluted by the rest of its conversation. `per_item` stays the whole row's score (what spans
add up to). A held conversation's exchanges are held too, and count against `memory_bytes`.

The store: every part is written as its batches finish, so a pass killed at any point resumes from the parts and
held batches the store names, recomputing the same batches (the same bits); a rerun of the same question reads
every score back; a later question on a finished store is `attribution.shortlist`'s. A kept store keeps exact
gradients for that later question: the held file when it holds every row (the later question is then this pass
again, from disk), else the reference rows' (`scoring.reference_rows`, the ref file: written as the streamed
batches compute them, and copied from the held file before it goes). Without a kept store (a
preconditioner that reads its rows at every use, torchrun) the pass writes the same files to a temporary one.
Memory is one batch, one chunk of held rows and the [Q, D] unit queries: it does not grow with rows.
"""

from __future__ import annotations

import hashlib
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from ..checks.convergence import gradient_agreement
from ..grads.layout import exact_widths
from ..setup.batches import length_order
from ..store.rows import FileRows, RowSource
from ..store.rowstore import RowStore
from .basis import fit_preconditioner, inverse_norms, preconditioned_units, scaled_items
from .precondition import restore
from .row_pass import HeldLayout, Reducer, RefRows, held_part, n_turns, streamed_parts, write_held
from .scoring import aggregate, item_scores, reference_rows
from .values import Basis, Exchanges, Scored, Scores

# The default budget of the held rows (the preconditioner's sample, on disk): the size `grads.projection_dim: auto`
# allows an exact index on disk.
DEFAULT_HELD_BYTES = 2 << 30
# The disk a kept store gives the reference rows' exact gradients (`reference_of`): 256 rows of SmolLM2-135M at rank 8
# on every projection (2.4M dims) are 2.5 GB. Beyond it, the first reference rows that fit are kept and a later
# question differentiates the others (an 8B model's 42M dims: 25 rows).
REF_BYTES = 4 << 30
HELD_MIN_ROWS = 64  # never fit a preconditioner on fewer rows than this when the rows exist


@dataclass(frozen=True)
class PassPlan:
    """Which rows a pass computes (one per distinct row content) and which of them it holds."""

    unique: tuple[int, ...]  # the first position of each distinct row, by (length, position)
    held: tuple[int, ...]  # positions held (every unique row, or a seeded sample of them), in length order
    # (the batches); the held file keeps them in position order (`held_positions`), the order an index reads
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


def item_parts(inner: np.ndarray, norms: np.ndarray, owner: Sequence[int]) -> dict:
    """{row position: (inner [Q, U] float32, norms [U] float64) of its exchanges}, in the order listed."""
    out: dict = {}
    for m, p in enumerate(owner):
        out.setdefault(int(p), []).append(m)
    return {p: (inner[:, ms], norms[ms]) for p, ms in out.items()}


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
        sc = item_scores(ip, direction) * inverse_norms(nm)[None, :]
        rank_item[:, r] = sc.max(axis=1).astype(rank_item.dtype)
        found[r] = {"best": sc.argmax(axis=1).astype(np.int64), "scores": sc.astype(np.float32)}
    return rank_item, found


@dataclass(frozen=True)
class OnePass:
    """What one pass yields besides the scores: its plan, what clusters group rows on (the exact rows when every row
    was held, else a unit CountSketch of each row), the held rows' gradient agreement (`train.not_converged`),
    and the store it left."""

    plan: PassPlan
    width: int
    features: object
    agreement: Optional[tuple]
    store: Optional[str]  # the store's directory (None: a temporary one, gone)
    reused: int = 0  # rows whose scores were read back from the store

    def describe(self) -> dict:
        out = {"mode": "one pass, exact scores (no index)", "unique_rows": len(self.plan.unique),
               "held_rows": len(self.plan.held), "streamed_rows": len(self.plan.streamed), "width": int(self.width),
               "preconditioner_rows": "every row" if self.plan.all_held else
               f"a seeded sample of {len(self.plan.held)} rows, held on disk while the pass runs"}
        return out


def question_key(unit: np.ndarray) -> str:
    """What a store's inner products answer: the unit (preconditioned) queries' bytes."""
    u = np.ascontiguousarray(unit, dtype=np.float32)
    return hashlib.sha256(repr(u.shape).encode() + u.tobytes()).hexdigest()[:24]


@contextmanager
def opened(root: Optional[Path], key: str, meta: dict) -> Iterator[RowStore]:
    """The store at `root`, or a temporary one (removed afterwards) when none is kept."""
    if root is not None:
        with RowStore.open(root, key=key, meta=meta) as st:
            yield st
        return
    with tempfile.TemporaryDirectory(prefix="gradian-rows-") as tmp:
        with RowStore.open(Path(tmp), key=key, meta=meta) as st:
            yield st


@dataclass
class PassState:
    """A pass at the point its questions are known: the plan, where the held rows sit, the fitted preconditioner,
    the unit queries and their norms, what rows are reduced to, the question's key (`question_key`)."""

    plan: PassPlan
    layout: HeldLayout
    width: int
    pre: object
    unit: np.ndarray
    qnorms: np.ndarray
    reducer: Reducer
    qkey: str
    held: Optional[FileRows] = None  # the held file, when this pass wrote or read it


def prepare(grads, qitems, settings, store: RowStore, turns: Optional[Sequence], *,
            memory_bytes: Optional[int] = None, sketch_dim: Optional[int] = None) -> PassState:
    """The plan, the exact query gradients, the preconditioner (the store's when it has one, its bits; else fitted
    on the held rows, computed into the store's held file), the unit queries."""
    widths = exact_widths(grads.sites)
    width = int(sum(widths))
    memory_bytes = DEFAULT_HELD_BYTES if memory_bytes is None else memory_bytes
    plan = plan_pass(grads.toks, width, memory_bytes, settings.seed,
                     None if turns is None else [n_turns(t) for t in turns])
    layout = HeldLayout.of(plan.held_positions, turns)
    q = grads.query_vectors(qitems, exact=True)
    state = store.preconditioner_state() or None
    held = None
    if state is None:
        held = _held(grads, store, plan, layout, turns, width)
        pre = fit_preconditioner(settings.preconditioner, settings.damping, held.subset(range(len(plan.held))),
                                 widths)
    else:  # a resumed pass, a rerun or a later question: the preconditioner the pass fitted, its bits
        pre = restore(state)
    unit, qnorms = preconditioned_units(q, pre)
    reducer = Reducer.make(unit, pre.metric_weights(), width, settings.seed, sketch_dim)
    return PassState(plan, layout, width, pre, unit, qnorms, reducer, question_key(unit), held)


def run_pass(grads, store: RowStore, ps: PassState, settings, turns: Optional[Sequence], keep: bool
             ) -> tuple[Scored, OnePass]:
    """Every row the store lacks for this question computed and reduced into it (the held rows' part from the held
    file, the others batch by batch), then the scores of every row from the store's parts."""
    plan = ps.plan
    reused = sum(int(p["rows"]) for p in store.m["parts"]) if store.question == ps.qkey else 0
    if store.question != ps.qkey or store.m["precond"] is None:
        store.save_preconditioner(ps.pre.state() if ps.pre.storable else {}, ps.qkey)  # drops another's parts
    if "h" not in store.done():
        held = ps.held or _held(grads, store, plan, ps.layout, turns, ps.width)
        part = held_part(ps.reducer, held, ps.layout, grads.batch_size)
        agree = gradient_agreement(c for _, _, c in held.subset(range(len(plan.held))).chunks())
        part["agreement"] = np.asarray(agree if agree is not None else (np.nan, 0), dtype=np.float64)
        store.put_part("h", part)
    ref = reference_of(plan, turns, ps.width) if keep and not plan.all_held else None
    if ref is not None and not ref.layout.positions:  # not one reference row fits REF_BYTES
        ref = None
    if ref is not None:
        store.exact_file("ref", ref.layout.slots, ps.width)
    streamed_parts(grads, store, ps.reducer, plan.streamed, turns, ref)
    st, features, agree = assemble(store, plan, ps.unit, ps.qnorms, ps.pre, settings, len(grads.toks), keep)
    if not store.sealed:
        if ref is not None and not ref.complete(store):  # the held reference rows, copied before the held file goes
            held = ps.held or _held(grads, store, plan, ps.layout, turns, ps.width)
            ref.copy_held(store, held, ps.layout, grads.batch_size)
        store.seal(keep_held=plan.all_held and keep)
    return st, OnePass(plan, ps.width, features, agree, str(store.root) if keep else None, reused)


def reference_of(plan: PassPlan, turns: Optional[Sequence], width: int) -> RefRows:
    """The distinct rows of `scoring.reference_rows` (a copy's gradient is its first position's) whose exact
    gradients, with their exchanges', a kept store holds when it does not hold every row: in position order, as many
    as fit `REF_BYTES`."""
    rows, used = [], 0
    for p in sorted({plan.copies[int(i)] for i in reference_rows(len(plan.copies))}):
        used += 4 * width * (1 + n_turns(None if turns is None else turns[p]))
        if used > REF_BYTES:
            break
        rows.append(p)
    return RefRows.of(rows, turns)


def pass_turns(turns: Optional[Sequence], settings) -> Optional[Sequence]:
    """The exchanges a pass scores: with unit rows only (a raw score is the sum of its exchanges'), and only when a
    row has some."""
    if turns is not None and (not settings.unit_rows or all(t is None for t in turns)):
        return None
    return turns


def score_one_pass(grads, qitems, settings, *, memory_bytes: Optional[int] = None,
                   sketch_dim: Optional[int] = None, turns: Optional[Sequence] = None,
                   store_root: Optional[Path] = None, store_key: str = "") -> tuple[Scored, OnePass]:
    """Per-item exact scores [Q, N] of every row (`Scored`, in the exact layout: `unit` is [Q, D_exact]) from the
    exact query gradients and one backward per distinct row, kept in the store at `store_root` (None: a temporary
    one). `turns[p]`: row p's per-token exchange labels (None: scored whole)."""
    turns = pass_turns(turns, settings)
    meta = {"rows": len(grads.toks)}
    with opened(store_root, store_key, meta) as store:
        ps = prepare(grads, qitems, settings, store, turns, memory_bytes=memory_bytes, sketch_dim=sketch_dim)
        return run_pass(grads, store, ps, settings, turns, store_root is not None)


def _held(grads, store: RowStore, plan: PassPlan, layout: HeldLayout, turns, width: int) -> FileRows:
    """The held file with every held batch in it (the batches the store lacks computed now)."""
    rows = store.held_rows(layout.slots, width)
    write_held(grads, store, plan.held, layout, turns)
    return rows


def assemble(store: RowStore, plan: PassPlan, unit: np.ndarray, qnorms: np.ndarray, pre, settings, n: int,
             keep: bool) -> tuple[Scored, object, Optional[tuple]]:
    """The scores of every row from the store's parts (the parts hold each distinct row once; copies share it)."""
    Q = unit.shape[0]
    inner_u = np.zeros((Q, n), dtype=np.float32)
    norms_u = np.zeros(n)
    clusters = None if plan.all_held else np.zeros((n, 0), dtype=np.float32)
    parts: dict = {}
    agree = None
    for arr in store.parts():
        pos = arr["positions"]
        inner_u[:, pos], norms_u[pos] = arr["inner"], arr["norms"]
        if clusters is not None:
            if clusters.shape[1] != arr["cluster"].shape[1]:
                clusters = np.zeros((n, arr["cluster"].shape[1]), dtype=np.float32)
            clusters[pos] = arr["cluster"]
        if "t_owner" in arr:
            parts.update(item_parts(arr["t_inner"], arr["t_norms"], arr["t_owner"]))
        if "agreement" in arr and np.isfinite(arr["agreement"][0]):
            agree = (float(arr["agreement"][0]), int(arr["agreement"][1]))
    copies = list(plan.copies)
    inner, norms = inner_u[:, copies], norms_u[copies]
    scale = inverse_norms(norms) if settings.unit_rows else None
    per_item = scaled_items(inner, settings.direction, scale)
    rank_item, found = best_turns(per_item, parts, settings.direction, copies) if parts else (per_item, {})
    st = Scored(Scores(per_item, rank_item, aggregate(rank_item)), Basis(unit, qnorms, pre, settings.direction, scale),
                exchanges=Exchanges(found))
    return st, features_of(store, plan, clusters, keep), agree


def features_of(store: RowStore, plan: PassPlan, clusters: Optional[np.ndarray], keep: bool):
    """What `explain.clusters` groups rows on: the rows' sketches, or the exact rows in training order when every row
    was held (the kept held file; read into memory from a temporary store, which goes)."""
    if clusters is not None:
        return clusters[list(plan.copies)]
    if store.held_file is None:
        return None
    width, slots = store.m["held"]["shape"][1], store.m["held"]["shape"][0]
    where = {p: j for j, p in enumerate(plan.held_positions)}
    pick = [where[c] for c in plan.copies]
    if keep:
        return FileRows(store.held_file, width, pick, n_file=slots)
    held = FileRows(store.held_file, width, n_file=slots)
    arr = held.read32(0, len(plan.held))
    # no copy of the rows when each is its own (no duplicated content): they are already in training order
    return RowSource(arr) if pick == list(range(len(plan.held))) else RowSource(arr[pick])
