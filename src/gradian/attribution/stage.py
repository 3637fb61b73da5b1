"""The scoring engine's one entry: `scores_for` gives the scores a run reports, for `attribute`, `fidelity`,
`verify` and the benches.

Adapter states (`attribution.states`): one strategy says which states are scored and how their scores combine (the
earliest saved checkpoint alone by default; a TracIn average; the recorded AdamW trajectory). Each state is scored
by `score_state` from one row source:

* the first pass over the rows (`attribution.one_pass`): exact query gradients, then one backward per row reduced
  on the spot to its score against every query and its norm in the preconditioner's metric; the default where the
  exact index would not be stored (`grads.projection_dim: auto` on real widths), and always for conversations ranked
  by exchange (`attribution.per_turn`: the index holds whole rows);
* a gradient index (`attribution.indexed`): the exact index when `grads.projection_dim: auto` keeps it (small
  widths: the built-in models), a projected one with its exact re-rank for an integer `grads.projection_dim`, and
  EK-FAC's factors are fitted over one.

Nothing here holds a session: the model side at each state comes from `gradian.model_side`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import hashlib
import json
from pathlib import Path

from ..distributed import current
from ..explain.clusters import SKETCH_DIM
from ..projection import Projector
from . import windows as win
from .directions import BackProjected, HarmDirections
from .engine import ModelGradients, ScoringSettings, block_dims_of, scaled_contributions
from .indexed import score_index
from .one_pass import DEFAULT_HELD_BYTES, REF_BYTES, opened, pass_turns, prepare, run_pass
from .precondition import preconditioner_class
from .row_pass import STORE_SKETCH_DIM
from .shortlist import score_shortlist
from .states import AdapterStates, StateModels
from .values import Scored

STORE_VERSION = 2  # bump when what a per-row store holds changes: older stores become foreign


@dataclass(frozen=True)
class ScoreSource:
    """Where a run's scores come from, in the report's words."""

    method: str  # "one_pass" | "stored_rows" | "exact_index" | "projected_index"
    states: tuple[str, ...]  # the adapter states' labels ("final", "checkpoint-12", ...)
    paths: tuple[str, ...]  # their adapter directories
    entry: Optional[dict] = None  # the report's query.checkpoints / query.optimizer entry, when several states


@dataclass(frozen=True)
class StateRows:
    """How one state's rows were read: the row source's name, the projector of the scores' space, the rows clusters
    group on, the report's summary of the source, and the rows `train.not_converged` measures."""

    method: str  # "one_pass" | "stored_rows" (a later question on a per-row store) | "exact_index" | "projected_index"
    projector: Projector
    features: object  # a RowSource or an [N, k] array for explain.clusters; None: clusters on text
    summary: dict  # the report's `index` entry (an index) or `scoring` entry (the one pass, the store)
    agreement: Callable  # () -> the rows' gradient agreement (`checks.convergence.gradient_agreement`) or None


@dataclass(frozen=True)
class Ranking:
    """What the ranking stage hands forward: the scores (`scored`), where they come from (`source`, `rows`), the
    adapter state the spans are computed at, and the sentences the run reports about them.

    `per_item` [Q, N]: each item's ranking scores (harm-signed unit-row cosine in the preconditioner's metric; a long
    row's best window, a conversation's best exchange per item); `totals` [Q, N] the whole rows'; `features` what
    clusters group rows on."""

    scored: Scored
    source: ScoreSource
    rows: StateRows
    state_path: Optional[str] = None  # None: the final adapter
    flags: tuple = ()  # (id, level, message, fix) about the states
    states_used: str = ""  # the `attribution.checkpoints_used` sentence

    @property
    def per_item(self):
        return self.scored.scores.rank_item

    @property
    def totals(self):
        return self.scored.scores.per_item

    @property
    def features(self):
        return self.rows.features

    @property
    def projector(self) -> Projector:
        return self.rows.projector

    @property
    def one_pass(self) -> bool:
        """Scored without an index: the first pass over the rows, or a later question on its per-row store."""
        return self.rows.method in ("one_pass", "stored_rows")


def scores_for(models: StateModels, qitems, settings: ScoringSettings, states: AdapterStates,
               flags: tuple = ()) -> Ranking:
    """The per-item scores a run reports for these queries: the adapter states of `states`, each scored by
    `score_state` with `settings`."""
    got = states.score(models, lambda grads, st: score_state(grads, qitems, st), settings, qitems)
    source = ScoreSource(got.rows.method, got.labels, got.paths, got.entry)
    return Ranking(got.scored, source, got.rows, got.state_path, tuple(flags), states.used())


def rows_fit(settings: ScoringSettings) -> bool:
    """The preconditioner is fitted on rows (every kind but EK-FAC, whose factors are fitted over an index)."""
    return not preconditioner_class(settings.preconditioner).parameter_space


def one_pass_applies(grads: ModelGradients, settings: ScoringSettings) -> bool:
    """One pass, not an index: the preconditioner is fitted from rows, and the exact index would not be stored
    (`grads.projection_dim: auto` resolves to a projection)."""
    return rows_fit(settings) and grads.storage.auto and not grads.storage.exact_index


def conversations(grads: ModelGradients, settings: ScoringSettings) -> Optional[list]:
    """Per row its tokens' exchanges when conversations are ranked by exchange (`attribution.per_turn` with unit
    rows, a preconditioner fitted on rows, `grads.projection_dim: auto`) and some row has two exchanges or more;
    else None."""
    if not (settings.per_turn and settings.unit_rows and grads.storage.auto and rows_fit(settings)):
        return None
    turns = row_exchanges(grads)
    return turns if any(t is not None for t in turns) else None


def row_exchanges(grads: ModelGradients) -> list:
    """Per row, its tokens' exchanges (`setup.alignment.token_exchanges`; None for a row scored whole)."""
    from ..setup.alignment import token_exchanges

    return [token_exchanges(ex, tok, grads.tokenizer) for ex, tok in zip(grads.examples, grads.toks)]


def score_state(grads: ModelGradients, qitems, settings: ScoringSettings) -> tuple[Scored, StateRows]:
    """The scores of one adapter state (`grads`, exact capture) and how its rows were read. Conversations ranked by
    exchange take the one pass even where the exact index would be stored (the index holds whole rows; with every
    row held the pass is the exact index's maths, `one_pass`)."""
    turns = conversations(grads, settings)
    if turns is not None or one_pass_applies(grads, settings):
        return _one_pass(grads, qitems, settings, turns)
    ix = grads.storage.open_index()
    try:
        st = score_index(replace(grads, capture=ix.capture), ix.rows, qitems, settings,
                         block_dims=block_dims_of(ix.index))
    finally:
        ix.close()
    rows = ix.closed_rows()
    method = "exact_index" if ix.capture.projector.exact else "projected_index"

    def agreement():
        from ..checks.convergence import gradient_agreement

        return gradient_agreement(block for _, _, block in rows.chunks())

    return st, StateRows(method, ix.capture.projector, rows, ix.info.summary(), agreement)


def _one_pass(grads: ModelGradients, qitems, settings: ScoringSettings, turns) -> tuple[Scored, StateRows]:
    """The first pass over the rows (resumed from its store where a killed one stopped; read back from it for
    the same question), or, on a finished store and another question, its shortlist scored exactly."""
    t0 = time.time()
    turns = pass_turns(turns, settings)
    root, key = store_of(grads, settings, turns)
    with opened(root, key, {"rows": len(grads.toks)}) as store:
        ps = prepare(grads, qitems, settings, store, turns)
        later = root is not None and store.sealed and store.question != ps.qkey
        # every row held: the store keeps every row's exact gradient, and a pass reads them all (no backward)
        every = ps.plan.all_held and store.held_file is not None
        if later and settings.store == "shortlist" and not every:
            st, op, info = score_shortlist(grads, store, ps, settings, turns, settings.top_k)
            method, summary = "stored_rows", {**op.describe(), **info.describe()}
        else:
            later = later and every
            st, op = run_pass(grads, store, ps, settings, turns, root is not None)
            method, summary = "one_pass", op.describe()
            if later:  # a later question, every row read from the kept held file: exact, no backward
                summary["mode"] = "per-row store of an earlier pass: every row's exact gradient, scored exactly"
            if root is not None:
                summary.update(store=str(root), reused_rows=op.reused)
    if settings.windows:
        st = one_pass_windows(grads, st)
    grads.timings["one_pass"] = round(grads.timings.get("one_pass", 0.0) + time.time() - t0, 3)
    agree = op.agreement
    return st, StateRows(method, grads.exact().projector, op.features, summary, lambda: agree)


def store_of(grads: ModelGradients, settings: ScoringSettings, turns) -> tuple[Optional[Path], str]:
    """Where the per-row store of this state and these settings is kept, and its key (None: none is kept: a
    preconditioner that reads its rows at every use, `attribution.store: off`, several processes)."""
    st = grads.storage
    keep = (st is not None and st.locate is not None and settings.store != "off" and not current().active
            and preconditioner_class(settings.preconditioner).storable)
    where, state = st.locate() if keep else (None, "")
    spec = {"v": STORE_VERSION, "state": state,
            "preconditioner": settings.preconditioner, "damping": settings.damping, "unit_rows": settings.unit_rows,
            "exchanges": turns is not None, "seed": settings.seed, "held_bytes": DEFAULT_HELD_BYTES,
            "ref_bytes": REF_BYTES,
            "sketches": [SKETCH_DIM, STORE_SKETCH_DIM], "batch_size": grads.batch_size, "chunk": grads.chunk,
            "batch_tokens": grads.max_batch_tokens}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
    return (Path(where) / f"rows-{key}" if keep else None), key


def one_pass_windows(grads: ModelGradients, st: Scored) -> Scored:
    """Best windows of long rows at a bounded cost, along exact directions (`windows.TopLongRows`); a conversation
    ranked by its best exchange has its windows already, the exchanges (renormalised)."""
    t0 = time.time()
    projector = grads.exact().projector
    basis = st.basis

    def contributions(per_item: bool, rows):
        d = HarmDirections(projector, basis) if per_item else BackProjected(projector, basis.w_mean())
        return scaled_contributions(basis, grads.contributions(d, rows))

    long_rows = [p for p in win.long_rows(grads.toks) if p not in st.exchanges]
    st = win.best_windows(st, long_rows, win.TopLongRows(), contributions)
    if long_rows:
        grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return st
