"""The typed values the scoring engine hands forward, one concept each, all frozen: a step that refines scores
returns new values (`dataclasses.replace`), never edits one in place.

* `Scores`: the numbers, per item and per row, and the ranking they give;
* `Basis`: what reproduces them from a row's gradient (the unit preconditioned queries, the fitted preconditioner,
  each row's 1 / norm);
* `Windows`: the best windows of long rows; `Exchanges`: conversations ranked by their best exchange;
* `Rerank`: a projected index's exact re-rank of its top rows and its self-check;
* `Scored`: one adapter state's scores with those four beside them (what `attribution.stage.score_state` returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from .scoring import aggregate, harm_directions, harm_factor


@dataclass(frozen=True)
class Scores:
    """Per-item scores of every training row (harm-signed: positive pushed the model toward the failure).

    `per_item` is the whole row's score; `rank_item` what the per-item rankings use (a long row's best window, a
    conversation's best exchange; else the row's own score); `rank_agg` the items' mean of `rank_item` (or a long
    row's best window along the items' mean direction); `order` the ranking when it is not `rank(rank_agg)` (a
    projected index's exact re-rank: its candidates first)."""

    per_item: np.ndarray  # [Q, N]
    rank_item: np.ndarray  # [Q, N]
    rank_agg: np.ndarray  # [N]
    order: Optional[np.ndarray] = None

    @classmethod
    def of(cls, per_item: np.ndarray) -> "Scores":
        """Scores ranked by themselves (no window, no exchange)."""
        return cls(per_item, per_item, aggregate(per_item))

    def replaced(self, per_item: np.ndarray, rank_item: np.ndarray) -> "Scores":
        """These scores replaced (an average over adapter states, the optimizer-aware scores): the ranking follows
        them, and an exact re-rank's order of the old ones is dropped."""
        return Scores(per_item, rank_item, aggregate(rank_item))

    @property
    def n_items(self) -> int:
        return int(self.per_item.shape[0])


@dataclass(frozen=True)
class Basis:
    """A row's per-item score is <w_k, g_z> x row_scale[z] in the rows' space: w_k = harm_factor x unit_k, the
    harm-signed unit (preconditioned) query. `w` is produced on demand (float64 [Q, dim]: at exact LoRA widths it is
    the largest array of a run, so it is never kept)."""

    unit: np.ndarray  # float32 [Q, dim] unit (preconditioned) queries, what rows are scored against
    norms: np.ndarray  # [Q] norms of the (preconditioned) query gradients before the unit scaling
    precond: object  # the fitted `Preconditioner`
    direction: str  # "regression" | "improvement"
    # 1 / |g_z| per row (unit rows; exact for re-ranked candidates) in the preconditioner's metric: a row's
    # windows' and spans' contributions are scaled the same way. None: raw inner products.
    row_scale: Optional[np.ndarray] = None

    @property
    def w(self) -> np.ndarray:
        return harm_directions(self.unit, self.direction)

    def w_rows(self, ks) -> np.ndarray:
        """Rows `ks` of `w` (float64), without forming the others."""
        return harm_factor(self.direction) * np.asarray(self.unit[list(ks)], dtype=np.float32).astype(np.float64)

    def w_mean(self) -> np.ndarray:
        """float64 [1, dim]: the items' mean of `w`, as `w.mean(0, keepdims=True)` computes it (rows added in
        order), one item at a time."""
        Q = self.unit.shape[0]
        acc = np.zeros((1, self.unit.shape[1]))
        for k in range(Q):
            acc += self.w_rows([k])
        return acc / Q

    @property
    def n_items(self) -> int:
        return int(self.unit.shape[0])

    def scale_of(self, p: int) -> float:
        return 1.0 if self.row_scale is None else float(self.row_scale[p])


@dataclass(frozen=True)
class Windows:
    """Best windows of long rows (`attribution.windows`): which rows are long, which got a window along the items'
    mean direction and which per item, and each windowed row's best window."""

    long_rows: tuple = ()
    found: dict = field(default_factory=dict)  # position -> {"tokens": (a, b), "score": best window, "total": ...}
    item_rows: tuple = ()  # the long rows with per-item window scores
    all_items: bool = False  # per-item window scores computed for every long row
    bounded: bool = False  # the top long rows only (`attribution.stage.TopLongRows`), else every long row


@dataclass(frozen=True)
class Exchanges:
    """Conversations ranked by their best exchange (one pass, unit rows): position -> {"best": [Q] each item's best
    exchange, "scores": [Q, U] each exchange's unit score}; `Scores.rank_item` holds the best, `per_item` the row."""

    found: dict = field(default_factory=dict)

    def __contains__(self, p) -> bool:
        return p in self.found

    def __len__(self) -> int:
        return len(self.found)


@dataclass(frozen=True)
class Rerank:
    """A projected index's exact re-rank: its candidates (scored exactly) and the directions that reproduce their
    scores, a candidate's score = <r_k, P(g)> + <e_k, g_exact> (`attribution.rerank`), and the projected-vs-exact
    self-check."""

    cand: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    e: object = None  # `directions.ExactPart`: the parameter-space part
    r: Optional[np.ndarray] = None  # [Q, dim] the index-space part
    fidelity: Optional[dict] = None


@dataclass(frozen=True)
class Scored:
    """One adapter state's scores and what came with them."""

    scores: Scores
    basis: Basis
    windows: Windows = field(default_factory=Windows)
    exchanges: Exchanges = field(default_factory=Exchanges)
    rerank: Rerank = field(default_factory=Rerank)

    def with_scores(self, scores: Scores) -> "Scored":
        return replace(self, scores=scores)
