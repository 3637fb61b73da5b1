"""The pipeline behind `gradian attribute`: stages left to right, each a function returning a frozen value that the
next one reads.

    open_session, checks -> capability_stage: Outcome -> query_stage: Queries -> rank_stage: Ranked
    -> explain_stage: Explanation -> report.assemble.to_report(Attribution) -> report.json, scores.npy, report.html

The scores come from `attribution.stage.scores_for` over the session's model side (`score_stage`), the one place that
decides which scores a run reports (also `fidelity`'s and the benches'). `evaluate` and `index_stage` are also the
`evaluate` and `index` verbs.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np

from .attribution.accused import Accusation, accuse, nobody
from .attribution.behaviour import SOURCES, sample_answers, with_samples
from .attribution.decisive import decision_positions, decisive_starts, with_starts
from .attribution.engine import ScoringSettings, block_dims_of, scaled_contributions
from .attribution.indexed import score_index
from .attribution.formulation import asked, own_words_row
from .attribution.queries import loglik_flags, query_items, select_failing
from .attribution.rerank import parameter_directions, rerank_order
from .attribution.row_pass import gradient_norms
from .attribution.scoring import aggregate, degenerate, rank, resolve_combine, strongest_items
from .attribution.stage import Ranking, scores_for
from .attribution.values import Scored
from .attribution.windows import WINDOW_ROWS
from .capability.evaluate import CapabilityResult, measure_capability
from .checks.convergence import flag_from_agreement
from .config import Config, dump_config
from .distributed import current
from .verdict import Verdict
from .errors import ModelError
from .explain.blame import ROW_VERDICT_TEXT, blame, row_losses, row_verdict
from .explain.clusters import score_clusters
from .explain.spans import RankingSpans, spans_for, window_char_range
from .grads.capture import GradientCapture
from .io import atomic_save_npy, atomic_write_text
from .memory import memory_guard
from .model_side import ModelSide, gradients_of
from .report.assemble import to_report, totals_of
from .results import Attribution, Explanation, Outcome, Queries, Ranked
from .report.build import capability_json, preview, write_report
from .setup.session import Session, open_session
from .store.build import OpenIndex, open_index


# ------------------------------------------------------------------------------------------------- attribute


def attribute(cfg: Config, *, truth: Optional[dict] = None) -> dict:
    """The main job: evaluate, query, score, explain; writes report.json, scores.npy and report.html and returns
    the report."""
    from .checks import run_checks_for_session

    t_all, c_all = time.time(), time.process_time()
    with memory_guard("load"):
        s = open_session(cfg)
    run_checks_for_session(s)  # stops on error-level checks before anything is written; warnings become flags
    outcome = capability_stage(s)
    queries = query_stage(s, outcome)
    ranked = rank_stage(s, outcome, queries)
    explanation = explain_stage(s, outcome, queries, ranked)
    verdict = Verdict.declined if ranked.declined else outcome.verdict
    s.log.timings["total"] = round(time.time() - t_all, 3)
    s.log.cpu["total"] = round(time.process_time() - c_all, 3)
    a = Attribution(cfg, s.eval_items, tuple(s.log.flags), outcome, queries, ranked, explanation, verdict, truth,
                    dict(s.log.timings), dict(s.log.cpu))
    report = to_report(a)
    _write(cfg, report, explanation.scores, totals_of(a))
    return report


# ------------------------------------------------------------------------------------------------- stages


def capability_stage(s: Session) -> Outcome:
    """The capability outcome: `smoke_test` without an eval set, `declined` when the change is not significant (or
    no item moved), else `attributed`, with the direction and the failing items."""
    cfg = s.cfg
    if s.eval_items is None:
        s.log.flag("evaluation.no_eval_set", "warning", "data.eval is not set", "add an eval set of the capability")
        s.log.flag("attribution.no_capability_target", "warning", "without an eval set the ranking is a smoke test",
                   "add data.eval")
        return Outcome(None, Verdict.smoke_test, "", ())
    cap = evaluate(s)
    if current().is_main:
        atomic_write_text(cfg.output_dir / "capability.json", json.dumps(capability_json(cap, s.eval_items), indent=2))
    failing, direction = select_failing(cap, s.eval_items)
    if not cap.significant:
        s.log.flag("evaluation.not_significant", "warning" if cfg.evaluation.require_significant else "info",
                   f"the {int(cap.confidence * 100)}% interval of the delta [{cap.ci[0]:+.3f}, {cap.ci[1]:+.3f}] "
                   "includes zero", "add eval items or check that the fine-tune changed this capability")
    declined = (not cap.significant and cfg.evaluation.require_significant) or not failing
    return Outcome(cap, Verdict.declined if declined else Verdict.attributed, direction, tuple(failing))


def query_stage(s: Session, outcome: Outcome) -> Queries:
    """The failing items (at most `attribution.max_items`) as queries; own-words queries get their decisive
    tokens (`attribution.decisive`)."""
    cfg, cap = s.cfg, outcome.result
    formulation = asked(cfg.attribution.query, s.metric)
    if cap is None:
        return Queries((), (), formulation)
    qitems = query_items(cap, s.eval_items, list(outcome.failing[: cfg.attribution.max_items]), formulation,
                         metric=cfg.evaluation.metric, direction=outcome.direction)
    if outcome.verdict is Verdict.attributed and formulation.kind.sampled:
        with s.log.stage("behaviour samples", guard="evaluate"):
            qitems = behaviour_queries(s, qitems, outcome.direction)
    if outcome.verdict is Verdict.attributed and any(q.own_words for q in qitems):
        with s.log.stage("decisive tokens", guard="evaluate"):
            kw = dict(chat=s.chat, max_len=cfg.grads.max_seq_length)
            starts = decisive_starts(s.model, s.tokenizer, s.eval_items, qitems, s.metric,
                                     max_new_tokens=cfg.evaluation.max_new_tokens,
                                     batch_size=cfg.evaluation.batch_size, one_line=s.one_line, **kw)
            qitems = with_starts(qitems, starts, decision_positions(s.model, s.tokenizer, s.eval_items, qitems, starts,
                                                                    batch_size=cfg.grads.batch_size, **kw))
    if s.metric.scores_likelihood:
        for f in loglik_flags(qitems):
            s.log.flag(*f)
    texts = tuple(span_text(s, q) if q.own_words and outcome.verdict is Verdict.attributed else ""
                  for q in qitems)
    return Queries(tuple(qitems), texts, formulation)


def behaviour_queries(s: Session, qitems, direction: str) -> list:
    """`attribution.query: behaviour`: the queries with their sampled answers (`attribution.behaviour_samples` at
    `attribution.behaviour_temperature`, `attribution.behaviour`); `query_stage` calls it after `query_items` and
    before the decisive tokens, which then run only for the items left with their own-words query."""
    if not s.metric.generative:
        return list(qitems)
    a = s.cfg.attribution
    samples = sample_answers(s.model, s.tokenizer, s.eval_items, qitems, s.metric, chat=s.chat, n=a.behaviour_samples,
                             max_new_tokens=s.cfg.evaluation.max_new_tokens, seed=s.cfg.seed, one_line=s.one_line,
                             sources=SOURCES, temperature=a.behaviour_temperature)
    return with_samples(qitems, samples, direction)


def rank_stage(s: Session, outcome: Outcome, queries: Queries) -> Ranked:
    """The scores of every row: `scores_for` for an attributed run, each row's gradient norm for a smoke test."""
    if outcome.verdict is Verdict.declined:
        return Ranked(None, None, None, None, None, None)
    if outcome.verdict is Verdict.smoke_test:
        # no query: the rows by their squared exact gradient norm, from one streamed pass (no index is built)
        with s.log.stage("score"):
            squared, agree = gradient_norms(gradients_of(s))
        flag_from_agreement(s, lambda: agree)  # train.not_converged without a recorded loss curve
        _no_supervised_flag(s)
        scores = squared.astype(np.float32)
        return Ranked(None, None, scores, scores, None, None)
    _no_supervised_flag(s)
    combine = resolve_combine(s.cfg.attribution.combine, [q.own_words for q in queries.items])
    with s.log.stage("score"):
        ranking = score_stage(s, list(queries.items), outcome.direction, combine=combine)
    # train.not_converged without a recorded loss curve, over the rows the scores were computed from
    flag_from_agreement(s, ranking.rows.agreement)
    _scoring_flags(s, ranking, len(queries.items))
    sc = ranking.scored.scores
    scores, totals = sc.rank_agg.astype(np.float32), aggregate(sc.per_item).astype(np.float32)
    order, mean_scores, strongest = sc.order, None, None
    if combine == "max":
        # ranked by the item each row stands out on most (robust z per item: `scoring.combine_items`); the accused
        # count and the clusters keep the mean (`resolve_combine`). A projected index's exact re-rank keeps its
        # candidates first, by their max.
        mean_scores = scores
        scores, strongest = strongest_items(sc.rank_item)
        scores = scores.astype(np.float32)
        cand = ranking.scored.rerank.cand
        order = None if sc.order is None else rerank_order(scores, cand, scores[cand])
    declined = degenerate(ranking.scored.basis.norms, scores)
    if declined is not None:
        # A zero query or flat scores accuse nobody: saying "attributed" over an arbitrary order would be a
        # confident wrong verdict.
        s.log.flag(declined[0], "warning", declined[1], "check the failing items' generated answers in report.json "
                   "(query.items); each query needs a passing and a failing answer that differ")
    summary = None if ranking.one_pass else ranking.rows.summary
    return Ranked(ranking, order, scores, totals, declined, summary, combine, mean_scores, strongest)


def score_stage(s: Session, qitems, direction: str, **overrides) -> Ranking:
    """`attribution.stage.scores_for` over the session's model side: the adapter-state strategy the config asks
    for (its flags raised on the session), the config's settings but `overrides`."""
    models = ModelSide(s)
    states, flags = models.states()
    for f in flags:
        s.log.flag(*f)
    return scores_for(models, qitems, ScoringSettings.from_config(s.cfg, direction, **overrides), states, flags)


def explain_stage(s: Session, outcome: Outcome, queries: Queries, ranked: Ranked) -> Explanation:
    """The top rows (losses, verdicts, accused), their spans, the clusters and the items' blame."""
    cfg = s.cfg
    if ranked.scores is None or ranked.declined is not None:
        why = (f"the scores cannot name a cause: {ranked.declined[1]}" if ranked.declined else
               "the verdict is declined: the capability did not move measurably")
        return Explanation((), nobody(why), (), (), None, None, (), None, None)
    ranking, scores = ranked.ranking, ranked.scores
    order = ranked.order if ranked.order is not None else rank(scores)
    if ranking is None:  # smoke test
        none = nobody("a smoke test (no eval set): the ranking shows gradient outliers, not causes")
        with s.log.stage("base_scores"):
            rows = rank_rows(s, order, ranked.totals, scores, None, none)  # each row: accused false
        return Explanation(tuple(rows), none, (), (), None, None, (), scores, ranked.totals)
    accused = accuse(ranking.scored.scores.rank_item, [q.item for q in queries.items], limit=cfg.attribution.top_k)
    with s.log.stage("base_scores"):
        rows = rank_rows(s, order, ranked.totals, scores, ranking.scored, accused, ranked.strongest)
    spans, clusters, info, block, margins = (), (), None, None, ()
    if rows:
        with s.log.stage("spans"):
            found = spans_stage(s, ranking, rows, list(queries.items))
        rows, spans = [found.row(r) for r in rows], tuple(found.spans)
        with s.log.stage("clusters"):
            cl = score_clusters(ranked.count_scores, [e.plain_text() for e in s.examples], seed=cfg.seed,
                                gradients=ranking.features, previews=[preview(e.plain_text()) for e in s.examples])
        clusters, info = tuple(cl["clusters"]), {k: v for k, v in cl.items() if k != "clusters"}
        with s.log.stage("blame"):
            block, per_item = blame(s.model, s.tokenizer, s.eval_items, list(queries.items), rows,
                                    outcome.direction, chat=s.chat, max_len=cfg.grads.max_seq_length,
                                    batch_size=cfg.evaluation.batch_size)
        margins = tuple(per_item)
    return Explanation(tuple(rows), accused, spans, clusters, info, block, margins, scores, ranked.totals)


# ------------------------------------------------------------------------------------------------- parts


def evaluate(s: Session) -> CapabilityResult:
    """The capability delta: base vs fine-tune on the eval set."""
    if not s.eval_items:
        raise ModelError("data.eval is not set: nothing to evaluate (evaluation.no_eval_set)",
                         check="evaluation.no_eval_set")
    c, e = s.cfg, s.cfg.evaluation
    with s.log.stage("evaluate"):
        res = measure_capability(
            s.model, s.tokenizer, s.eval_items, metric=s.metric, chat=s.chat, max_new_tokens=e.max_new_tokens,
            batch_size=e.batch_size, max_len=c.grads.max_seq_length, samples=e.bootstrap_samples,
            confidence=e.confidence, seed=c.seed, one_line=s.one_line,
        )
    return res


def index_stage(s: Session) -> OpenIndex:
    """Build or reuse the gradient index of the training set."""
    with s.log.stage("index"):
        ix = open_index(s.cfg, s.model, s.sites, s.toks, s.adapter_path, s.pad_id)
    _no_supervised_flag(s)
    return ix


def _no_supervised_flag(s: Session) -> None:
    n_empty = sum(1 for t in s.toks if t.n_supervised == 0)
    if n_empty:
        first = [e.id for e, t in zip(s.examples, s.toks) if t.n_supervised == 0][:3]
        s.log.flag("data.no_supervised_tokens", "warning",
                   f"{n_empty} rows have no supervised tokens after truncation to "
                   f"{s.cfg.grads.max_seq_length} (first: {', '.join(first)}); their gradient is zero",
                   "raise grads.max_seq_length or shorten the prompts")


def score_adapter(s: Session, ix: OpenIndex, qitems, direction: str, **settings) -> Scored:
    """The scores of the session's (active) adapter alone from its open index `ix` (whatever its projection), with
    the config's settings but `settings` (e.g. `preconditioner="identity"`, `windows=False`): the index row source
    of `attribution.stage.score_state`, for tests and benches that pin an index."""
    return score_index(gradients_of(s, ix.capture), ix.rows, qitems,
                       ScoringSettings.from_config(s.cfg, direction, **settings), block_dims=block_dims_of(ix.index))


def rank_rows(s: Session, order: np.ndarray, totals: np.ndarray, scores: np.ndarray, st: Optional[Scored],
              accused: Optional[Accusation] = None, strongest: Optional[np.ndarray] = None) -> list[dict]:
    """The top `attribution.top_k` rows of the ranking, each with its base and fine-tuned loss (was it taught?) and,
    given the accusation, whether it is accused (an accused row below the top `attribution.top_k` is listed too, in
    its ranking order: the accusation has its own statistic, `attribution.accused`)."""
    top = order[: s.cfg.attribution.top_k].tolist()
    if accused is not None and accused.count:
        missing = set(accused.positions) - set(top)
        top += [int(p) for p in order if int(p) in missing]
    kw = dict(batch_size=s.cfg.grads.batch_size, pad_id=s.pad_id)
    base_l = row_losses(s.model, s.toks, top, base=True, **kw)
    tuned_l = row_losses(s.model, s.toks, top, base=False, **kw)
    ranking = []
    for r, (p, bl, tl) in enumerate(zip(top, base_l, tuned_l), start=1):
        ex = s.examples[p]
        v = row_verdict(bl, tl)
        row = {"rank": r, "position": p, "id": ex.id, "score": float(totals[p]),
               "window_score": float(scores[p]), "preview": preview(ex.plain_text()), "text": ex.plain_text(),
               "base_loss": float(np.mean(bl)) if len(bl) else float("nan"),
               "tuned_loss": float(np.mean(tl)) if len(tl) else float("nan")}
        if st is not None:
            row["verdict"] = v
            row["verdict_text"] = ROW_VERDICT_TEXT[v]
            if p in st.windows.found:
                a, b = st.windows.found[p]["tokens"]
                rng_c = window_char_range(ex, s.toks[p], a, b, s.tokenizer)
                row["window"] = {"tokens": [int(a), int(b)], **({"start": rng_c[0], "end": rng_c[1]} if rng_c else {})}
            if p in st.exchanges:
                row["turn"] = ranked_turn(ex, st.exchanges.found[p], None if strongest is None else int(strongest[p]))
        if accused is not None:
            row["accused"] = p in accused.positions
        ranking.append(row)
    return ranking


def ranked_turn(ex, found: dict, strongest: Optional[int] = None) -> dict:
    """The report's `turn` of a conversation ranked by its best exchange (`values.Exchanges`): the exchange whose wins
    (the items it is the best exchange of) add the most to the row's ranking score; with items combined by their
    max, the best exchange of `strongest`, the item that sets the row's score."""
    scores, best = np.asarray(found["scores"]), np.asarray(found["best"])
    U = scores.shape[1]
    if strongest is not None:
        k = int(best[strongest])
    else:
        share = np.array([scores[best == u, u].sum() for u in range(U)])
        k = int(np.argmax(share))
    replies = [m["content"] for m in (ex.messages() or []) if m["role"] == "assistant"]
    return {"turn": k, "turns": int(U), "text": replies[k] if k < len(replies) else "",
            "items": int((best == k).sum()), "scores": [round(float(x), 6) for x in scores.mean(0)]}


def spans_stage(s: Session, ranking: Ranking, rows: list[dict], qitems) -> RankingSpans:
    """Sentence spans of the top rows, from per-token contributions at the adapter state the scores came from."""
    st, projector = ranking.scored, ranking.projector
    with state_view(s, ranking.state_path) as view:
        grads = gradients_of(view, GradientCapture(view.model, view.sites, projector,
                                                   chunk=view.cfg.grads.loss_chunk_tokens))

        def contributions(exact_part: bool, positions, items):
            # in the units of the rows' scores (unit rows: times each row's 1 / norm)
            return scaled_contributions(st.basis, grads.contributions(
                parameter_directions(st.basis, st.rerank, projector, exact_part), positions, items))

        return spans_for(rows, st.scores.rank_item, set(st.rerank.cand.tolist()), s.examples, s.toks, qitems,
                         contributions, s.tokenizer)


@contextmanager
def state_view(s: Session, path: Optional[str], label: str = "spans"):
    """The session view at adapter state `path` (None: the session itself, the final adapter)."""
    if path is None:
        yield s
        return
    with s.checkpoint(str(Path(path).resolve()), label) as view:
        yield view


def _scoring_flags(s: Session, ranking: Ranking, n_items: int) -> None:
    """The flags about where the scores came from: the adapter states used, windows not computed for every long
    row, a projected index's self-check."""
    cfg, st = s.cfg, ranking.scored
    s.log.flag("attribution.checkpoints_used", "info", ranking.states_used)
    shortlist = ranking.rows.summary.get("shortlist")
    if shortlist is not None:
        s.log.flag("attribution.shortlist", "info",
                   f"scored from the per-row store an earlier pass left ({ranking.rows.summary['exact_rows']} of "
                   f"{ranking.rows.summary['unique_rows']} rows exactly): {shortlist['rule']}",
                   "set attribution.store: full for an exact pass over every row")
    w = st.windows
    if w.long_rows and not w.all_items:
        if w.bounded:
            s.log.flag("attribution.windows_aggregate_only", "info",
                       f"{len(w.long_rows)} long rows: the {min(len(w.long_rows), WINDOW_ROWS)} with the highest "
                       f"whole-row score got their best-window score for the aggregate ranking, and the "
                       f"{len(w.item_rows)} highest of them per item too; the other long rows are ranked by "
                       "their whole-row score" + (" (conversations of several exchanges are ranked by their best "
                                                  "exchange and not windowed)" if len(st.exchanges) else ""))
        else:
            s.log.flag("attribution.windows_aggregate_only", "info",
                       f"{n_items} failing items: every one of the {len(w.long_rows)} long rows got its best-window "
                       f"score for the aggregate ranking, and the {len(w.item_rows)} highest of them per item "
                       "too; the per-item rankings use the other long rows' totals")
    fid = st.rerank.fidelity
    if fid is not None:
        low = (fid["reranked"] or fid["projected_aggregate"])["top50_recall"]
        if low < cfg.grads.fidelity_warn:
            s.log.flag("index.projection_fidelity", "warning",
                       f"projected scores agree poorly with exact ones (top-50 recall {low:.2f} on a sample of "
                       f"{fid['sample_rows']} rows)", "raise grads.projection_dim or grads.rerank")


def span_text(s: Session, q) -> str:
    """The text of the tokens an own-words query differentiates (the fine-tune's answer from its decisive token)."""
    by_pos = {it.position: it for it in s.eval_items}
    row, _ = own_words_row(s.tokenizer, by_pos[q.item], q, chat=s.chat, max_len=s.cfg.grads.max_seq_length)
    return s.tokenizer.decode([t for t, m in zip(row.input_ids, row.supervised) if m], skip_special_tokens=True)


def _write(cfg: Config, report: dict, scores: Optional[np.ndarray], totals: Optional[np.ndarray]) -> None:
    """report.json, scores.npy, report.html and the resolved config: rank 0's alone under torchrun (every rank
    computed the same report)."""
    if not current().is_main:
        return
    out_dir = cfg.output_dir
    write_report(out_dir, report, scores)
    if scores is not None and totals is not None:
        atomic_save_npy(out_dir / "scores_total.npy", totals.astype(np.float32))
    else:
        (out_dir / "scores_total.npy").unlink(missing_ok=True)  # never leave a previous run's totals beside this report
    atomic_write_text(out_dir / "gradian.resolved.yaml", dump_config(cfg))
