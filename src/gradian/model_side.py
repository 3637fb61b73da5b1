"""The session's model as the scoring engine sees it: `ModelSide.at(state)` opens one adapter state as an
`attribution.engine.ModelGradients` (exact capture) with its `Storage` (where its rows are kept, decided here from
the config), and `ModelSide.states()` resolves the adapter-state strategy (`attribution.states`). The scoring code
itself never holds the session.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator

from .attribution.engine import ModelGradients, Storage
from .attribution.states import AdapterStates, State, StatesAsked, resolve_states
from .grads.capture import GradientCapture
from .grads.layout import site_shapes
from .projection import Projector

ROWS_DIR = "rows"  # the per-row stores, under the index directory (`grads.cache_dir`)


def exact_capture(s) -> GradientCapture:
    """A capture of the session view's active adapter with no projection (parameter space)."""
    return GradientCapture(s.model, s.sites, Projector(site_shapes(s.sites)), chunk=s.cfg.grads.loss_chunk_tokens)


def gradients_of(s, capture: GradientCapture | None = None) -> ModelGradients:
    """The session view's active adapter as the scoring engine's model side (`capture`: the rows' space; default
    exact), with its storage."""
    g = s.cfg.grads
    return ModelGradients(capture or exact_capture(s), s.tokenizer, s.eval_items, s.toks, s.chat, g.batch_size,
                          g.max_seq_length, g.loss_chunk_tokens, s.log.timings, examples=s.examples,
                          adapter_path=s.adapter_path, storage=storage_of(s))


def storage_of(s) -> Storage:
    """Where the session view's rows are kept: its gradient index (built or reused when opened), and its per-row
    store under the index directory, keyed by the model, the adapter state and every row's content and place."""
    from .store.build import cache_key, projection_choice

    cfg = s.cfg

    def locate() -> tuple[Path, str]:
        data = hashlib.sha256("\n".join(t.row_key() for t in s.toks).encode()).hexdigest()[:16]
        key = f"{cache_key(cfg, s.sites, Projector(site_shapes(s.sites)), s.adapter_path)}-{data}"
        return cfg.index_dir / ROWS_DIR, key

    return Storage(partial(_open_index, s), auto=cfg.grads.projection_dim == "auto",
                   exact_index=projection_choice(cfg, s.sites, len(s.toks)).dim is None, locate=locate)


def _open_index(s):
    from .store.build import open_index

    with s.log.stage("index"):
        return open_index(s.cfg, s.model, s.sites, s.toks, s.adapter_path, s.pad_id)


class ModelSide:
    """`attribution.states.StateModels` over a session: the final adapter is the session itself, an earlier state
    a view with that adapter loaded onto the same base (`Session.checkpoint`)."""

    def __init__(self, s):
        self.s = s
        self.adapter_path = s.adapter_path

    @contextmanager
    def at(self, state: State) -> Iterator[ModelGradients]:
        if state.path is None:
            yield gradients_of(self.s)
            return
        with self.s.checkpoint(str(Path(state.path).resolve()), state.label) as view:
            yield gradients_of(view)

    def states(self) -> tuple[AdapterStates, list[tuple]]:
        """The adapter-state strategy the config asks for, and the flags where it cannot be had as asked."""
        from .attribution.checkpoints import explicit_adapters, replayed_adapters
        from .attribution.optimizer import read_trajectory
        from .setup.records import dataset_fingerprint

        s, a = self.s, self.s.cfg.attribution
        traj, why = None, ""
        if a.optimizer == "adamw":
            traj, why = read_trajectory(s.adapter_path, n_rows=len(s.examples),
                                        dataset_fingerprint=dataset_fingerprint(s.examples), sites=s.sites)
        explicit = tuple(explicit_adapters(s.cfg)) if a.checkpoint_adapters else ()
        asked = StatesAsked(a.checkpoints, explicit, a.optimizer, traj, why,
                            partial(replayed_adapters, s.cfg, s.adapter_path))
        return resolve_states(asked, s.adapter_path)


def optimizer_scores(s, qitems, direction: str):
    """Per-item optimizer-aware scores [Q, N] of the session's adapter (`attribution.optimizer`) when it has a
    recorded trajectory that fits its training set, else None."""
    from .attribution.optimizer import read_trajectory, trajectory_scores
    from .setup.records import dataset_fingerprint

    traj, _ = read_trajectory(s.adapter_path, n_rows=len(s.examples),
                              dataset_fingerprint=dataset_fingerprint(s.examples), sites=s.sites)
    if traj is None:
        return None
    grads = gradients_of(s)
    return trajectory_scores(grads, traj, grads.query_vectors(qitems, exact=True), direction)
