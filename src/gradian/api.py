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
    qitems = query_items(cap, s.eval_items, failing[: cfg.attribution.max_items], cfg.attribution.query) if cap else []
    report["query"] = {"formulation": cfg.attribution.query, "direction": direction, "items": []}
    if verdict != "declined":
        capture, idx, row_keys, info = index(s)
        report["index"] = info.summary()
        t0 = time.time()
        order = None
        if verdict == "attributed":
            per_item, order, fid = score_items(s, capture, idx, row_keys, qitems, direction)
            scores = aggregate(per_item).astype(np.float32)
            if fid is not None:
                report["index"]["fidelity"] = fid
                low = (fid["reranked"] or fid["projected_aggregate"])["top50_recall"]
                if low < cfg.grads.fidelity_warn:
                    s.flag("index.projection_fidelity", "warning",
                           f"projected scores agree poorly with exact ones (top-50 recall {low:.2f} on a sample of "
                           f"{fid['sample_rows']} rows)", "raise grads.projection_dim or grads.rerank")
            for qi, row in zip(qitems, per_item):
                top = rank(row, cfg.attribution.top_k)
                report["query"]["items"].append({
                    "item": qi.item, "prompt": qi.prompt, "expected": qi.expected, "generated": qi.generated,
                    "base_generated": qi.base_generated, "formulation": qi.formulation,
                    "ranking": [{"position": int(p), "score": float(row[p])} for p in top[:10]],
                })
        else:
            # Smoke test: squared gradient norm (self-influence), the rows most unlike the rest.
            sq = {k: float(v) for keys, block in idx.iter_shards() for k, v in zip(keys, np.square(block).sum(1))}
            scores = np.array([sq[k] for k in row_keys], dtype=np.float32)
        s.timings["score"] = round(time.time() - t0, 3)
        top = (order if order is not None else rank(scores))[: cfg.attribution.top_k].tolist()
        base_l = row_losses(s, top, base=True)
        tuned_l = row_losses(s, top, base=False)
        for r, (p, bl, tl) in enumerate(zip(top, base_l, tuned_l), start=1):
            ex = s.examples[p]
            ranking.append({"rank": r, "position": p, "id": ex.id, "score": float(scores[p]),
                            "preview": preview(ex.plain_text()), "text": ex.plain_text(),
                            "base_loss": float(bl), "tuned_loss": float(tl)})
        idx.close()
    report.update({
        "verdict": verdict,
        "verdict_text": _verdict_text(verdict, cap, len(qitems), direction),
        "ranking": ranking,
        "clusters": [],
        "spans": [],
        "scores_summary": score_summary(scores) if scores is not None else {"n": 0},
    })
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
    atomic_write_text(out_dir / "gradian.resolved.yaml", dump_config(cfg))
    return report


def _exact_scores(s: Session, exact: GradientCapture, q_unit: np.ndarray, positions: Sequence[int]) -> np.ndarray:
    """Exact per-item harm scores [Q, len(positions)], streaming rows so no exact vector is kept."""
    out = np.zeros((q_unit.shape[0], len(positions)), dtype=np.float32)
    device = next(s.model.parameters()).device
    bs = s.cfg.grads.batch_size
    pos = list(positions)
    order = sorted(range(len(pos)), key=lambda j: (len(s.toks[pos[j]].input_ids), pos[j]))
    with progress_bar("exact re-rank", total=len(pos)) as bar:
        for i in range(0, len(order), bs):
            js = order[i : i + bs]
            ids, attn, sup = collate([s.toks[pos[j]] for j in js], s.tokenizer.pad_token_id)
            vecs, _ = exact.vectors(ids.to(device), attn.to(device), sup.to(device))
            out[:, js] = harm_from_inner(q_unit @ vecs.detach().cpu().numpy().T)
            bar.advance(len(js))
    return out


def score_items(s: Session, capture: GradientCapture, idx, row_keys: list[str], qitems, direction: str):
    """Per-item scores [Q, N] from the index; with a projected index, the top `grads.rerank` rows are re-scored
    exactly (their order is exact) and a sample of rows measures projected-vs-exact agreement.

    Returns (per_item, order or None, fidelity dict or None)."""
    cfg = s.cfg
    q = query_vectors(capture, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=cfg.grads.max_seq_length,
                      batch_size=cfg.grads.batch_size).numpy()
    sign = -1.0 if direction == "improvement" else 1.0  # for an improvement, rank the rows that helped it
    per_item = sign * harm_from_inner(idx.score(unit_queries(q), row_keys))
    if capture.projector.exact or (cfg.grads.rerank == 0 and cfg.grads.fidelity_sample == 0):
        return per_item, None, None
    exact = GradientCapture(s.model, s.sites, Projector(site_shapes(s.sites)), chunk=cfg.grads.loss_chunk_tokens)
    q_exact = unit_queries(query_vectors(exact, s.tokenizer, s.eval_items, qitems, chat=s.chat,
                                         max_len=cfg.grads.max_seq_length, batch_size=cfg.grads.batch_size).numpy())
    n = len(row_keys)
    agg = aggregate(per_item)
    cand = rank(agg, min(cfg.grads.rerank, n))
    rng = np.random.default_rng(cfg.seed)
    sample = np.sort(rng.choice(n, size=min(cfg.grads.fidelity_sample, n), replace=False)) if cfg.grads.fidelity_sample else np.array([], dtype=int)
    need = np.union1d(cand, sample).astype(int)
    ex = sign * _exact_scores(s, exact, q_exact, need.tolist())
    col = {int(p): j for j, p in enumerate(need)}
    order = None
    if cand.size:
        order = rerank_order(agg, cand, aggregate(ex[:, [col[int(p)] for p in cand]]))
        per_item = per_item.copy()
        per_item[:, cand] = ex[:, [col[int(p)] for p in cand]]
    fid = None
    if sample.size >= 2:
        ex_s = ex[:, [col[int(p)] for p in sample]]
        proj_s = (sign * harm_from_inner(idx.score(unit_queries(q), [row_keys[p] for p in sample])))
        fid = {"sample_rows": int(sample.size), "queries": int(q.shape[0]), "rerank_rows": int(cand.size),
               "projected": agreement(ex_s, proj_s),
               "projected_aggregate": agreement(aggregate(ex_s)[None, :], aggregate(proj_s)[None, :]), "reranked": None}
        if order is not None:
            # Agreement of the order a user reads (exact candidates first) with the exact order, on the sample.
            pos_in_order = np.empty(n, dtype=np.int64)
            pos_in_order[order] = np.arange(n)
            agg_fake = order_scores(np.argsort(pos_in_order[sample], kind="stable"))
            fid["reranked"] = agreement(aggregate(ex_s)[None, :], agg_fake[None, :])
            fid["reranked"].pop("pearson", None)
    return per_item, order, fid
