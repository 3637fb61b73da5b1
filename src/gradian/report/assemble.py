"""report.json from a finished attribution: the one place the report's keys are spelled (schema gradian.report/1,
`report.schema`). Every stage hands its typed value forward; `to_report` reads them and writes nothing back."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from ..attribution.scoring import auprc, rank, recall_at_k
from ..attribution.windows import WINDOW_STRIDE, WINDOW_TOKENS
from .build import SCHEMA, capability_json, score_summary, verdict_text

from ..results import Attribution
from ..verdict import Verdict


def to_report(a: Attribution) -> dict:
    """The report of an attribution (a plain dict, the JSON written to report.json)."""
    out, ranked, ex = a.outcome, a.ranked, a.explanation
    settings = json.loads(json.dumps(a.cfg.model_dump(mode="json")))
    settings.pop("root", None)
    ranking = ranked.ranking
    report: dict = {"schema": SCHEMA, "flags": list(a.flags), "settings": settings,
                    "capability": capability_json(out.result, a.eval_items) if out.result else None,
                    "query": query_entry(a)}
    if ranked.index_summary is not None:
        report["index"] = dict(ranked.index_summary)
        if ranking is not None and ranking.scored.rerank.fidelity is not None:
            report["index"]["fidelity"] = ranking.scored.rerank.fidelity
    if ranking is not None and ranking.one_pass:
        report["scoring"] = dict(ranking.rows.summary)
    if ranking is not None:
        report["windows"] = windows_entry(ranking)
    scores = ex.scores
    report.update({
        "verdict": a.verdict,
        "verdict_text": verdict_text(a.verdict, out.result, len(a.queries.items), out.direction,
                                     ranked.declined[1] if ranked.declined else None),
        "ranking": [dict(r) for r in ex.rows],
        "accused": ex.accused.to_report(),
        "clusters": list(ex.clusters),
        "spans": list(ex.spans),
        "scores_summary": score_summary(scores) if scores is not None else {"n": 0},
    })
    if ex.clusters_info is not None:
        report["clusters_info"] = ex.clusters_info
    if ex.blame is not None:
        report["blame"] = ex.blame
    report.setdefault("index", None)
    if a.truth is not None:
        report["truth"] = a.truth
        if scores is not None and a.truth.get("planted"):
            report["metrics"] = {"recall_at_10": recall_at_k(scores, a.truth["planted"], 10),
                                 "auprc": auprc(scores, a.truth["planted"])}
    report["timings"] = dict(a.timings)
    report["timings_cpu"] = dict(a.timings_cpu)
    return report


def query_entry(a: Attribution) -> dict:
    """`query`: the formulation, direction, the scores' source (checkpoints or optimizer), the preconditioner and,
    per failing item, its query and its top rows."""
    cfg, ranking, q = a.cfg, a.ranked.ranking, a.queries
    entry: dict = {"formulation": str(q.formulation), "direction": a.outcome.direction, "items": []}
    if ranking is None:
        return entry
    sc, ck, found = ranking.scored.scores, ranking.source.entry, ranking.scored.windows.found
    if ck is not None:
        entry["optimizer" if "optimizer" in ck else "checkpoints"] = ck
    entry["preconditioner"] = ranking.scored.basis.precond.describe()
    entry["combine"] = a.ranked.combine
    margins = a.explanation.margins or [{}] * len(q.items)
    for qi, text, row, rrow, m in zip(q.items, q.span_texts, sc.per_item, sc.rank_item, margins):
        top = rank(rrow, cfg.attribution.top_k)
        entry["items"].append({
            "item": qi.item, "prompt": qi.prompt, "expected": qi.expected, "generated": qi.generated,
            "base_generated": qi.base_generated, "formulation": str(qi.formulation), "target": qi.target,
            **({"contrast": qi.contrast} if qi.contrast else {}), "target_source": qi.target_source,
            **({"query_span": text, "span_start": qi.span_start, "span": list(qi.span)} if qi.own_words else {}),
            **({"samples": [[t, w] for t, w in qi.samples]} if qi.samples else {}),
            "ranking": [{"position": int(p), "score": float(rrow[p]),
                         **({"total": float(row[p])} if p in found else {})} for p in top[:10]],
            **m,
        })
    return entry


def windows_entry(ranking) -> dict:
    from ..attribution.windows import WINDOW_ITEM_ROWS, WINDOW_ROWS

    w, ex = ranking.scored.windows, ranking.scored.exchanges
    if w.bounded or ranking.one_pass:
        turns = (f"the {len(ex)} conversations of several exchanges are ranked per item by their best exchange "
                 "(each exchange's part of the row's gradient at unit norm); of the other rows with" if len(ex) else
                 "of the rows with")
        rule = (f"{turns} more than {WINDOW_TOKENS} supervised tokens, the {WINDOW_ROWS} with the highest "
                f"whole-row score are ranked by their best window ({WINDOW_TOKENS} supervised tokens, stride "
                f"{WINDOW_STRIDE}; per item for the top {WINDOW_ITEM_ROWS} of them); every other row by its total "
                "score; scores.npy holds the ranking score, scores_total.npy the totals")
    else:
        rule = (f"rows with more than {WINDOW_TOKENS} supervised tokens are ranked by their best window "
                f"({WINDOW_TOKENS} supervised tokens, stride {WINDOW_STRIDE}); every other row by its total "
                "score; scores.npy holds the ranking score, scores_total.npy the totals")
    return {"tokens": WINDOW_TOKENS, "stride": WINDOW_STRIDE, "long_rows": len(w.long_rows),
            "per_item_rows": len(w.item_rows), "rule": rule}


def totals_of(a: Attribution) -> Optional[np.ndarray]:
    """scores_total.npy: the whole-row totals of an attributed run (None otherwise)."""
    return a.explanation.totals if a.verdict is Verdict.attributed else None
