"""Typed model of report.json (schema id ``gradian.report/1``) and its exported JSON Schema.

Only pydantic and the standard library are imported, so any reader can use this module without torch.

Rules the models follow:

* Every model allows extra keys (``extra="allow"``): a key added to report.json later never breaks an old reader.
* Types are strict (``strict=True``): a position is a JSON integer, not ``"3"`` and not ``3.0``; a float field
  takes an integer. NaN and infinity (which ``json.dumps`` writes as ``NaN``/``Infinity``) pass a float field.
* A key is required when `gradian attribute` always writes it for that shape of report and the sample report in
  the tests has it too; the rest may be absent. ``Optional[...]`` marks a key whose value can be ``null``; a key
  that may be absent but is never null is declared with `_absent` (its JSON Schema has no ``null`` and no
  default; the attribute is None on the model when the key was not there).
* Dump with ``model_dump(by_alias=True, exclude_unset=True)`` to get report.json's keys back (``schema`` is the
  alias of `Report.schema_id`).

Adding a key: write it in `report.assemble`, declare it here on its model with `_absent` (a nested object as its own
`_Model`, e.g. a list of evidence entries on `Accused`), regenerate docs/report.schema.json; every reader (the page,
the terminal, verify, fidelity: `report.read`) then gets it typed, and None from a report written before it.

Regenerate docs/report.schema.json with ``python -m gradian.report.schema > docs/report.schema.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal, Optional, Union

from pydantic import Field

from .ranking_schema import RankingRow
from ..verdict import Verdict
from .schema_base import Pair, _absent, _Model

SCHEMA_ID = "gradian.report/1"
SCHEMA_URI = "urn:gradian:report/1"


# ------------------------------------------------------------------------------------------------ flags


class Flag(_Model):
    """A failed warning- or info-level check, or a condition met during the run (stable ids: docs/checks.md)."""

    id: str = Field(description="Stable flag id, e.g. `evaluation.not_significant`.")
    level: Literal["error", "warning", "info"] = Field(description="Severity (report flags are warning or info).")
    message: str = Field(description="What was found, in plain words.")
    fix: str = Field("", description="What to change; empty when there is nothing to do.")


# ------------------------------------------------------------------------------------------------ capability


class CapabilityItem(_Model):
    """One eval item under the base (adapter disabled) and the fine-tune."""

    item: int = Field(description="0-based record number in the eval file.")
    prompt: str = Field(description="The question: the record's prompt, or its messages' contents joined by newlines.")
    expected: str = Field(description="The expected answer.")
    base_generated: str = Field(description="The base model's greedy answer.")
    generated: str = Field(description="The fine-tune's greedy answer.")
    base_score: float = _absent("The metric on this item under the base (0..1).")
    tuned_score: float = _absent("The metric on this item under the fine-tune (0..1).")
    base_correct: bool = _absent("Older reports: whether the base answer was right (read by report.html).")
    tuned_correct: bool = _absent("Older reports: whether the fine-tuned answer was right.")


class Capability(_Model):
    """The capability delta: base vs fine-tune on the eval set, per-item metric, paired bootstrap interval."""

    metric: str = Field(description="`evaluation.metric`: exact_match, contains, loglik, regex or "
                                    "python:module:function.")
    n: int = Field(description="Number of eval items.")
    base: float = Field(description="Mean metric with the adapter disabled, a fraction in [0, 1].")
    tuned: float = Field(description="Mean metric with the adapter enabled, a fraction in [0, 1].")
    delta: float = Field(description="tuned - base.")
    ci: Pair = Field(description="[lo, hi]: paired percentile-bootstrap interval of the delta.")
    confidence: float = Field(description="Confidence level of `ci` (`evaluation.confidence`).")
    significant: bool = Field(description="Whether `ci` excludes zero.")
    min_detectable_delta: float = Field(
        description="Smallest |delta| that n items detect with 80% power (infinite for n = 0).")
    items: list[CapabilityItem] = Field(description="Every eval item, in file order.")


# ------------------------------------------------------------------------------------------------ query


class QueryRankingRow(_Model):
    """A training row in one failing item's own ranking (its top 10)."""

    position: int = Field(description="0-based record number in the training file.")
    score: float = Field(description="The row's score for this item (best window for long rows).")
    total: float = _absent("The row's total score for this item, present for long (windowed) rows.")


class QueryEntry(_Model):
    """A failing eval item the attribution targets, with its query formulation and its own top rows (read back into
    an `attribution.queries.QueryItem` by `report.read.queries_from_report`)."""

    item: int = Field(description="0-based record number in the eval file.")
    prompt: str = Field(description="The question.")
    expected: str = Field(description="The expected answer.")
    generated: str = Field(description="The fine-tune's greedy answer (what the contrastive query contrasts with).")
    base_generated: str = Field(description="The base model's greedy answer.")
    formulation: Literal["own_words", "behaviour", "contrastive", "classic", "margin"] = _absent(
        "The query used for this item: behaviour (the mean log-likelihood of the fine-tune's sampled answers on its "
        "side of the metric, those it fails for a regression, `attribution.behaviour_samples` drawn at "
        "`attribution.behaviour_temperature`; its greedy answer alone where no sample is on that side); own_words grad[loss(target) - loss(contrast)] with the answer one model "
        "generated that passes the metric against the one the other generated that fails; contrastive "
        "grad[loss(expected) - loss(generated)]; classic grad loss(expected); or margin (expected token's logit "
        "against the others; loglik metric).")
    target: str = _absent("The answer the query makes likelier (what passes the metric), as differentiated.")
    contrast: str = _absent("The answer the query makes less likely (what fails), as differentiated.")
    query_span: str = _absent("own_words: the text of the tokens the query differentiates in the fine-tune's "
                              "answer (`span`): up to its decisive token (the last of the shortest prefix from "
                              "which the base ends as the fine-tune does), those the base would not have chosen.")
    span_start: int = _absent("own_words: the position (in the fine-tune's answer row) of its decisive token.")
    span: list[int] = _absent("own_words: the positions of that row the query differentiates: the tokens from "
                              "the departure to the decisive one that the base would not have chosen itself.")
    target_source: Literal["base", "tuned", "expected"] = _absent(
        "Whose words the target is: the base's answer (a regression), the fine-tune's (an improvement) or the "
        "eval file's expected answer.")
    ranking: list[QueryRankingRow] = Field(description="This item's top rows, highest score first.")
    margin_base: Optional[float] = Field(
        None, description="log p(expected) - log p(generated) under the base, in nats; null when there is no "
                          "competing answer.")
    margin_tuned: Optional[float] = Field(None, description="The same margin under the fine-tune; null likewise.")
    statement: str = _absent("In plain words, how much of the final preference the fine-tune owns.")


class Preconditioner(_Model):
    """`attribution.preconditioner` as fitted on the index."""

    kind: Literal["identity", "diagonal", "fisher", "datainf", "ekfac"]
    damping: Optional[float] = Field(description="Damping factor; null for identity.")
    damping_rule: str = Field(description="How the per-block damping lambda_b is set.")
    solver: dict[str, int] = _absent("fisher only: {primal_blocks, woodbury_blocks}.")
    lambda_range: Pair = _absent("[min, max] of the per-block damping lambda_b.")
    factors: dict[str, Any] = _absent(
        "ekfac only: how the Kronecker factors were obtained: cache (fitted, reused, or refitted and why), rows, "
        "tokens, model_passes, correction (index rows or model pass), file and sha256 when stored beside the index.")


class Checkpoints(_Model):
    """The training checkpoints whose per-item scores were averaged (TracIn-CP, `attribution.checkpoints`)."""

    count: int = Field(description="Number of checkpoints, the final adapter included.")
    adapters: list[str] = Field(description="Adapter directories, oldest first, the final adapter last.")
    labels: list[str] = Field(description="A label per adapter (`epoch-k`, `checkpoint-<step>`, ..., `final`).")
    source: Literal["attribution.checkpoint_adapters", "saved", "replayed"] = Field(
        description="Where the earlier checkpoints came from.")
    setting: Union[Literal["auto", "earliest"], int] = Field(description="`attribution.checkpoints` as configured.")
    rule: str = Field(description="How the checkpoints' scores were combined.")
    weights: Optional[list[float]] = _absent(
        "TracIn-CP weight of each adapter (same order): the mean learning rate of the optimizer steps it stands for; "
        "null when no rates were recorded (equal weights).")
    weights_source: str = _absent("Where the learning rates came from (the recipe's per-step rates, a Trainer's "
                                  "trainer_state.json), or why the weights are equal.")


class OptimizerScores(_Model):
    """Scores that model the recorded AdamW run (`attribution.optimizer: adamw`)."""

    optimizer: Literal["adamw"] = Field(description="The optimizer modelled.")
    epochs: int = Field(description="Epochs replayed at their recorded start weights.")
    steps: int = Field(description="Optimizer steps of the recorded run.")
    file: str = Field(description="The trajectory file beside the adapter.")
    rule: str = Field(description="What the scores predict, in plain words.")


class Query(_Model):
    """The query side: formulation, direction and the failing items."""

    formulation: Literal["contrastive", "classic", "behaviour"] = Field(
        description="`attribution.query` as the run used it (`auto` resolved to `behaviour` or `contrastive`).")
    direction: Literal["regression", "improvement", ""] = _absent(
        "regression (items the fine-tune broke) or improvement (items it fixed); empty for a smoke test.")
    items: list[QueryEntry] = Field(description="The failing items (empty unless attributed).")
    preconditioner: Preconditioner = _absent("The fitted preconditioner (attributed only).")
    combine: Literal["mean", "max"] = _absent(
        "How the failing items' scores combine into a row's ranking score (`attribution.combine` resolved; attributed "
        "only): mean over the items, or max (the item the row stands out on most, each item's scores as robust z-scores "
        "against that item's own rows: own-words queries under auto; scores.npy and `window_score` are then in z "
        "units). The accused count is the mean's either way.")
    checkpoints: Checkpoints = _absent("Present when scores were averaged over earlier checkpoints.")
    optimizer: OptimizerScores = _absent("Present when the scores are the optimizer-aware ones "
                                         "(`attribution.optimizer: adamw` and a recorded trajectory).")


# ------------------------------------------------------------------------------------------------ index


class Projection(_Model):
    """How index vectors were projected (absent fields depend on the kind)."""

    kind: Literal["rademacher", "gaussian", "sjlt", "data-aware"] = Field(description="`grads.projection_kind`.")
    dim: int = Field(description="Projected width.")
    seed: int = Field(description="`grads.projection_seed`.")
    version: int = _absent("Projection scheme version (part of the cache key).")
    scheme: str = _absent("`lora-wide-side` (random kinds) or `lora-wide-side+site-pca` (data-aware).")
    per_site_k: int = _absent("Random kinds: projected width of each site's wide side.")
    sjlt_nnz: int = _absent("sjlt: non-zeros per column.")
    fit_rows: int = _absent("data-aware: rows the basis is fitted on at most (`grads.projection_fit_rows`).")
    stage2_width: int = _absent("data-aware: width of the first stage before the site PCA.")
    basis_sha256: str = _absent("data-aware: sha256 of projection_basis.safetensors.")
    fit_examples: int = _absent("data-aware: rows the basis was actually fitted on.")
    site_dims: list[int] = _absent("data-aware: projected width of each LoRA site.")
    setting: Union[int, str] = _absent("`grads.projection_dim` as set (`auto` or a width).")
    reason: str = _absent("Why this width was used (for `auto`: the size rule of `gradian.projection.auto`).")


class ProjectionChoice(_Model):
    """What `grads.projection_dim` resolved to, and why."""

    setting: Optional[Union[int, str]] = Field(description="`grads.projection_dim` as set: `auto`, a width or null.")
    dim: int = Field(description="Width of a stored row.")
    exact: bool = Field(description="Whether the rows are exact LoRA gradients.")
    exact_width: int = Field(description="Exact width of the LoRA gradient (sum of r x (d_in + d_out) over sites).")
    reason: str = Field(description="The rule that chose it, in words.")


class Agreement(_Model):
    """Projected-vs-exact agreement, the mean over queries of each figure."""

    top10_recall: float = Field(description="Overlap of the exact and approximate top 10.")
    top50_recall: float = Field(description="Overlap of the exact and approximate top 50.")
    spearman_top5pct: float = Field(description="Spearman among the exact top 5% (at least 10 rows).")
    pearson: float = _absent("Pearson correlation (absent for `reranked`).")
    spearman: float = Field(description="Spearman correlation over the sample.")


class Fidelity(_Model):
    """Projected index only: agreement of projected with exact scores on a sample (`grads.fidelity_sample`).

    Every key may be absent: the sample report in the tests carries an older, hand-written shape."""

    sample_rows: int = _absent("Rows in the sample.")
    queries: int = _absent("Number of failing-item queries.")
    rerank_rows: int = _absent("Top rows re-scored exactly (`grads.rerank`).")
    projected: Agreement = _absent("Per-item projected scores against exact ones.")
    projected_aggregate: Agreement = _absent("Aggregate (mean over items) projected scores against exact.")
    reranked: Optional[Agreement] = Field(
        None, description="The order a user reads (exact candidates first) against the exact order; null when "
                          "nothing was re-ranked.")


class IndexSummary(_Model):
    """The gradient index the scores came from."""

    key: str = Field(description="Cache key (model, adapter and every setting the vectors depend on).")
    examples: int = Field(description="Number of training rows.")
    dim: int = Field(description="Width of a stored row.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(description="`grads.storage_dtype`.")
    bytes: int = Field(description="Size of the stored vectors.")
    projection: Optional[Projection] = Field(description="The projection; null for an exact index.")
    projection_choice: ProjectionChoice = _absent("What `grads.projection_dim` resolved to and why.")
    reused_rows: int = _absent("Rows found in the cache.")
    built_rows: int = _absent("Rows captured in this run.")
    path: str = _absent("Index directory.")
    fidelity: Fidelity = _absent("Projected index with a fidelity sample only.")


class Windows(_Model):
    """How long rows are scored (attributed only)."""

    tokens: int = Field(description="Supervised tokens per window.")
    stride: int = Field(description="Window stride in supervised tokens.")
    long_rows: int = Field(description="Rows longer than one window that are windowed (conversations ranked by "
                                       "exchange are not).")
    per_item_rows: int = Field(description="Long rows that got per-item window scores.")
    rule: str = Field(description="The rule in plain words.")


# ------------------------------------------------------------------------------------------------ ranking


class AccusedEvidence(_Model):
    """Why one row is accused (`attribution.accused`)."""

    position: int = Field(description="The row's 0-based record number.")
    items: list[int] = Field(description="The failing eval items (0-based positions in the eval file) the row "
                                         "explains: the items its statistic sums over, strongest first.")
    statistic: float = Field(description="The row's statistic: its robust z-scores on those items, summed and "
                                         "divided by the square root of their number.")
    threshold: float = Field(description="What the statistic had to exceed: the middle (geometric mean) of the drop "
                                         "below the accused rows.")
    item_z: float = Field(description="The row's robust z-score on its strongest item.")


class Accused(_Model):
    """Which rows are accused: the rows above the widest drop of the accusation statistic, each with its evidence
    (`attribution.accused`). Empty when declined or a smoke test."""

    count: int = Field(description="Number of accused rows.")
    positions: list[int] = Field(description="Their 0-based record numbers, by decreasing statistic.")
    z_threshold: float = Field(description="The least statistic an accused row can have (the drop is looked for "
                                           "above it).")
    median: Optional[float] = Field(description="Reports written before issue 42: the median of every row's ranking "
                                                "score; null since.")
    scale: Optional[float] = Field(description="Reports written before issue 42: 1.4826 x the median absolute "
                                               "deviation of those scores; null since.")
    capped_at_top_k: bool = Field(description="More rows passed than `attribution.top_k`; the first that many are "
                                              "listed.")
    rule: str = Field(description="The rule in plain words, or why nobody is accused.")
    threshold: float = _absent("What a row's statistic had to exceed (absent when nobody is accused).")
    drop: float = _absent("The ratio of the drop below the accused rows (absent when nobody is accused).")
    drop_p: float = _absent("How likely a drop that wide is among rows that caused nothing, corrected for the rows it "
                            "was chosen from: the accused are named only when it is below 0.01 (absent when nobody "
                            "is accused).")
    evidence: list[AccusedEvidence] = _absent("Per accused row, in `positions` order: the items it explains, its "
                                              "statistic, the threshold.")


class Cluster(_Model):
    """Rows that act alike (gradient cosine), whose summed score beats size-matched random sets."""

    id: int = Field(description="Cluster number, by score.")
    positions: list[int] = Field(description="Training positions in the cluster, sorted.")
    size: int = Field(description="Number of rows.")
    score: float = Field(description="Sum of the rows' scores.")
    mean_score: float = _absent("score / size.")
    p_value: float = Field(description="One-sided permutation p-value.")
    q_value: float = _absent("Benjamini-Hochberg q-value across the tested clusters.")
    preview: str = Field(description="Preview of the first row.")


class ClusterMethod(_Model):
    grouping: Literal["gradient-cosine-connected-components", "tfidf-cosine-connected-components", "given"]
    threshold: Optional[float] = Field(description="Cosine threshold of an edge; null for given clusters.")
    min_size: int
    test: str
    correction: str
    alpha: float = Field(description="q-value below which a cluster is reported.")
    seed: int


class ClustersInfo(_Model):
    """How the clusters were found and tested (attributed only)."""

    tested: int = Field(description="Clusters tested.")
    permutations: int = Field(description="Random sets per size.")
    method: ClusterMethod


class Span(_Model):
    """A sentence span of a top row, scored against the row's most-harmed failing item."""

    position: int = Field(description="0-based record number in the training file.")
    start: int = Field(description="Character offset into the row's plain text.")
    end: int = Field(description="End character offset (exclusive).")
    text: str = Field(description="The span's text.")
    score: float = Field(description="Sum of the span's supervised-token contributions.")
    tokens: int = _absent("Supervised tokens in the span.")
    item: int = _absent("The eval item the contributions are measured against.")
    item_score: float = _absent("The row's whole score for that item.")
    share: Optional[float] = Field(None, description="score / item_score; null when item_score is 0.")


# ------------------------------------------------------------------------------------------------ the rest


class BlameRows(_Model):
    taught: int
    base_believed: int
    not_learned: int
    unknown: int


class Blame(_Model):
    """Did the fine-tune teach it, or did the base already believe it? (attributed only)."""

    rows: BlameRows = Field(description="Counts of the ranking rows' verdicts.")
    items: int = Field(description="Failing items.")
    items_with_margin: int = Field(description="Failing items with a competing answer (a margin).")
    direction: Literal["regression", "improvement"]
    mean_margin_base: float = _absent("Mean base margin over items with a margin.")
    mean_margin_tuned: float = _absent("Mean fine-tune margin.")
    flipped_by_fine_tune: int = _absent("Items the fine-tune flipped.")
    base_already: int = _absent("Items the base already leaned the wrong way on.")
    mean_fine_tune_share: float = _absent("Mean fraction of the final preference the fine-tune owns.")
    statement: str = Field(description="The summary in plain words.")


class Histogram(_Model):
    edges: list[float] = Field(description="41 bin edges.")
    counts: list[int] = Field(description="40 bin counts.")


class ScoresSummary(_Model):
    """Distribution of every row's ranking score (scores.npy); just {n: 0} when nothing was scored."""

    n: int
    min: float = _absent("Lowest score.")
    max: float = _absent("Highest score.")
    mean: float = _absent("Mean score.")
    std: float = _absent("Standard deviation.")
    histogram: Histogram = _absent("40-bin histogram.")


class Truth(_Model):
    """Ground truth of a built-in scenario (demo, tests); free-form beyond `planted`."""

    planted: list[int] = _absent("Positions of the planted rows.")


class Metrics(_Model):
    """Recovery of the planted rows (when `truth` has them); NaN when undefined."""

    recall_at_10: float
    auprc: float


class Report(_Model):
    """report.json as `gradian attribute` writes it (schema id ``gradian.report/1``).

    Shapes by verdict: ``attributed`` has everything; ``declined`` has a capability but no index (null), an empty
    ranking, no windows, clusters_info or blame; ``smoke_test`` (no eval set) has a null capability and index (one
    streamed pass, no index built) and a ranking of the rows with the largest gradients, but no per-row verdicts,
    clusters or spans."""

    schema_id: Literal["gradian.report/1"] = Field(alias="schema", description="Schema id of this report.")
    # not strict: a Python str ("declined", from a dict) validates to the member as a JSON string does
    verdict: Verdict = Field(strict=False, description="attributed: rows are accused; declined: the capability did not move measurably (or nothing "
                    "failed), no row is accused; smoke_test: no eval set, the ranking shows gradient outliers.")
    verdict_text: str = Field(description="The verdict in plain words.")
    flags: list[Flag] = Field(description="Warnings and infos raised by the checks and the run.")
    settings: dict[str, Any] = Field(description="The resolved config (without `root`).")
    capability: Optional[Capability] = Field(description="The capability delta; null for a smoke test.")
    query: Query
    index: Optional[IndexSummary] = Field(description="The gradient index the scores were read from; null when none "
                                          "was (declined, a smoke test, and the one pass: `scoring` says how the rows "
                                          "were scored).")
    windows: Windows = _absent("Attributed only.")
    ranking: list[RankingRow] = Field(description="Top `attribution.top_k` rows in rank order (empty when declined).")
    accused: Accused = _absent("The accused rows (absent in reports written before the accused rule).")
    clusters: list[Cluster] = Field(description="Clusters that pass the permutation test with BH control.")
    clusters_info: ClustersInfo = _absent("Attributed with a non-empty ranking only.")
    spans: list[Span] = Field(description="Sentence spans of the top rows, highest score first.")
    blame: Blame = _absent("Attributed with a non-empty ranking only.")
    scores_summary: ScoresSummary
    truth: Truth = _absent("Passed in by the demo and tests.")
    metrics: Metrics = _absent("With `truth.planted` and scores only.")
    timings: dict[str, float] = Field(description="Seconds per step (load, evaluate, index, score, ..., total).")
    timings_cpu: dict[str, float] = _absent("CPU seconds of the main process per step (evaluate, index, score, "
                                            "..., total).")

    def to_dict(self) -> dict[str, Any]:
        """The report as report.json holds it (the keys it was read with)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


def report_json_schema() -> dict:
    """The JSON Schema (draft 2020-12) document of report.json, as committed in docs/report.schema.json."""
    schema = Report.model_json_schema(by_alias=True)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_URI, **schema,
            "title": SCHEMA_ID}


if __name__ == "__main__":
    sys.stdout.write(json.dumps(report_json_schema(), indent=2, sort_keys=True) + "\n")
