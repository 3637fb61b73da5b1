"""The Python API behind every CLI verb: evaluate, index, attribute."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .capability import CapabilityResult, measure_capability
from .capture import GradientCapture, site_shapes
from .fidelity_check import agreement, order_scores, rerank_order
from .progress import progress_bar
from .projection import Projector
from .config import Config, dump_config
from .data import (
    Example, EvalItem, Tokenized, collate, has_chat_template, load_eval, load_train, tokenize_example, uses_chat,
)
from .errors import ModelError
from .indexing import IndexInfo, build_index, cache_key, make_projector
from .loss import per_example_loss
from .modeling import dir_fingerprint, load_model, load_tokenizer, lora_sites
from .query import query_items, query_vectors, select_failing
from .report import SCHEMA, atomic_write_text, preview, score_summary, write_report
from .runtime import configure_threads, seed_everything
from .scoring import aggregate, harm_from_inner, rank, unit_queries
from .blame import ROW_VERDICT_TEXT, item_margins, item_statement, row_verdict, summarize
from .clusters import score_clusters
from .precondition import Preconditioner, RowSource
from .spans import (WINDOW_STRIDE, WINDOW_TOKENS, back_project, best_window, is_long, row_spans, token_contributions,
                    window_char_range)


@dataclass
class Session:
    """What every verb loads once: config, tokenizer, data, model and the LoRA sites."""

    cfg: Config
    tokenizer: object
    examples: list[Example]
    eval_items: Optional[list[EvalItem]]
    model: object
    sites: list
    skipped: list[str]
    adapter_path: str
    chat: bool
    flags: list[dict] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    _toks: Optional[list[Tokenized]] = None

    @property
    def toks(self) -> list[Tokenized]:
        if self._toks is None:
            self._toks = [tokenize_example(self.tokenizer, e, self.cfg.grads.max_seq_length) for e in self.examples]
        return self._toks

    def flag(self, id: str, level: str, message: str, fix: str = "") -> None:
        if not any(f["id"] == id for f in self.flags):
            self.flags.append({"id": id, "level": level, "message": message, "fix": fix})


def open_session(cfg: Config, *, need_eval: bool = True) -> Session:
    configure_threads(cfg.model.threads)
    seed_everything(cfg.seed)
    t0 = time.time()
    examples = load_train(cfg.path(cfg.data.train))
    eval_items = load_eval(cfg.path(cfg.data.eval)) if (cfg.data.eval and need_eval) else None
    tok = load_tokenizer(cfg)
    adapter = cfg.local_or_hub(cfg.model.adapter, "model.adapter")
    model = load_model(cfg, adapter)
    sites, skipped = lora_sites(model, cfg.grads.module_filter)
    if not sites:
        what = f" matching grads.module_filter {cfg.grads.module_filter}" if cfg.grads.module_filter else ""
        raise ModelError(f"model.adapter '{adapter}': no LoRA Linear sites{what} to capture gradients on"
                         + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    s = Session(cfg, tok, examples, eval_items, model, sites, skipped, str(adapter), uses_chat(examples))
    s.timings["load"] = round(time.time() - t0, 3)
    return s


def evaluate(s: Session) -> CapabilityResult:
    if not s.eval_items:
        raise ModelError("data.eval is not set: nothing to evaluate (evaluation.no_eval_set)")
    c, e = s.cfg, s.cfg.evaluation
    t0 = time.time()
    res = measure_capability(
        s.model, s.tokenizer, s.eval_items, metric=e.metric, chat=s.chat, max_new_tokens=e.max_new_tokens,
        batch_size=e.batch_size, max_len=c.grads.max_seq_length, samples=e.bootstrap_samples, confidence=e.confidence,
        seed=c.seed,
    )
    s.timings["evaluate"] = round(time.time() - t0, 3)
    return res


def capability_json(s: Session, cap: CapabilityResult) -> dict:
    d = cap.summary()
    d["items"] = [
        {"item": it.position, "prompt": it.question_text(), "expected": it.answer, "base_generated": bg,
         "generated": tg, "base_score": bsc, "tuned_score": tsc}
        for it, bg, tg, bsc, tsc in zip(s.eval_items or [], cap.base_generated, cap.tuned_generated, cap.base_scores,
                                        cap.tuned_scores)
    ]
    return d


def index(s: Session):
    """Build or reuse the gradient index for the training set."""
    t0 = time.time()
    proj = make_projector(s.cfg, s.sites)
    capture = GradientCapture(s.model, s.sites, proj, chunk=s.cfg.grads.loss_chunk_tokens)
    key = cache_key(s.cfg, s.sites, proj, s.adapter_path)
    meta = {
        "base": s.cfg.model.base, "adapter": s.adapter_path,
        "base_fingerprint": dir_fingerprint(s.cfg.local_or_hub(s.cfg.model.base)),
        "adapter_fingerprint": dir_fingerprint(s.adapter_path),
        "sites": [{"name": x.name, "r": x.r, "d_in": x.d_in, "d_out": x.d_out} for x in s.sites],
        "block_dims": proj.site_dims(), "projection": proj.describe(),
        "grads": s.cfg.grads.model_dump(mode="json"),
    }
    pad = s.tokenizer.pad_token_id
    idx, row_keys, info = build_index(s.cfg, capture, s.toks, key=key, pad_id=pad, meta=meta)
    s.timings["index"] = round(time.time() - t0, 3)
    n_empty = sum(1 for t in s.toks if t.n_supervised == 0)
    if n_empty:
        first = [e.id for e, t in zip(s.examples, s.toks) if t.n_supervised == 0][:3]
        s.flag("data.no_supervised_tokens", "warning", f"{n_empty} rows have no supervised tokens after truncation to "
               f"{s.cfg.grads.max_seq_length} (first: {', '.join(first)}); their gradient is zero",
               "raise grads.max_seq_length or shorten the prompts")
    return capture, idx, row_keys, info


@torch.no_grad()
def row_losses(s: Session, positions: list[int], *, base: bool) -> list[float]:
    """Each row's mean supervised-token loss under the fine-tune or (adapter disabled) the base."""
    toks = [s.toks[p] for p in positions]
    out: list[float] = []
    device = next(s.model.parameters()).device
    ctx = s.model.disable_adapter() if base else _null()
    with ctx:
        for i in range(0, len(toks), s.cfg.grads.batch_size):
            batch = toks[i : i + s.cfg.grads.batch_size]
            ids, attn, sup = collate(batch, s.tokenizer.pad_token_id)
            l = per_example_loss(s.model, ids.to(device), attn.to(device), sup.to(device))
            out.extend((l.cpu() / torch.tensor([max(t.n_supervised, 1) for t in batch])).tolist())
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _verdict_text(verdict: str, cap: Optional[CapabilityResult], n_items: int, direction: str) -> str:
    if verdict == "smoke_test":
        return ("No eval set, so there is no capability to attribute: the ranking shows the rows with the largest "
                "gradients (outliers), not causes.")
    assert cap is not None
    lo, hi = cap.ci
    if verdict == "declined":
        return (f"The fine-tune did not move {cap.metric} measurably: delta {cap.delta:+.3f} with a "
                f"{int(cap.confidence * 100)}% interval [{lo:+.3f}, {hi:+.3f}] that includes zero (the smallest delta "
                f"{cap.n} items can detect is about {cap.min_detectable_delta:.2f}). No training rows are accused.")
    moved = "fell" if cap.delta < 0 else "rose"
    return (f"{cap.metric} {moved} from {cap.base:.2f} to {cap.tuned:.2f} (delta {cap.delta:+.3f}, "
            f"{int(cap.confidence * 100)}% interval [{lo:+.3f}, {hi:+.3f}]). The rows below are ranked by how much "
            f"training on them pushed the model toward the {n_items} {direction} item(s).")


def attribute(cfg: Config, *, truth: Optional[dict] = None, console=None) -> dict:
    """The main job: evaluate, index, query, score; writes report.json, scores.npy and report.html."""
    from .checks import run_checks_for_session

    t_all = time.time()
    s = open_session(cfg)
    run_checks_for_session(s)  # stops on error-level checks before anything is written; warnings become flags
    out_dir = cfg.output_dir
    cap: Optional[CapabilityResult] = None
    report: dict = {"schema": SCHEMA, "flags": s.flags, "settings": json.loads(json.dumps(cfg.model_dump(mode="json")))}
    report["settings"].pop("root", None)
    if s.eval_items is None:
        s.flag("evaluation.no_eval_set", "warning", "data.eval is not set", "add an eval set of the capability")
        s.flag("attribution.no_capability_target", "warning", "without an eval set the ranking is a smoke test",
               "add data.eval")
        verdict, direction, failing = "smoke_test", "", []
    else:
        cap = evaluate(s)
        atomic_write_text(out_dir / "capability.json", json.dumps(capability_json(s, cap), indent=2))
        failing, direction = select_failing(cap, s.eval_items)
        if not cap.significant:
            s.flag("evaluation.not_significant", "warning" if cfg.evaluation.require_significant else "info",
                   f"the {int(cap.confidence * 100)}% interval of the delta [{cap.ci[0]:+.3f}, {cap.ci[1]:+.3f}] "
                   "includes zero", "add eval items or check that the fine-tune changed this capability")
        verdict = "declined" if (not cap.significant and cfg.evaluation.require_significant) or not failing else "attributed"
    report["capability"] = capability_json(s, cap) if cap else None
    scores = None
    ranking: list[dict] = []
    qitems = query_items(cap, s.eval_items, failing[: cfg.attribution.max_items], cfg.attribution.query,
                         metric=cfg.evaluation.metric) if cap else []
    if cap is not None and cfg.evaluation.metric == "loglik":
        _loglik_flags(s, qitems)
    report["query"] = {"formulation": cfg.attribution.query, "direction": direction, "items": []}
    clusters: list[dict] = []
    spans_out: list[dict] = []
    blame = None
    if verdict != "declined":
        capture, idx, row_keys, info = index(s)
        report["index"] = info.summary()
        t0 = time.time()
        order = None
        sc = None
        if verdict == "attributed":
            sc = score_items(s, capture, idx, row_keys, qitems, direction, details=True)
            from .checkpoints import apply as over_checkpoints

            ck = over_checkpoints(s, sc, qitems, direction)
            if ck is not None:
                report["query"]["checkpoints"] = ck
            order, fid = sc.order, sc.fidelity
            scores = sc.rank_agg.astype(np.float32)
            totals = aggregate(sc.per_item).astype(np.float32)
            report["query"]["preconditioner"] = sc.precond.describe()
            report["windows"] = {
                "tokens": WINDOW_TOKENS, "stride": WINDOW_STRIDE, "long_rows": len(sc.long_rows),
                "per_item_rows": len(sc.window_item_rows),
                "rule": (f"rows with more than {WINDOW_TOKENS} supervised tokens are ranked by their best window "
                         f"({WINDOW_TOKENS} supervised tokens, stride {WINDOW_STRIDE}); every other row by its total "
                         "score; scores.npy holds the ranking score, scores_total.npy the totals"),
            }
            if sc.long_rows and not sc.window_items:
                s.flag("attribution.windows_aggregate_only", "info",
                       f"{len(qitems)} failing items: every one of the {len(sc.long_rows)} long rows got its best-window "
                       f"score for the aggregate ranking, and the {len(sc.window_item_rows)} highest of them per item "
                       "too; the per-item rankings use the other long rows' totals")
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
                    "base_generated": qi.base_generated, "formulation": qi.formulation,
                    "ranking": [{"position": int(p), "score": float(rrow[p]),
                                 **({"total": float(row[p])} if p in sc.windows else {})} for p in top[:10]],
                })
        else:
            # Smoke test: squared gradient norm (self-influence), the rows most unlike the rest.
            sq = {k: float(v) for keys, block in idx.iter_shards() for k, v in zip(keys, np.square(block).sum(1))}
            scores = np.array([sq[k] for k in row_keys], dtype=np.float32)
            totals = scores
        s.timings["score"] = round(time.time() - t0, 3)
        top = (order if order is not None else rank(scores))[: cfg.attribution.top_k].tolist()
        t0 = time.time()
        base_l = row_losses(s, top, base=True)
        tuned_l = row_losses(s, top, base=False)
        for r, (p, bl, tl) in enumerate(zip(top, base_l, tuned_l), start=1):
            ex = s.examples[p]
            v = row_verdict(bl, tl)
            row = {"rank": r, "position": p, "id": ex.id, "score": float(totals[p]),
                   "window_score": float(scores[p]), "preview": preview(ex.plain_text()), "text": ex.plain_text(),
                   "base_loss": float(bl), "tuned_loss": float(tl)}
            if sc is not None:
                row["verdict"] = v
                row["verdict_text"] = ROW_VERDICT_TEXT[v]
                if p in sc.windows:
                    a, b = sc.windows[p]["tokens"]
                    rng_c = window_char_range(ex, s.toks[p], a, b, s.tokenizer)
                    row["window"] = {"tokens": [int(a), int(b)],
                                     **({"start": rng_c[0], "end": rng_c[1]} if rng_c else {})}
            ranking.append(row)
        s.timings["base_scores"] = round(time.time() - t0, 3)
        if sc is not None and ranking:
            t0 = time.time()
            spans_out = _spans(s, sc, ranking, qitems)
            s.timings["spans"] = round(time.time() - t0, 3)
            t0 = time.time()
            cl = score_clusters(scores, [e.plain_text() for e in s.examples], seed=cfg.seed,
                                gradients=RowSource(index=idx, row_keys=row_keys),
                                previews=[preview(e.plain_text()) for e in s.examples])
            clusters = cl["clusters"]
            report["clusters_info"] = {k: v for k, v in cl.items() if k != "clusters"}
            s.timings["clusters"] = round(time.time() - t0, 3)
            t0 = time.time()
            blame = _blame(s, cap, qitems, report["query"]["items"], ranking, direction)
            s.timings["blame"] = round(time.time() - t0, 3)
        idx.close()
    report.update({
        "verdict": verdict,
        "verdict_text": _verdict_text(verdict, cap, len(qitems), direction),
        "ranking": ranking,
        "clusters": clusters,
        "spans": spans_out,
        "scores_summary": score_summary(scores) if scores is not None else {"n": 0},
    })
    if blame is not None:
        report["blame"] = blame
    report.setdefault("index", None)
    if truth is not None:
        report["truth"] = truth
        if scores is not None and truth.get("planted"):
            from .scoring import auprc, recall_at_k

            report["metrics"] = {"recall_at_10": recall_at_k(scores, truth["planted"], 10),
                                 "auprc": auprc(scores, truth["planted"])}
    s.timings["total"] = round(time.time() - t_all, 3)
    report["timings"] = s.timings
    write_report(out_dir, report, scores)
    if scores is not None and verdict == "attributed":
        from .report import atomic_save_npy

        atomic_save_npy(out_dir / "scores_total.npy", totals.astype(np.float32))
    else:
        (out_dir / "scores_total.npy").unlink(missing_ok=True)  # never leave a previous run's totals beside this report
    atomic_write_text(out_dir / "gradian.resolved.yaml", dump_config(cfg))
    return report


SPAN_ROWS = 10  # ranking rows that get a span drill-down
SPANS_PER_ROW = 3


def _spans(s: Session, sc: Scored, ranking: list[dict], qitems) -> list[dict]:
    """Sentence spans of the top rows against each row's most-harmed failing item (ranking[i].top_span and the
    top-level list). A row's span scores add up to its per-item score for that item."""
    rows = ranking[:SPAN_ROWS]
    if not rows:
        return []
    positions = [r["position"] for r in rows]
    items = [int(np.argmax(sc.rank_item[:, p])) for p in positions]
    cand = set(sc.cand.tolist())
    out: list[dict] = []
    groups = {False: [j for j, p in enumerate(positions) if p not in cand],
              True: [j for j, p in enumerate(positions) if p in cand]}
    for exact_part, js in groups.items():
        if not js:
            continue
        dirs = _dirs_for(sc, exact_part)
        res = _contribs(s, dirs, [positions[j] for j in js], [items[j] for j in js])
        for j in js:
            p, k = positions[j], items[j]
            contrib = res[(p, k)]
            spans = row_spans(s.examples[p], s.toks[p], contrib, s.tokenizer)
            if not spans:
                continue
            total = float(contrib.sum())
            top = spans[0]
            rows[j]["top_span"] = {"start": top["start"], "end": top["end"], "text": top["text"],
                                   "score": top["score"], "item": int(qitems[k].item), "item_score": total}
            for sp in spans[:SPANS_PER_ROW]:
                out.append({"position": p, "start": sp["start"], "end": sp["end"], "text": sp["text"],
                            "score": sp["score"], "tokens": sp["tokens"], "item": int(qitems[k].item),
                            "item_score": total, "share": sp["score"] / total if total else None})
    out.sort(key=lambda d: (-d["score"], d["position"], d["start"]))
    return out


def _blame(s: Session, cap, qitems, report_items: list[dict], ranking: list[dict], direction: str) -> dict:
    """Per failing item: margin log p(expected) - log p(generated) under base and fine-tune, and its statement;
    the top-level summary."""
    by_pos = {it.position: it for it in s.eval_items or []}
    its = [by_pos[q.item] for q in qitems]
    c, e = s.cfg, s.cfg.evaluation
    mb, mt = item_margins(s.model, s.tokenizer, its, [q.expected for q in qitems], [q.generated for q in qitems],
                          chat=s.chat, max_len=c.grads.max_seq_length, batch_size=e.batch_size)
    for d, b, t, q in zip(report_items, mb, mt, qitems):
        d["margin_base"], d["margin_tuned"] = b, t
        d["statement"] = item_statement(b, t, q.expected, q.generated, direction or "regression")
    return summarize([r.get("verdict", "unknown") for r in ranking], report_items, direction or "regression")


def _loglik_flags(s: Session, qitems) -> None:
    forms = [q.formulation for q in qitems]
    if "classic" in forms:
        s.flag("attribution.loglik_classic_fallback", "warning",
               f"evaluation.metric is loglik and {forms.count('classic')} item(s) use the classic query "
               "(grad loss(expected)), whose sign can invert on substitution failures",
               "set attribution.query: contrastive (the margin query is used where no answer differs)")
    n_c, n_m = forms.count("contrastive"), forms.count("margin")
    if n_c or n_m:
        s.flag("attribution.loglik_margin", "info",
               f"evaluation.metric is loglik: {n_c} item(s) use the contrastive query against the fine-tune's greedy "
               f"answer (full expected-answer log-prob against it); {n_m} item(s) whose greedy answer is the "
               "expected one use the margin query (the expected token's logit against the log-sum-exp of the others, "
               "at its least-preferred answer token)")


def _exact_scores(s: Session, exact: GradientCapture, q_unit: np.ndarray, positions: Sequence[int]) -> np.ndarray:
    """Exact per-item harm scores [Q, len(positions)], streaming rows so no exact vector is kept."""
    return harm_from_inner(_exact_inner(s, exact, q_unit, positions))


def _exact_inner(s: Session, exact: GradientCapture, dirs: np.ndarray, positions: Sequence[int]) -> np.ndarray:
    """dirs [Q, D_exact] @ exact gradients of the rows at `positions` -> [Q, len(positions)] (streamed)."""
    out = np.zeros((dirs.shape[0], len(positions)), dtype=np.float32)
    device = next(s.model.parameters()).device
    bs = s.cfg.grads.batch_size
    pos = list(positions)
    d32 = np.asarray(dirs, dtype=np.float32)
    order = sorted(range(len(pos)), key=lambda j: (len(s.toks[pos[j]].input_ids), pos[j]))
    with progress_bar("exact re-rank", total=len(pos)) as bar:
        for i in range(0, len(order), bs):
            js = order[i : i + bs]
            ids, attn, sup = collate([s.toks[pos[j]] for j in js], s.tokenizer.pad_token_id)
            vecs, _ = exact.vectors(ids.to(device), attn.to(device), sup.to(device))
            out[:, js] = d32 @ vecs.detach().cpu().numpy().T
            bar.advance(len(js))
    return out


# ------------------------------------------------------------------------------------------------- scoring


WINDOW_ITEMS_MAX = 16  # per-item window scores of every long row up to this many failing items
WINDOW_JOBS = 4096  # beyond that, per-item windows for the top WINDOW_JOBS // Q long rows (row x item passes)


@dataclass
class Scored:
    """Everything `score_items` computed, for the window, span and report steps.

    Directions are harm-signed and include the per-item normalisation: a row's per-item score is
    <w_i, g_row> in index space, or, for a re-ranked candidate of a projected index, <r_i, g_row> (index space) +
    <e_i, g_row_exact> (parameter space)."""

    per_item: np.ndarray  # [Q, N] total scores (exact for candidates)
    order: Optional[np.ndarray]
    fidelity: Optional[dict]
    w: np.ndarray  # [Q, dim] index-space directions
    precond: Preconditioner
    projector: Projector
    cand: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    r: Optional[np.ndarray] = None  # [Q, dim] index-space part of a candidate's exact score
    e: Optional[np.ndarray] = None  # [Q, D_exact] parameter-space part
    rank_item: Optional[np.ndarray] = None  # [Q, N] scores the per-item rankings use (best window for long rows)
    rank_agg: Optional[np.ndarray] = None  # [N] the score the ranking uses
    long_rows: list = field(default_factory=list)
    windows: dict = field(default_factory=dict)  # position -> {"tokens": (a, b), "score": best window (aggregate)}
    window_items: bool = False  # per-item window scores computed for every long row
    window_item_rows: list = field(default_factory=list)  # the long rows with per-item window scores


def make_preconditioner(s: Session, idx, row_keys: list[str]) -> Preconditioner:
    """`attribution.preconditioner` fitted on the index (streamed from its shards)."""
    a = s.cfg.attribution
    bd = (idx.meta or {}).get("block_dims") if hasattr(idx, "meta") else None
    p = Preconditioner(a.preconditioner, a.damping, list(bd) if bd and sum(bd) == idx.dim else None)
    if p.kind == "identity":
        return p.fit(RowSource(np.zeros((0, idx.dim), dtype=np.float32)))
    return p.fit(RowSource(index=idx, row_keys=row_keys))


def score_items(s: Session, capture: GradientCapture, idx, row_keys: list[str], qitems, direction: str, *,
                details: bool = False, windows: bool = True):
    """Per-item scores [Q, N] from the index, against the preconditioned queries (`attribution.preconditioner`).

    Rows with more supervised tokens than one window (`spans.WINDOW_TOKENS`) get their best-window score by exact
    per-token contributions (forward-mode, `spans.token_contributions`); the ranking uses it for them (see
    `attribute`). With a projected index, the top `grads.rerank` rows by that ranking score are re-scored exactly
    (their order is exact) and a sample of rows measures projected-vs-exact agreement.

    Returns (per_item, order or None, fidelity dict or None), or a `Scored` with details=True."""
    cfg = s.cfg
    t0 = time.time()
    q = query_vectors(capture, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                      batch_size=cfg.grads.batch_size).numpy()
    sign = -1.0 if direction == "improvement" else 1.0  # for an improvement, rank the rows that helped it
    pre = make_preconditioner(s, idx, row_keys)
    if pre.kind == "identity":
        qn = unit_queries(q)
        norms = np.linalg.norm(q.astype(np.float32), axis=1)
    else:
        qp = pre.apply(q)
        norms = np.linalg.norm(qp, axis=1)
        qn = unit_queries(qp)
    per_item = sign * harm_from_inner(idx.score(qn, row_keys))
    w = (-sign) * qn.astype(np.float64)
    s.timings["precondition"] = round(time.time() - t0, 3)
    sc = Scored(per_item=per_item, order=None, fidelity=None, w=w, precond=pre, projector=capture.projector)
    sc.rank_item, sc.rank_agg = per_item, aggregate(per_item)
    if windows:
        _window_scores(s, capture, sc, row_keys)
    if capture.projector.exact or (cfg.grads.rerank == 0 and cfg.grads.fidelity_sample == 0):
        return sc if details else (sc.per_item, None, None)
    exact = GradientCapture(s.model, s.sites, Projector(site_shapes(s.sites)), chunk=cfg.grads.loss_chunk_tokens)
    q_ex = query_vectors(exact, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                         batch_size=cfg.grads.batch_size).numpy()
    if pre.kind == "identity":
        sc.e, sc.r = (-sign) * unit_queries(q_ex).astype(np.float64), None
    else:
        # H^-1 = (I - M) / lambda per block: the identity part is scored exactly, the correction M in index space.
        c = (-sign) / np.maximum(norms, 1e-30)
        scale_idx = _expand(pre.identity_scale, capture.projector.site_dims())
        scale_ex = _expand(pre.identity_scale, [st.r * (st.d_in + st.d_out) for st in s.sites])
        sc.e = c[:, None] * scale_ex[None, :] * q_ex.astype(np.float64)
        sc.r = w - c[:, None] * scale_idx[None, :] * q.astype(np.float64)
    n = len(row_keys)
    cand = rank(sc.rank_agg, min(cfg.grads.rerank, n))
    rng = np.random.default_rng(cfg.seed)
    sample = np.sort(rng.choice(n, size=min(cfg.grads.fidelity_sample, n), replace=False)) if cfg.grads.fidelity_sample else np.array([], dtype=int)
    need = np.union1d(cand, sample).astype(int)
    ex = _candidate_exact(s, exact, sc, row_keys, idx, need)
    col = {int(p): j for j, p in enumerate(need)}
    per_item = per_item.copy()
    if cand.size:
        sc.cand = cand.astype(np.int64)
        cols = [col[int(p)] for p in cand]
        per_item[:, cand] = ex[:, cols]
        rank_item = sc.rank_item.copy()
        rank_item[:, cand] = ex[:, cols]
        sc.per_item, sc.rank_item = per_item, rank_item
        exact_agg = aggregate(ex[:, cols])
        if windows:
            exact_agg = _window_scores_exact(s, sc, cand, exact_agg)
        sc.order = rerank_order(sc.rank_agg, cand, exact_agg)
        rank_agg = sc.rank_agg.copy()
        rank_agg[cand] = exact_agg
        sc.rank_agg = rank_agg
    fid = None
    if sample.size >= 2:
        ex_s = ex[:, [col[int(p)] for p in sample]]
        proj_s = sign * harm_from_inner(idx.score(qn, [row_keys[p] for p in sample]))
        fid = {"sample_rows": int(sample.size), "queries": int(q.shape[0]), "rerank_rows": int(cand.size),
               "projected": agreement(ex_s, proj_s),
               "projected_aggregate": agreement(aggregate(ex_s)[None, :], aggregate(proj_s)[None, :]), "reranked": None}
        if sc.order is not None:
            # Agreement of the order a user reads (exact candidates first) with the exact order, on the sample.
            pos_in_order = np.empty(n, dtype=np.int64)
            pos_in_order[sc.order] = np.arange(n)
            agg_fake = order_scores(np.argsort(pos_in_order[sample], kind="stable"))
            fid["reranked"] = agreement(aggregate(ex_s)[None, :], agg_fake[None, :])
            fid["reranked"].pop("pearson", None)
    sc.fidelity = fid
    return sc if details else (sc.per_item, sc.order, sc.fidelity)


def _expand(per_block: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    return np.repeat(np.asarray(per_block, dtype=np.float64), np.asarray(widths, dtype=np.int64))


def _candidate_exact(s: Session, exact: GradientCapture, sc: Scored, row_keys, idx, need: np.ndarray) -> np.ndarray:
    """Exact per-item scores [Q, len(need)]: <e, g_exact> (+ <r, g_index> for a preconditioned query)."""
    if sc.r is None and sc.precond.kind == "identity":
        # The identity path: harm_from_inner of unit exact queries (the same bits as before preconditioning).
        return _exact_inner(s, exact, sc.e, need.tolist())
    out = _exact_inner(s, exact, sc.e, need.tolist())
    if sc.r is not None:
        out = out + idx.score(sc.r.astype(np.float32), [row_keys[p] for p in need])
    return out


def _dirs_for(sc: Scored, exact_part: bool) -> np.ndarray:
    """Parameter-space directions [Q, D_exact] whose inner products with a row's exact gradient give its score:
    P^T w for index-scored rows; P^T r + e for a projected index's re-ranked candidates."""
    if not exact_part or sc.e is None:
        return back_project(sc.projector, sc.w)
    if sc.r is None:
        return sc.e
    return back_project(sc.projector, sc.r) + sc.e


def _contribs(s: Session, dirs: np.ndarray, positions: Sequence[int], items: Optional[Sequence[int]] = None) -> dict:
    """{(position, k): per-token contributions} along dirs[k] (all directions unless `items`, one per row)."""
    toks = [s.toks[p] for p in positions]
    if items is None:
        jobs = [(j, k) for j in range(len(positions)) for k in range(dirs.shape[0])]
    else:
        jobs = [(j, int(k)) for j, k in enumerate(items)]
    pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
    res = token_contributions(s.model, s.sites, toks, dirs, pad_id=pad, batch_size=s.cfg.grads.batch_size, jobs=jobs,
                              chunk=s.cfg.grads.loss_chunk_tokens)
    return {(positions[j], k): v for (j, k), v in res.items()}


def _window_scores(s: Session, capture: GradientCapture, sc: Scored, row_keys) -> None:
    """Best-window scores of the long rows: for the aggregate ranking (all long rows) and per item (all long rows
    when there are at most WINDOW_ITEMS_MAX items, else the long rows ranked highest by their aggregate window
    score, WINDOW_JOBS // Q of them)."""
    long_rows = [p for p, t in enumerate(s.toks) if is_long(t)]
    sc.long_rows = long_rows
    if not long_rows:
        return
    t0 = time.time()
    Q = sc.w.shape[0]
    rank_item = sc.rank_item.copy()
    rank_agg = sc.rank_agg.copy()
    if Q <= WINDOW_ITEMS_MAX:
        per_item_rows = long_rows
    else:
        res = _contribs(s, back_project(sc.projector, sc.w.mean(0, keepdims=True)), long_rows)
        for p in long_rows:
            best, (a, b) = best_window(res[(p, 0)])
            rank_agg[p] = best
            sc.windows[p] = {"tokens": (a, b), "score": best, "total": float(res[(p, 0)].sum())}
        n = max(1, WINDOW_JOBS // Q)
        per_item_rows = sorted(long_rows, key=lambda p: (-rank_agg[p], p))[:n]
    sc.window_items = len(per_item_rows) == len(long_rows)
    sc.window_item_rows = list(per_item_rows)
    dirs = back_project(sc.projector, sc.w)
    res = _contribs(s, dirs, per_item_rows)
    for p in per_item_rows:
        cs = np.stack([res[(p, k)] for k in range(Q)])
        for i in range(Q):
            rank_item[i, p] = best_window(cs[i])[0]
        if Q <= WINDOW_ITEMS_MAX:
            agg_c = cs.mean(0)
            best, (a, b) = best_window(agg_c)
            rank_agg[p] = best
            sc.windows[p] = {"tokens": (a, b), "score": best, "total": float(agg_c.sum())}
    sc.rank_item, sc.rank_agg = rank_item, rank_agg
    s.timings["windows"] = round(s.timings.get("windows", 0.0) + time.time() - t0, 3)


def _window_scores_exact(s: Session, sc: Scored, cand: np.ndarray, exact_agg: np.ndarray) -> np.ndarray:
    """Exact best-window scores of the long re-ranked candidates (projected index); updates rank_item for the rows
    that had per-item windows."""
    long_c = [int(p) for p in cand if is_long(s.toks[int(p)])]
    if not long_c:
        return exact_agg
    t0 = time.time()
    Q = sc.w.shape[0]
    dirs = _dirs_for(sc, exact_part=True)
    item_rows = set(sc.window_item_rows)
    jobs_rows = [p for p in long_c if p in item_rows]
    res = _contribs(s, dirs, jobs_rows) if jobs_rows else {}
    agg_only = [p for p in long_c if p not in item_rows]
    res_agg = _contribs(s, dirs.mean(0, keepdims=True), agg_only) if agg_only else {}
    out = exact_agg.copy()
    where = {int(p): j for j, p in enumerate(cand)}
    for p in long_c:
        if p in item_rows:
            cs = np.stack([res[(p, k)] for k in range(Q)])
            for i in range(Q):
                sc.rank_item[i, p] = best_window(cs[i])[0]
            agg_c = cs.mean(0)
        else:
            agg_c = res_agg[(p, 0)]
        best, (a, b) = best_window(agg_c)
        out[where[p]] = best
        sc.windows[p] = {"tokens": (a, b), "score": best, "total": float(agg_c.sum())}
    s.timings["windows"] = round(s.timings.get("windows", 0.0) + time.time() - t0, 3)
    return out
