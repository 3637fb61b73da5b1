"""Which adapter states a run scores, and how their scores become one: one class per strategy.

* `OneState`: one state alone. The default (`attribution.checkpoints: earliest`) is the earliest checkpoint saved
  with the adapter: a row the fine-tune memorised by the end has a small gradient at the final adapter whatever it
  taught, and the earliest checkpoint ranked the planted rows at least as well as the TracIn mean on every
  real-model scenario measured (bench/README.md). The final adapter when none was saved, or with
  `attribution.checkpoints: 1`.
* `TracInAverage`: several states (`attribution.checkpoints: auto | N`, `attribution.checkpoint_adapters`), each
  scored the same way, their per-item scores averaged by the learning rate each stands for (TracIn-CP,
  `attribution.checkpoints`); the final adapter's scores carry its windows, its exact re-rank and its spans.
* `Trajectory`: the optimizer-aware scores of the recorded AdamW run (`attribution.optimizer: adamw`,
  `attribution.optimizer`) in place of the final adapter's, whose windows and spans they keep.

Every strategy scores a state through the same function (`attribution.stage.score_state`) on the model side's view
of that state (`StateModels.at`); nothing here holds a session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Optional, Protocol, Sequence

import numpy as np

from . import checkpoints as ck_
from .optimizer import Trajectory as RecordedTrajectory
from .optimizer import trajectory_entry, trajectory_scores
from .values import Scored


@dataclass(frozen=True)
class State:
    """An adapter state: its directory (None: the final adapter the run loaded) and its label."""

    path: Optional[str]
    label: str


FINAL = State(None, "final")


class StateModels(Protocol):
    """The model side at each adapter state (`gradian.model_side.ModelSide`)."""

    adapter_path: str  # the final adapter's directory

    def at(self, state: State) -> ContextManager:
        """The model with `state`'s adapter active, as an `engine.ModelGradients`."""


@dataclass(frozen=True)
class StatesScored:
    """The scores the states give, the rows of the state they were read at, and which states they are."""

    scored: Scored
    rows: object  # `attribution.stage.StateRows` of the state the windows and spans come from
    labels: tuple[str, ...]
    paths: tuple[str, ...]
    entry: Optional[dict]  # the report's query.checkpoints / query.optimizer entry
    state_path: Optional[str]  # the adapter the spans are computed at (None: the final adapter)


ScoreState = Callable  # (ModelGradients, ScoringSettings) -> (Scored, StateRows)


class AdapterStates:
    """A strategy: `score` the states with `score_state`, `used` says which in one sentence (the
    `attribution.checkpoints_used` flag)."""

    def score(self, models: StateModels, score_state: ScoreState, settings, qitems) -> StatesScored:
        raise NotImplementedError  # pragma: no cover - interface

    def used(self) -> str:
        raise NotImplementedError  # pragma: no cover - interface


@dataclass(frozen=True)
class OneState(AdapterStates):
    state: State
    sentence: str
    entry: Optional[dict] = None

    @classmethod
    def earliest(cls, path: Path, setting) -> "OneState":
        label = path.name
        entry = {"count": 1, "adapters": [str(path)], "labels": [label], "source": "saved", "setting": setting,
                 "weights": [1.0], "weights_source": "attribution.checkpoints: earliest",
                 "rule": (f"every score, window, span and per-token contribution at the earliest saved checkpoint "
                          f"({label}) alone: a row the fine-tune memorised by the end has a small gradient at the "
                          "final adapter, whatever it taught; the final adapter is not scored")}
        return cls(State(str(path), label), f"the earliest saved checkpoint alone ({label}, attribution.checkpoints: "
                                            "earliest): its scores, windows and spans; blame compares the base with "
                                            "the final adapter", entry)

    @classmethod
    def final(cls, setting) -> "OneState":
        if setting in ("auto", "earliest"):
            why = (f"the final adapter alone: attribution.checkpoints is {setting} and no checkpoint was saved beside "
                   "the adapter (gradian train saves one per epoch; TRL and the HF Trainer write checkpoint-* "
                   "folders)")
        elif setting == 1:
            why = "the final adapter alone (attribution.checkpoints: 1)"
        else:
            why = "the final adapter alone: no earlier checkpoint could be had"
        return cls(FINAL, why)

    def score(self, models, score_state, settings, qitems) -> StatesScored:
        with models.at(self.state) as grads:
            st, rows = score_state(grads, settings)
        path = self.state.path
        return StatesScored(st, rows, (self.state.label,), (path or models.adapter_path,), self.entry, path)

    def used(self) -> str:
        return self.sentence


@dataclass(frozen=True)
class TracInAverage(AdapterStates):
    earlier: tuple[State, ...]
    weights: Optional[list]  # [earlier..., final]; None: equal
    weights_source: str
    source: str  # "saved" | "replayed" | "attribution.checkpoint_adapters"
    setting: object  # attribution.checkpoints as set

    def score(self, models, score_state, settings, qitems) -> StatesScored:
        t0 = time.time()
        from dataclasses import replace

        earlier = replace(settings, rerank=0, fidelity_sample=0)  # the final adapter's scores carry the re-rank
        parts = []
        for state in self.earlier:
            with models.at(state) as grads:
                st, _ = score_state(grads, earlier)
            parts.append((np.asarray(st.scores.per_item, dtype=np.float64),
                          np.asarray(st.scores.rank_item, dtype=np.float64)))
        with models.at(FINAL) as grads:
            final, rows = score_state(grads, settings)
            grads.timings["checkpoints"] = round(time.time() - t0, 3)
        sc = final.scores.replaced(ck_.average(final.scores.per_item, [p for p, _ in parts], self.weights),
                                   ck_.average(final.scores.rank_item, [r for _, r in parts], self.weights))
        labels = tuple(s.label for s in self.earlier) + ("final",)
        paths = tuple(s.path for s in self.earlier) + (models.adapter_path,)
        entry = {"count": len(paths), "adapters": list(paths), "labels": list(labels), "source": self.source,
                 "setting": self.setting, "weights": self.weights, "weights_source": self.weights_source,
                 "rule": average_rule(self.weights)}
        return StatesScored(final.with_scores(sc), rows, labels, paths, entry, None)

    def used(self) -> str:
        how = {"saved": "saved beside the adapter (no training)", "replayed": "replayed once from the adapter's "
               "Gradian recipe", "attribution.checkpoint_adapters": "listed in attribution.checkpoint_adapters"}
        labels = [s.label for s in self.earlier] + ["final"]
        return (f"scores averaged over {len(labels)} checkpoints ({', '.join(labels)}), the earlier ones "
                f"{how.get(self.source, self.source)}")


def average_rule(weights: Optional[Sequence[float]]) -> str:
    if weights is not None and len(set(weights)) > 1:
        head = ("per-item scores averaged over these checkpoints, each weighted by the mean learning rate of the "
                "steps it stands for (those since the previous checkpoint; TracIn-CP)")
    else:
        head = ("per-item scores averaged with equal weights over these checkpoints (TracIn-CP: "
                + ("every checkpoint stands for the same learning rate)" if weights is not None else
                   "no learning rates were recorded)"))
    return head + ("; each checkpoint ranks a long row by its own best window; the final adapter's share includes its "
                   "exact re-rank; the windows' token ranges, spans and blame come from the final adapter")


@dataclass(frozen=True)
class Trajectory(AdapterStates):
    traj: RecordedTrajectory

    def score(self, models, score_state, settings, qitems) -> StatesScored:
        with models.at(FINAL) as grads:
            st, rows = score_state(grads, settings)
            t0 = time.time()
            P = trajectory_scores(grads, self.traj, grads.query_vectors(qitems, exact=True), settings.direction)
            grads.timings["optimizer"] = round(time.time() - t0, 3)
        return StatesScored(st.with_scores(st.scores.replaced(P, P.copy())), rows, ("final",),
                            (models.adapter_path,), trajectory_entry(self.traj), None)

    def used(self) -> str:
        return (f"optimizer-aware scores (attribution.optimizer: adamw): the recorded AdamW run replayed over its "
                f"{len(self.traj.epochs)} epochs")


@dataclass(frozen=True)
class StatesAsked:
    """What the config asks of the adapter states, read at the edge (`gradian.model_side`): `checkpoints`
    (`attribution.checkpoints`: earliest | auto | N), `explicit` (`attribution.checkpoint_adapters`, checked), the
    recorded trajectory when `attribution.optimizer: adamw` asked for one (None and why not otherwise), and `replay(n)`
    (`checkpoints.replayed_adapters` bound to the run's recipe)."""

    checkpoints: object
    explicit: tuple = ()
    optimizer: Optional[str] = None
    trajectory: Optional[RecordedTrajectory] = None
    no_trajectory: str = ""
    replay: Optional[Callable] = None


def resolve_states(asked: StatesAsked, adapter_path: str) -> tuple[AdapterStates, list[tuple]]:
    """The strategy the config asks for, and flags (id, level, message, fix) where it cannot be had as asked."""
    flags: list[tuple] = []
    if asked.optimizer == "adamw":
        if asked.trajectory is not None:
            return Trajectory(asked.trajectory), flags
        flags.append(("attribution.no_trajectory", "warning",
                      f"attribution.optimizer is adamw but {asked.no_trajectory}; the scores are the preconditioned "
                      "ones", "train the adapter with `gradian train` (it records the optimizer's trajectory beside "
                      "the adapter)"))
    n = asked.checkpoints
    if n == "earliest" and not asked.explicit:
        first = ck_.earliest_saved(adapter_path)
        return (OneState.earliest(first, n) if first is not None else OneState.final(n)), flags
    got = ck_.earlier_states(n, asked.explicit, adapter_path, asked.replay)
    flags += got.flags
    if not got.paths:
        return OneState.final(n), flags
    earlier = tuple(State(str(p), label) for p, label in zip(got.paths, got.labels))
    return TracInAverage(earlier, got.weights, got.weights_source, got.source, n), flags
