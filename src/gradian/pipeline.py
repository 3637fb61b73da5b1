"""The pipeline behind `gradian attribute`, one function per stage, left to right:

    setup (open_session, checks) -> capability (evaluate) -> index (index_stage) -> queries and scores
    (score_stage: attribution.engine + checkpoints) -> explain (rank_rows, spans, clusters, blame) -> report

`attribute` composes them and writes report.json, scores.npy and report.html; `evaluate` and `index_stage` are also
the `evaluate` and `index` verbs.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import numpy as np

from .attribution.accused import accused_set, none_accused
from .attribution.decisive import decision_positions, decisive_starts, with_starts
from .attribution.engine import ModelGradients, ScoringSettings, block_dims_of, scaled_contributions, score_items
from .attribution.stage import WINDOW_ITEM_ROWS, WINDOW_ROWS, Scored, scores_for, spans_context
from .grads.capture import GradientCapture
from .attribution.queries import loglik_flags, own_words_row, query_items, select_failing
from .attribution.rerank import parameter_directions
from .attribution.scoring import Scores, aggregate, auprc, degenerate, rank, recall_at_k
from .attribution.windows import WINDOW_STRIDE, WINDOW_TOKENS
from .capability.evaluate import CapabilityResult, measure_capability
from .checks.convergence import flag_from_index
from .config import Config, dump_config
from .distributed import current
from .errors import ModelError
from .explain.blame import ROW_VERDICT_TEXT, blame, row_losses, row_verdict
from .explain.clusters import score_clusters
from .explain.spans import spans_for, window_char_range
from .io import atomic_save_npy, atomic_write_text
from .memory import memory_guard
from .report.build import SCHEMA, capability_json, preview, score_summary, verdict_text, write_report
from .setup.session import Session, open_session
from .store.build import OpenIndex, open_index


# ------------------------------------------------------------------------------------------------- stages


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
        s.flag("data.no_supervised_tokens", "warning", f"{n_empty} rows have no supervised tokens after truncation to "
               f"{s.cfg.grads.max_seq_length} (first: {', '.join(first)}); their gradient is zero",
               "raise grads.max_seq_length or shorten the prompts")


def score_adapter(s: Session, ix: OpenIndex, qitems, direction: str, **settings) -> Scores:
    """The scores of the session's (active) adapter alone from its open index `ix` (whatever its projection), with
    the config's settings but `settings` (e.g. `preconditioner="identity"`, `windows=False`): the index path of
    `attribution.stage.score_state`, for tests and benches that pin an index."""
    return score_items(ModelGradients.from_session(s, ix.capture), ix.rows, qitems,
                       ScoringSettings.from_config(s.cfg, direction, **settings), block_dims=block_dims_of(ix.index))


def rank_rows(s: Session, order: np.ndarray, totals: np.ndarray, scores: np.ndarray, sc: Optional[Scores]
              ) -> list[dict]:
    """The top `attribution.top_k` rows of the ranking, each with its base and fine-tuned loss (was it taught?)."""
    top = order[: s.cfg.attribution.top_k].tolist()
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
        if sc is not None:
            row["verdict"] = v
            row["verdict_text"] = ROW_VERDICT_TEXT[v]
            if p in sc.windows:
                a, b = sc.windows[p]["tokens"]
                rng_c = window_char_range(ex, s.toks[p], a, b, s.tokenizer)
                row["window"] = {"tokens": [int(a), int(b)], **({"start": rng_c[0], "end": rng_c[1]} if rng_c else {})}
        ranking.append(row)
    return ranking


def spans_stage(s: Session, scored: Scored, ranking: list[dict], qitems) -> list[dict]:
    """Sentence spans of the top rows, from per-token contributions at the adapter state the scores came from."""
    sc = scored.scores
    with spans_context(s, scored) as view:
        grads = ModelGradients.from_session(view, GradientCapture(view.model, view.sites, scored.projector,
                                                                  chunk=view.cfg.grads.loss_chunk_tokens))

        def contributions(exact_part: bool, positions, items):
            # in the units of the rows' scores (unit rows: times each row's 1 / norm)
            return scaled_contributions(sc, grads.contributions(parameter_directions(sc, scored.projector,
                                                                                    exact_part), positions, items))

        return spans_for(ranking, sc.rank_item, set(sc.cand.tolist()), s.examples, s.toks, qitems, contributions,
                         s.tokenizer)


# ------------------------------------------------------------------------------------------------- attribute


def attribute(cfg: Config, *, truth: Optional[dict] = None) -> dict:
    """The main job: evaluate, index, query, score, explain; writes report.json, scores.npy and report.html and
    returns the report."""
    from .checks import run_checks_for_session

    t_all, c_all = time.time(), time.process_time()
    with memory_guard("load"):
        s = open_session(cfg)
    run_checks_for_session(s)  # stops on error-level checks before anything is written; warnings become flags
    out_dir = cfg.output_dir
    report: dict = {"schema": SCHEMA, "flags": s.flags, "settings": json.loads(json.dumps(cfg.model_dump(mode="json")))}
    report["settings"].pop("root", None)
    cap, verdict, direction, failing = _capability(s, out_dir)
    report["capability"] = capability_json(cap, s.eval_items) if cap else None
    qitems = query_items(cap, s.eval_items, failing[: cfg.attribution.max_items], cfg.attribution.query,
                         metric=cfg.evaluation.metric, direction=direction) if cap else []
    if verdict == "attributed" and any(q.formulation == "own_words" for q in qitems):
        with s.log.stage("decisive tokens", guard="evaluate"):
            kw = dict(chat=s.chat, max_len=cfg.grads.max_seq_length)
            starts = decisive_starts(s.model, s.tokenizer, s.eval_items, qitems, s.metric,
                                     max_new_tokens=cfg.evaluation.max_new_tokens,
                                     batch_size=cfg.evaluation.batch_size, one_line=s.one_line, **kw)
            qitems = with_starts(qitems, starts, decision_positions(s.model, s.tokenizer, s.eval_items, qitems, starts,
                                                                    batch_size=cfg.grads.batch_size, **kw))
    if cap is not None and cfg.evaluation.metric == "loglik":
        for f in loglik_flags(qitems):
            s.flag(*f)
    report["query"] = {"formulation": cfg.attribution.query, "direction": direction, "items": []}
    scores, totals, ranking, clusters, spans_out, blame_out = None, None, [], [], [], None
    accused = none_accused("the verdict is declined: the capability did not move measurably" if verdict == "declined"
                           else "a smoke test (no eval set): the ranking shows gradient outliers, not causes")
    declined_why = None
    if verdict != "declined":
        scored, ix, sc = None, None, None
        if verdict == "attributed":
            _no_supervised_flag(s)
            with s.log.stage("score"):
                scored = scores_for(s, qitems, direction)
            # train.not_converged without a recorded loss curve, over the rows the scores were computed from
            flag_from_index(s, scored.one_pass.held if scored.one_pass is not None else scored.features)
            report["index"] = scored.rows_summary if scored.one_pass is None else None
            if scored.one_pass is not None:
                report["scoring"] = scored.rows_summary
            sc = _attributed_scores(s, scored, qitems, report)
            order, scores, totals = sc.order, sc.rank_agg.astype(np.float32), aggregate(sc.per_item).astype(np.float32)
            declined_why = degenerate(sc.norms, scores)
        if declined_why is not None:
            # A zero query or flat scores accuse nobody: saying "attributed" over an arbitrary order would be a
            # confident wrong verdict.
            fid, why = declined_why
            s.flag(fid, "warning", why, "check the failing items' generated answers in report.json (query.items); "
                   "each query needs a passing and a failing answer that differ")
            verdict, sc, order, scores, totals = "declined", None, None, None, None
            accused = none_accused(f"the scores cannot name a cause: {why}")
        elif verdict == "attributed":
            pass
        else:
            ix = index_stage(s)
            flag_from_index(s, ix.rows)  # train.not_converged without a recorded loss curve
            report["index"] = ix.info.summary()
            order, scores = None, _self_influence(ix)
            totals = scores
        if scores is not None:
            with s.log.stage("base_scores"):
                ranking = rank_rows(s, order if order is not None else rank(scores), totals, scores, sc)
        if sc is not None:
            accused = accused_set(scores, order if order is not None else rank(scores), limit=cfg.attribution.top_k)
            for row in ranking:
                row["accused"] = row["rank"] <= accused["count"]
        if sc is not None and ranking:
            with s.log.stage("spans"):
                spans_out = spans_stage(s, scored, ranking, qitems)
            with s.log.stage("clusters"):
                cl = score_clusters(scores, [e.plain_text() for e in s.examples], seed=cfg.seed,
                                    gradients=scored.features,
                                    previews=[preview(e.plain_text()) for e in s.examples])
            clusters = cl["clusters"]
            report["clusters_info"] = {k: v for k, v in cl.items() if k != "clusters"}
            with s.log.stage("blame"):
                blame_out = blame(s.model, s.tokenizer, s.eval_items, qitems, report["query"]["items"], ranking,
                                  direction, chat=s.chat, max_len=cfg.grads.max_seq_length,
                                  batch_size=cfg.evaluation.batch_size)
        if ix is not None:
            ix.close()
        if scored is not None:
            scored.close()
    report.update({
        "verdict": verdict,
        "verdict_text": verdict_text(verdict, cap, len(qitems), direction,
                                     declined_why[1] if declined_why else None),
        "ranking": ranking,
        "accused": accused,
        "clusters": clusters,
        "spans": spans_out,
        "scores_summary": score_summary(scores) if scores is not None else {"n": 0},
    })
    if blame_out is not None:
        report["blame"] = blame_out
    report.setdefault("index", None)
    if truth is not None:
        report["truth"] = truth
        if scores is not None and truth.get("planted"):
            report["metrics"] = {"recall_at_10": recall_at_k(scores, truth["planted"], 10),
                                 "auprc": auprc(scores, truth["planted"])}
    s.timings["total"] = round(time.time() - t_all, 3)
    s.log.cpu["total"] = round(time.process_time() - c_all, 3)
    report["timings"] = s.timings
    report["timings_cpu"] = s.log.cpu
    _write(cfg, report, scores, totals if verdict == "attributed" else None)
    return report


def _capability(s: Session, out_dir) -> tuple[Optional[CapabilityResult], str, str, list[int]]:
    """(capability, verdict, direction, failing items): `smoke_test` without an eval set, `declined` when the
    change is not significant (or no item moved)."""
    cfg = s.cfg
    if s.eval_items is None:
        s.flag("evaluation.no_eval_set", "warning", "data.eval is not set", "add an eval set of the capability")
        s.flag("attribution.no_capability_target", "warning", "without an eval set the ranking is a smoke test",
               "add data.eval")
        return None, "smoke_test", "", []
    cap = evaluate(s)
    if current().is_main:
        atomic_write_text(out_dir / "capability.json", json.dumps(capability_json(cap, s.eval_items), indent=2))
    failing, direction = select_failing(cap, s.eval_items)
    if not cap.significant:
        s.flag("evaluation.not_significant", "warning" if cfg.evaluation.require_significant else "info",
               f"the {int(cap.confidence * 100)}% interval of the delta [{cap.ci[0]:+.3f}, {cap.ci[1]:+.3f}] "
               "includes zero", "add eval items or check that the fine-tune changed this capability")
    declined = (not cap.significant and cfg.evaluation.require_significant) or not failing
    return cap, "declined" if declined else "attributed", direction, failing


def _attributed_scores(s: Session, scored: Scored, qitems, report: dict) -> Scores:
    """The scores of an attributed run, with their report entries (preconditioner, windows, checkpoints, the
    projection self-check and the per-item rankings) and flags."""
    cfg = s.cfg
    sc, ck = scored.scores, scored.source.entry
    if ck is not None:
        report["query"]["optimizer" if "optimizer" in ck else "checkpoints"] = ck
    s.flag("attribution.checkpoints_used", "info", _checkpoints_used(cfg, ck))
    report["query"]["preconditioner"] = sc.precond.describe()
    report["windows"] = {
        "tokens": WINDOW_TOKENS, "stride": WINDOW_STRIDE, "long_rows": len(sc.long_rows),
        "per_item_rows": len(sc.window_item_rows),
        "rule": _windows_rule(scored),
    }
    if sc.long_rows and not sc.window_items:
        s.flag("attribution.windows_aggregate_only", "info",
               f"{len(qitems)} failing items: every one of the {len(sc.long_rows)} long rows got its best-window "
               f"score for the aggregate ranking, and the {len(sc.window_item_rows)} highest of them per item "
               "too; the per-item rankings use the other long rows' totals")
    fid = sc.fidelity
    if fid is not None:
        report["index"]["fidelity"] = fid
        low = (fid["reranked"] or fid["projected_aggregate"])["top50_recall"]
        if low < cfg.grads.fidelity_warn:
            s.flag("index.projection_fidelity", "warning",
                   f"projected scores agree poorly with exact ones (top-50 recall {low:.2f} on a sample of "
                   f"{fid['sample_rows']} rows)", "raise grads.projection_dim or grads.rerank")
    for qi, row, rrow in zip(qitems, sc.per_item, sc.rank_item):
        top = rank(rrow, cfg.attribution.top_k)
        report["query"]["items"].append({
            "item": qi.item, "prompt": qi.prompt, "expected": qi.expected, "generated": qi.generated,
            "base_generated": qi.base_generated, "formulation": qi.formulation, "target": qi.target,
            **({"contrast": qi.contrast} if qi.contrast else {}), "target_source": qi.target_source,
            **({"query_span": _span_text(s, qi), "span_start": qi.span_start, "span": list(qi.span)}
               if qi.formulation == "own_words" else {}),
            "ranking": [{"position": int(p), "score": float(rrow[p]),
                         **({"total": float(row[p])} if p in sc.windows else {})} for p in top[:10]],
        })
    return sc


def _windows_rule(scored: Scored) -> str:
    """The report's sentence on how long rows are ranked."""
    if scored.one_pass is not None:
        return (f"of the rows with more than {WINDOW_TOKENS} supervised tokens, the {WINDOW_ROWS} with the highest "
                f"whole-row score are ranked by their best window ({WINDOW_TOKENS} supervised tokens, stride "
                f"{WINDOW_STRIDE}; per item for the top {WINDOW_ITEM_ROWS} of them); every other row by its total "
                "score; scores.npy holds the ranking score, scores_total.npy the totals")
    return (f"rows with more than {WINDOW_TOKENS} supervised tokens are ranked by their best window "
            f"({WINDOW_TOKENS} supervised tokens, stride {WINDOW_STRIDE}); every other row by its total "
            "score; scores.npy holds the ranking score, scores_total.npy the totals")


def _span_text(s: Session, q) -> str:
    """The text of the tokens an own-words query differentiates (the fine-tune's answer from its decisive token)."""
    by_pos = {it.position: it for it in s.eval_items}
    row, _ = own_words_row(s.tokenizer, by_pos[q.item], q, chat=s.chat, max_len=s.cfg.grads.max_seq_length)
    return s.tokenizer.decode([t for t, m in zip(row.input_ids, row.supervised) if m], skip_special_tokens=True)


def _checkpoints_used(cfg: Config, ck: Optional[dict]) -> str:
    """Which adapters the scores come from, in one sentence (the `attribution.checkpoints_used` flag)."""
    if ck is not None and "optimizer" in ck:
        return (f"optimizer-aware scores (attribution.optimizer: adamw): the recorded AdamW run replayed over its "
                f"{ck['epochs']} epochs")
    if ck is not None and ck.get("setting") == "earliest":
        return (f"the earliest saved checkpoint alone ({ck['labels'][0]}, attribution.checkpoints: earliest): its "
                "scores, windows and spans; blame compares the base with the final adapter")
    if ck is not None:
        how = {"saved": "saved beside the adapter (no training)", "replayed": "replayed once from the adapter's "
               "Gradian recipe", "attribution.checkpoint_adapters": "listed in attribution.checkpoint_adapters"}
        return (f"scores averaged over {ck['count']} checkpoints ({', '.join(ck['labels'])}), the earlier ones "
                f"{how.get(ck['source'], ck['source'])}")
    if cfg.attribution.checkpoints == "auto":
        return ("the final adapter alone: attribution.checkpoints is auto and no checkpoint was saved beside the "
                "adapter (gradian train saves one per epoch; TRL and the HF Trainer write checkpoint-* folders)")
    if cfg.attribution.checkpoints == "earliest":
        return ("the final adapter alone: attribution.checkpoints is earliest and no checkpoint was saved beside "
                "the adapter (gradian train saves one per epoch; TRL and the HF Trainer write checkpoint-* folders)")
    return "the final adapter alone (attribution.checkpoints: 1)" if cfg.attribution.checkpoints == 1 else \
        "the final adapter alone: no earlier checkpoint could be had"


def _self_influence(ix: OpenIndex) -> np.ndarray:
    """Smoke test (no eval set): each row's squared gradient norm, the rows most unlike the rest."""
    sq = {k: float(v) for keys, block in ix.index.iter_shards() for k, v in zip(keys, np.square(block).sum(1))}
    return np.array([sq[k] for k in ix.row_keys], dtype=np.float32)


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
