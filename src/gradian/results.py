"""The values the stages of `attribute` hand forward (`pipeline`), and that `report.assemble.to_report` reads: each
frozen, each the output of one stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .attribution.accused import Accusation
from .attribution.formulation import Formulation
from .attribution.queries import QueryItem
from .attribution.stage import Ranking
from .capability.evaluate import CapabilityResult
from .config import Config
from .verdict import Verdict


@dataclass(frozen=True)
class Outcome:
    """What the capability stage found."""

    result: Optional[CapabilityResult]  # None without an eval set
    verdict: Verdict
    direction: str  # "regression" | "improvement" ("" for a smoke test)
    failing: tuple[int, ...]  # the eval items the fine-tune moved


@dataclass(frozen=True)
class Queries:
    """The failing items as queries, with the text each own-words query differentiates."""

    items: tuple[QueryItem, ...]
    span_texts: tuple[str, ...]
    # `attribution.query` as used (`formulation.asked`: `auto` resolved); report.json writes its name
    formulation: Formulation = Formulation.contrastive


@dataclass(frozen=True)
class Ranked:
    """The scores and the order they give. `ranking` (the scoring engine's value: the per-item ranking scores
    `ranking.per_item`, the rows' features `ranking.features`, the scores' basis, windows, exchanges and re-rank) is
    None for a smoke test (self-influence) or a run declined before scoring; `declined` is (flag id, why) when the
    scores cannot name a cause."""

    ranking: Optional[Ranking]
    order: Optional[np.ndarray]
    scores: Optional[np.ndarray]  # the ranking score of every row (scores.npy)
    totals: Optional[np.ndarray]  # whole-row totals (scores_total.npy)
    declined: Optional[tuple[str, str]]
    index_summary: Optional[dict]
    combine: str = "mean"  # how the items' scores combine into `scores` (`attribution.combine` resolved)
    # the items' mean ranking score (best window / exchange per item, averaged): what the clusters read and the
    # clusters read; `scores` itself when combine is mean
    mean_scores: Optional[np.ndarray] = None
    # with combine max, the item that sets each row's score (its best exchange names a conversation's `turn`)
    strongest: Optional[np.ndarray] = None

    @property
    def count_scores(self) -> Optional[np.ndarray]:
        return self.scores if self.mean_scores is None else self.mean_scores


@dataclass(frozen=True)
class Explanation:
    """What the report says about the top rows."""

    rows: tuple[dict, ...]
    accused: Accusation
    spans: tuple[dict, ...]
    clusters: tuple[dict, ...]
    clusters_info: Optional[dict]
    blame: Optional[dict]
    margins: tuple[dict, ...]  # per failing item: margins under base and fine-tune, and their statement
    scores: Optional[np.ndarray]
    totals: Optional[np.ndarray]


@dataclass(frozen=True)
class Attribution:
    """A finished run, everything `report.assemble.to_report` needs."""

    cfg: Config
    eval_items: Optional[list]
    flags: tuple[dict, ...]
    outcome: Outcome
    queries: Queries
    ranked: Ranked
    explanation: Explanation
    verdict: Verdict  # the outcome's verdict, or declined when the scores could not name a cause
    truth: Optional[dict]
    timings: dict
    timings_cpu: dict
