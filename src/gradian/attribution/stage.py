"""Which scores a run reports, computed once: `scores_for` is the one entry for `attribute`, `fidelity`, `verify`
and the benches.

Adapter states. `attribution.checkpoints: earliest` (the default) scores every row at one adapter state, the
earliest checkpoint saved with the adapter (the final adapter when none was saved): a row the fine-tune memorised
by the end has a small gradient at the final adapter whatever it taught, and the earliest checkpoint ranked the
planted rows at least as well as the TracIn mean on every real-model scenario measured (bench/README.md). `auto`,
`N` and `attribution.checkpoint_adapters` average several states (TracIn-CP, `attribution.checkpoints`), each
scored the same way.

Per state, the scores are exact. When the exact index is small enough to store (`grads.projection_dim: auto`
keeps it exact: the built-in models), it is the row source (cached, resumable, one pass when built); otherwise one
pass over the rows computes the exact scores directly (`attribution.one_pass`) and no projected index is built.
Conversations ranked by exchange (`attribution.per_turn`) always take the one pass: the index holds whole rows.
A projected index is scored (with its exact re-rank) only where the preconditioner works on one (`ekfac`) or the
optimizer-aware scores need the final adapter's index (`attribution.optimizer: adamw`), or where
`grads.projection_dim` asks for a fixed width.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from ..grads.capture import GradientCapture
from ..grads.layout import site_shapes
from ..projection import Projector
from . import checkpoints as ck_
from . import windows as win
from .directions import BackProjected
from .engine import ModelGradients, ScoringSettings, block_dims_of, scaled_contributions, score_items
from .one_pass import OnePass, score_one_pass
from .precondition import preconditioner_class
from .scoring import Scores

WINDOW_ROWS = 32  # one pass: the long rows windowed are the top WINDOW_ROWS by their whole-row score
WINDOW_ITEM_ROWS = 8  # ... and the top WINDOW_ITEM_ROWS of those by their best window get per-item windows


@dataclass(frozen=True)
class ScoreSource:
    """Where a run's scores come from, in the report's words."""

    method: str  # "one_pass" | "exact_index" | "projected_index"
    states: tuple[str, ...]  # the adapter states' labels ("final", "checkpoint-12", ...)
    paths: tuple[str, ...]  # their adapter directories
    entry: Optional[dict] = None  # the report's query.checkpoints / query.optimizer entry, when several states


@dataclass
class Scored:
    """A run's scores and what the later stages need from the scoring: the projector of `scores.w`'s space, the
    adapter state spans are computed at, the rows clusters group on, the report's `index` entry. `index` is the
    open index when one was used (closed by `close`)."""

    scores: Scores
    source: ScoreSource
    projector: Projector
    features: object  # a RowSource or an [N, k] array for explain.clusters; None: clusters on text
    rows_summary: dict
    state_path: Optional[str] = None  # the adapter the spans are computed at (None: the session's own)
    index: object = None
    one_pass: Optional[OnePass] = None
    timings: dict = field(default_factory=dict)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None


def one_pass_applies(cfg, sites, n_rows: int, settings: ScoringSettings) -> bool:
    """One pass, not an index: the preconditioner is fitted from rows (not EK-FAC's factors over an index), and the
    exact index would not be stored (`grads.projection_dim` resolves to a projection)."""
    from ..store.build import projection_choice

    if preconditioner_class(settings.preconditioner).parameter_space:  # EK-FAC: factors fitted over an index
        return False
    if cfg.grads.projection_dim != "auto":
        return False
    return projection_choice(cfg, sites, n_rows).dim is not None


def exact_capture(s) -> GradientCapture:
    return GradientCapture(s.model, s.sites, Projector(site_shapes(s.sites)), chunk=s.cfg.grads.loss_chunk_tokens)


def conversations(view, settings: ScoringSettings) -> Optional[list]:
    """Per row its tokens' exchanges when conversations are ranked by exchange (`attribution.per_turn` with unit
    rows, a row-space preconditioner) and some row has two exchanges or more; else None."""
    if not (settings.per_turn and settings.unit_rows) or preconditioner_class(settings.preconditioner).parameter_space:
        return None
    turns = row_exchanges(view)
    return turns if any(t is not None for t in turns) else None


def score_state(view, qitems, settings: ScoringSettings) -> Scored:
    """The scores of the session view's active adapter alone. Conversations ranked by exchange take the one pass
    even where the exact index would be stored (the index holds whole rows; with every row held the pass is the
    exact index's maths, `one_pass`)."""
    t0 = time.time()
    turns = conversations(view, settings) if view.cfg.grads.projection_dim == "auto" else None
    if turns is not None or one_pass_applies(view.cfg, view.sites, len(view.toks), settings):
        cap = exact_capture(view)
        grads = ModelGradients.from_session(view, cap)
        sc, op = score_one_pass(grads, qitems, settings, turns=turns)
        if settings.windows:
            sc = bounded_windows(grads, sc)
        view.log.timings["one_pass"] = round(view.log.timings.get("one_pass", 0.0) + time.time() - t0, 3)
        return Scored(sc, ScoreSource("one_pass", ("final",), (view.adapter_path,)), cap.projector,
                      op.cluster_features(len(view.toks)), op.describe(), one_pass=op)
    from ..store.build import open_index

    with view.log.stage("index"):
        ix = open_index(view.cfg, view.model, view.sites, view.toks, view.adapter_path, view.pad_id)
    sc = score_items(ModelGradients.from_session(view, ix.capture), ix.rows, qitems, settings,
                     block_dims=block_dims_of(ix.index))
    method = "exact_index" if ix.capture.projector.exact else "projected_index"
    return Scored(sc, ScoreSource(method, ("final",), (view.adapter_path,)), ix.capture.projector, ix.rows,
                  ix.info.summary(), index=ix)


def row_exchanges(view) -> list:
    """Per row, its tokens' exchanges (`setup.alignment.token_exchanges`; None for a row scored whole)."""
    from ..setup.alignment import token_exchanges

    return [token_exchanges(ex, tok, view.tokenizer) for ex, tok in zip(view.examples, view.toks)]


def bounded_windows(grads: ModelGradients, sc: Scores) -> Scores:
    """Best windows of long rows (`attribution.windows`) at a bounded cost, along exact directions: the top
    `WINDOW_ROWS` long rows by whole-row score get their best window along the items' mean direction (one
    forward-mode pass each; by linearity the mean of the per-item contributions), and the top `WINDOW_ITEM_ROWS` of
    them per-item windows too. Every other long row keeps its whole-row score."""
    # a conversation ranked by its best exchange has its windows already, the exchanges (renormalised)
    long_rows = [p for p in win.long_rows(grads.toks) if p not in sc.turns]
    sc = replace(sc, long_rows=long_rows)
    if not long_rows:
        return sc
    t0 = time.time()
    projector = grads.exact().projector
    top = sorted(long_rows, key=lambda p: (-sc.rank_agg[p], p))[:WINDOW_ROWS]
    top = sorted(top)  # row order: which rows share a forward batch does not depend on the scores
    res = scaled_contributions(sc, grads.contributions(BackProjected(projector, sc.w.mean(0, keepdims=True)), top))
    sc = win.aggregate_windows(sc, top, res)
    Q = sc.w.shape[0]
    item_rows = sorted(sorted(top, key=lambda p: (-sc.rank_agg[p], p))[:WINDOW_ITEM_ROWS])
    sc = replace(sc, window_item_rows=list(item_rows), window_items=len(item_rows) == len(long_rows))
    if Q and item_rows:
        res_i = scaled_contributions(sc, grads.contributions(BackProjected(projector, sc.w), item_rows))
        sc = win.apply_item_windows(sc, item_rows, res_i, Q, aggregate=False)
    grads.timings["windows"] = round(grads.timings.get("windows", 0.0) + time.time() - t0, 3)
    return sc


def scoring_states(s) -> tuple[list[Path], list[str], bool]:
    """(earlier adapter states, their labels, whether the final adapter is scored too). `earliest`: the earliest
    saved checkpoint alone (the final adapter when none was saved)."""
    cfg = s.cfg
    if cfg.attribution.checkpoints == "earliest" and not cfg.attribution.checkpoint_adapters:
        saved = ck_.without_final(ck_.saved_adapters(s.adapter_path), s.adapter_path)
        return saved[:1], [p.name for p in saved[:1]], not saved
    paths, labels = ck_.resolve(s)
    return list(paths), list(labels), True


@contextmanager
def state_view(s, path: Optional[str], label: str):
    """The session with adapter `path` active (None: the session itself)."""
    if path is None:
        yield s
        return
    with s.checkpoint(str(Path(path).resolve()), label) as view:
        yield view


def scores_for(s, qitems, direction: str, **overrides) -> Scored:
    """The per-item scores a run reports for these queries, with the config's settings but `overrides` (e.g.
    `preconditioner="identity"`)."""
    settings = ScoringSettings.from_config(s.cfg, direction, **overrides)
    if s.cfg.attribution.optimizer == "adamw" or not one_pass_or_exact(s, settings):
        return _legacy(s, qitems, settings)
    paths, labels, with_final = scoring_states(s)
    if len(paths) + int(with_final) == 1:
        path = None if with_final else str(paths[0])
        with state_view(s, path, labels[0] if paths else "final") as view:
            out = score_state(view, qitems, settings)
        label = "final" if with_final else labels[0]
        entry = None if with_final else _single_entry(s, paths[0], labels[0])
        return replace(out, source=replace(out.source, states=(label,), paths=(path or s.adapter_path,),
                                           entry=entry), state_path=path)
    return _averaged(s, qitems, settings, paths, labels)


def one_pass_or_exact(s, settings: ScoringSettings) -> bool:
    """Whether every state is scored exactly (one pass or an exact index), the path `scores_for` takes."""
    from ..store.build import projection_choice

    return (one_pass_applies(s.cfg, s.sites, len(s.toks), settings)
            or projection_choice(s.cfg, s.sites, len(s.toks)).dim is None)


def _single_entry(s, path: Path, label: str) -> dict:
    return {"count": 1, "adapters": [str(path)], "labels": [label], "source": "saved",
            "setting": s.cfg.attribution.checkpoints, "weights": [1.0],
            "weights_source": "attribution.checkpoints: earliest",
            "rule": (f"every score, window, span and per-token contribution at the earliest saved checkpoint "
                     f"({label}) alone: a row the fine-tune memorised by the end has a small gradient at the final "
                     "adapter, whatever it taught; the final adapter is not scored")}


def _averaged(s, qitems, settings: ScoringSettings, paths: Sequence[Path], labels: Sequence[str]) -> Scored:
    """TracIn-CP over the earlier states and the final adapter (`checkpoints.averaged`), each state scored as
    `score_state` scores it; the final adapter's directions serve the windows' token ranges and spans."""
    t0 = time.time()
    earlier = replace(settings, rerank=0, fidelity_sample=0)

    def at_state(view) -> Scores:
        st = score_state(view, qitems, earlier)
        st.close()
        return st.scores

    parts = ck_.state_scores(s, paths, at_state)
    final = score_state(s, qitems, settings)
    sc, entry = ck_.averaged(s, final.scores, paths, labels, parts)
    s.log.timings["checkpoints"] = round(time.time() - t0, 3)
    return replace(final, scores=sc, source=ScoreSource(final.source.method, tuple(labels) + ("final",),
                                                        tuple(str(p) for p in paths) + (s.adapter_path,), entry))


def _legacy(s, qitems, settings: ScoringSettings) -> Scored:
    """A projected index at the final adapter (EK-FAC, a fixed `grads.projection_dim`, the optimizer-aware scores):
    its exact re-rank, then the optimizer's trajectory or the checkpoints' average as before."""
    from .optimizer import over_trajectory

    final = score_state(s, qitems, settings)
    sc, entry = final.scores, None
    if s.cfg.attribution.optimizer == "adamw":
        sc, entry = over_trajectory(s, sc, qitems, settings)
    if entry is None:
        sc, entry = ck_.over_checkpoints(s, sc, qitems, settings)
    labels = tuple(entry["labels"]) if entry and "labels" in entry else ("final",)
    return replace(final, scores=sc, source=replace(final.source, states=labels, entry=entry))


def spans_context(s, scored: Scored):
    """The session view at the adapter state the scores came from (spans, fidelity's query norms)."""
    return state_view(s, scored.state_path, "spans") if scored.state_path else nullcontext(s)
