"""Query formulations for behaviours, measured cheaply: exact per-row LoRA gradients of every training row and of
every candidate query are computed ONCE per adapter state and saved; the formulations are then linear combinations
scored by dot products (optionally in a diagonal metric), beside BM25 and representation similarity.

    .venv/bin/python bench/behaviour_probe.py extract RUN [--state earliest|final] [--samples 8]
    .venv/bin/python bench/behaviour_probe.py analyse RUN [--state earliest] [--agg mean|max|z|max/mean|zmax/mean]
    .venv/bin/python bench/behaviour_probe.py --smoke   # extract (2 samples) and analyse on bench/_smoke.py's run

RUN is a fine-tuned real scenario (`bench/real_models.py --work DIR --scenarios NAME` writes and fine-tunes it).
`extract` writes RUN/probe/<state>/: G.npy (rows x D float32), samples.npy (sampled answers' gradients, float16),
queries.npy (the greedy own-words queries: the decisive token, the answer whole, the expected answer's token at the
decisive position in its spaced and plain forms), logits.npy (the decisive token's raw and centred logits),
meta.json; `analyse` prints a table scenario x method (AUPRC, recall@k, planted ranks; `--agg`: how the items'
scores combine into a row's). Research tool, not a product path: the winning formulation lives in
`gradian.attribution.behaviour`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIAN_THREADS", "1")
os.environ.setdefault("GRADIAN_PROGRESS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoints(run: Path) -> list[Path]:
    from gradian.attribution.checkpoints import saved_adapters, without_final

    # what `attribution.checkpoints` picks from: a Trainer's checkpoint-<step> or `gradian train`'s epoch-<k>
    return without_final(saved_adapters(str(run / "adapter")), str(run / "adapter"))


def first_k(t, k: int):
    """The row with only its first k supervised tokens supervised (k <= 0: all of them)."""
    from dataclasses import replace

    if k <= 0:
        return t
    sup, n = [], 0
    for s in t.supervised:
        sup.append(bool(s) and n < k)
        n += bool(s)
    return replace(t, supervised=sup)


def expected_at_decisive(tokenizer, item, full, k: int, chat: bool, max_len: int, *, spaced: bool):
    """The fine-tune's answer up to its decisive token k, then the item's expected answer after a space (`spaced`)
    or directly, supervised at k alone; None where that text does not keep the same first k tokens or gives the
    same token at k. After "Answer:" the spaced form (" Warsaw") is the token a model writes there, the plain form
    ("Warsaw") one it does not."""
    from dataclasses import replace

    from gradian.setup.tokenize import eval_answer_example, tokenize_example

    a0 = next((i for i, sv in enumerate(full.supervised) if sv), None)
    if k is None or k < 0 or a0 is None or k < a0:
        return None
    prefix = tokenizer.decode(full.input_ids[a0:k]).rstrip()
    r = tokenize_example(tokenizer, eval_answer_example(item, prefix + (" " if spaced else "") + item.answer.strip(),
                                                        chat), max_len)
    if len(r.input_ids) > k and list(r.input_ids[:k]) == list(full.input_ids[:k]) and \
            r.input_ids[k] != full.input_ids[k]:
        return replace(r, supervised=[i == k for i in range(len(r.input_ids))])
    return None


LOGIT_FORMS = ("decisive logit", "decisive logit - mean logit")


def logit_queries(view, rows, starts) -> np.ndarray:
    """[len(LOGIT_FORMS), rows, D]: at each own-words query's decisive token k (its token y), the loss-convention
    gradient (minus) of the raw logit z_y and of z_y - mean_v z_v (the logit against the vocabulary's uniform mean,
    where log p(y) = z_y - logsumexp z centres on what the model expects there). One plain backward each."""
    params = [p for st in view.sites for p in (st.A.weight, st.B.weight)]
    for p in params:
        p.requires_grad_(True)
    out = np.zeros((len(LOGIT_FORMS), len(rows), sum(p.numel() for p in params)), dtype=np.float32)
    for i, (row, k) in enumerate(zip(rows, starts)):
        if k is None or k < 1:
            continue
        z = view.model(input_ids=torch.tensor([row.input_ids[:k + 1]])).logits[0, k - 1].float()
        zy = z[row.input_ids[k]]
        for f, c in enumerate((zy, zy - z.mean())):  # one forward, a backward per form
            grads = torch.autograd.grad(-c, params, retain_graph=f + 1 < len(LOGIT_FORMS))
            out[f, i] = torch.cat([g.reshape(-1) for g in grads]).numpy()
    return out


def extract(run: Path, state: str, n_samples: int, ks: list[int]) -> None:
    from gradian.attribution.decisive import answer_rows, decision_positions, decisive_starts, with_starts
    from gradian.attribution.formulation import own_words_row
    from gradian.attribution.queries import query_items, select_failing
    from gradian.capability.evaluate import _stop_ids, answer_text
    from gradian.config import load_config
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.pipeline import evaluate
    from gradian.projection import Projector
    from gradian.setup.batches import batches
    from gradian.setup.session import open_session
    from gradian.setup.tokenize import eval_answer_example, eval_prompt_ids, tokenize_example

    out = run / "probe" / state
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(run / "gradian.yaml", ["output=probe-out"])
    s = open_session(cfg)
    L, bs = cfg.grads.max_seq_length, cfg.grads.batch_size
    t0 = time.process_time()
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    log(f"evaluate: {cap.base_value if hasattr(cap, 'base_value') else ''} failing {failing} ({time.process_time() - t0:.0f} s)")
    qitems = query_items(cap, s.eval_items, failing, "contrastive", metric=cfg.evaluation.metric, direction=direction)
    kw = dict(chat=s.chat, max_len=L)
    starts = decisive_starts(s.model, s.tokenizer, s.eval_items, qitems, s.metric,
                             max_new_tokens=cfg.evaluation.max_new_tokens, batch_size=cfg.evaluation.batch_size,
                             one_line=s.one_line, **kw)
    qitems = with_starts(qitems, starts, decision_positions(s.model, s.tokenizer, s.eval_items, qitems, starts,
                                                            batch_size=bs, **kw))
    by = {it.position: it for it in s.eval_items}
    from gradian.explain.baselines import mean_hidden_states, representation_similarity

    pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
    th = mean_hidden_states(s.model, s.toks, pad, batch_size=bs)
    qh = mean_hidden_states(s.model, [tokenize_example(s.tokenizer, eval_answer_example(by[q.item], q.generated, s.chat), L)
                                      for q in qitems], pad, batch_size=bs)
    np.save(out / "repsim.npy", representation_similarity(th, qh))
    # sampled answers, temperature 1, seeded per item and model
    stops = _stop_ids(s.tokenizer, s.model, s.chat)
    samples = []  # (query index, source, text, passes)
    t0 = time.process_time()
    for j, q in enumerate(qitems):
        it = by[q.item]
        ids = torch.tensor([eval_prompt_ids(s.tokenizer, it, s.chat)])
        for src in ("tuned", "base"):
            torch.manual_seed(1000 * q.item + (src == "base"))
            import contextlib

            ctx = s.model.disable_adapter() if src == "base" else contextlib.nullcontext()
            with ctx, torch.no_grad():
                gen = s.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n_samples,
                                       max_new_tokens=cfg.evaluation.max_new_tokens,
                                       pad_token_id=s.tokenizer.pad_token_id, eos_token_id=stops)
            for row in gen[:, ids.shape[1]:].tolist():
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                text = answer_text(s.tokenizer, row[:cut], one_line=s.one_line)
                samples.append((j, src, text, s.metric.score(it, text) >= 0.5))
    log(f"sampled {len(samples)} answers ({time.process_time() - t0:.0f} s): "
        f"tuned fail {sum(1 for x in samples if x[1] == 'tuned' and not x[3])}/{sum(1 for x in samples if x[1] == 'tuned')}, "
        f"base fail {sum(1 for x in samples if x[1] == 'base' and not x[3])}/{sum(1 for x in samples if x[1] == 'base')}")
    # rows of every query: own-words (decisive span), the greedy failing answer whole, first k tokens of it
    qrows, qkind = [], []
    for j, q in enumerate(qitems):
        it = by[q.item]
        if q.own_words:
            t, _ = own_words_row(s.tokenizer, it, q, **kw)
            qrows.append(t)
            qkind.append(["decisive", j])
            full, _o = answer_rows(s.tokenizer, it, q, **kw)
            qrows.append(full)
            qkind.append(["greedy_full", j])
            for form in ("spaced", "plain"):  # the expected answer's token at the decisive position
                e = expected_at_decisive(s.tokenizer, it, full, q.span_start, s.chat, L, spaced=form == "spaced")
                if e is not None:
                    qrows.append(e)
                    qkind.append([f"expected_{form}", j])
    srows = []
    for j, src, text, ok in samples:
        t = tokenize_example(s.tokenizer, eval_answer_example(by[qitems[j].item], text, s.chat), L)
        for k in ks:
            srows.append(first_k(t, k))

    def grads_of(view, toks, dtype):
        capture = GradientCapture(view.model, view.sites, Projector(site_shapes(view.sites)))
        pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
        res = None
        for part, ids, attn, sup in batches(toks, range(len(toks)), bs, pad):
            v, _ = capture.vectors(ids, attn, sup)
            if res is None:
                res = np.zeros((len(toks), v.shape[1]), dtype=dtype)
            res[part] = v.numpy().astype(dtype)
        return res

    import contextlib

    cks = checkpoints(run)
    ctx = s.checkpoint(str(cks[0].resolve()), "probe") if state == "earliest" else contextlib.nullcontext(s)
    with ctx as view:
        if not (out / "G.npy").exists():
            t0 = time.process_time()
            G = grads_of(view, view.toks, np.float32)
            np.save(out / "G.npy", G)
            log(f"rows {G.shape} ({time.process_time() - t0:.0f} s)")
            del G
        truth = json.loads((run / "truth.json").read_text())
        turn_rows, turn_meta = [], []
        if truth.get("planted_turns"):  # each planted row's exchanges apart (their gradients add up to the row's)
            from gradian.setup.alignment import exchange_ranges, token_char_anchors

            for p in truth["planted"]:
                ex, t = view.examples[p], view.toks[p]
                rng = exchange_ranges(ex)
                starts_ = np.array([a for a, _, _ in rng])
                anchors = token_char_anchors(ex, t, s.tokenizer)
                exch = [rng[min(max(int(np.searchsorted(starts_, a, side="right") - 1), 0), len(rng) - 1)][2]
                        if a >= 0 else 0 for a in anchors]
                for k in sorted(set(exch)):
                    from dataclasses import replace as _r

                    turn_rows.append(_r(t, supervised=[bool(sv) and exch[i] == k for i, sv in enumerate(t.supervised)]))
                    turn_meta.append([p, k])
            np.save(out / "turns.npy", grads_of(view, turn_rows, np.float32))
        Q = grads_of(view, qrows, np.float32)
        np.save(out / "queries.npy", Q)
        del Q
        decisive_rows = [r for r, (kind, _) in zip(qrows, qkind) if kind == "decisive"]
        np.save(out / "logits.npy", logit_queries(view, decisive_rows,
                                                  [q.span_start for q in qitems if q.own_words]))
        t0 = time.process_time()
        S = grads_of(view, srows, np.float16)
        np.save(out / "samples.npy", S)
        log(f"samples {S.shape} ({time.process_time() - t0:.0f} s)")
    meta = {"state": state, "checkpoint": str(cks[0]) if state == "earliest" else "final", "direction": direction,
            "failing": failing, "ks": ks,
            "queries": [{"item": q.item, "prompt": q.prompt, "generated": q.generated, "base_generated": q.base_generated,
                         "formulation": q.formulation, "span": list(q.span), "span_start": q.span_start}
                        for q in qitems],
            "qkind": qkind, "turn_rows": turn_meta, "samples": [list(x) for x in samples]}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------------------------------ analysis
def auprc_rank(scores, planted: list[int]):
    """(AUPRC, recall@k, planted ranks, accused as "planted/total" by the report's rule, `accused.accuse`, over this one vector). `scores`
    is one vector, or (ranking scores, the scores the rule accuses by) (`--agg max/mean`)."""
    from gradian.attribution.accused import accuse
    from gradian.attribution.scoring import auprc, recall_at_k

    scores, accuse_by = scores if isinstance(scores, tuple) else (scores, scores)
    order = np.argsort(-scores, kind="stable")
    rank = np.empty(len(scores), dtype=int)
    rank[order] = np.arange(1, len(scores) + 1)
    pos = set(accuse(np.atleast_2d(np.asarray(accuse_by, dtype=np.float64)), [0]).positions)
    return (auprc(scores, planted), recall_at_k(scores, planted, len(planted)),
            sorted(int(rank[p]) for p in planted), f"{len(pos & set(planted))}/{len(pos)}")


def adam_second_moment(run: Path, meta: dict, width: int):
    """The TRL checkpoint's AdamW exp_avg_sq, flattened in the gradient layout (sites in `lora_sites` order, A then
    B), or None. Read by `gradian.training.optimizer_state.second_moments`, which maps the optimizer's parameters
    (in `named_parameters` order: q, k, v, o, ... per layer) onto the sites by name: concatenating them in the
    optimizer's order would permute the blocks of every layer."""
    from gradian.config import load_config
    from gradian.setup.model import load_model, lora_sites
    from gradian.training.optimizer_state import second_moments

    ck = checkpoints(run)[-1] if meta["state"] != "earliest" else Path(meta["checkpoint"])
    cfg = load_config(run / "gradian.yaml", [])
    model = load_model(cfg)
    got = second_moments(ck, model)
    if got is None:
        return None
    sites, _ = lora_sites(model)
    v = np.concatenate([got[(st.name, side)].reshape(-1).double().numpy() for st in sites for side in ("A", "B")])
    if v.size != width:
        log(f"optimizer state {v.size} != gradient width {width}: skipped")
        return None
    return v


def analyse(run: Path, state: str, lams: list[float], agg: str = "mean") -> dict:
    """Every formulation's AUPRC, recall, accused and planted ranks. `agg`: how the items' scores combine into a
    row's: mean (the report's), max, z (the mean of each item's robust z-scores), max/mean (ranked by the max,
    accused by the report's rule on the mean)."""
    from gradian.attribution.accused import robust_z
    from gradian.config import load_config
    from gradian.explain.baselines import bm25_scores

    d = run / "probe" / state
    meta = json.loads((d / "meta.json").read_text())
    truth = json.loads((run / "truth.json").read_text())
    planted = truth["planted"]
    G = np.load(d / "G.npy")  # float32, in memory: every metric below is one matmul over it
    G2 = np.square(G)
    Q = np.load(d / "queries.npy")
    S = np.load(d / "samples.npy", mmap_mode="r")
    nq = len(meta["queries"])
    ks = meta["ks"]
    samples = meta["samples"]
    # second moments
    m_train = G2.mean(0, dtype=np.float64)
    sgn = 1.0  # loss gradients: score = q . g, positive = the row's step raises the failing side's likelihood

    def families():
        """name -> [nq, D] query loss-gradients (the side whose likelihood the fine-tune raised)."""
        fam = {}
        kinds = meta["qkind"]
        for name in ("decisive", "greedy_full"):
            rows = [i for i, (k, j) in enumerate(kinds) if k == name]
            fam[name] = Q[rows].astype(np.float32)
        if (d / "logits.npy").exists():
            lq = np.load(d / "logits.npy")
            for f, name in enumerate(LOGIT_FORMS):
                fam[name] = lq[f]
        # the decisive token against the expected answer's token at the same prefix (own-words items that have one)
        dec_of = {j: i for i, (k, j) in enumerate(kinds) if k == "decisive"}
        for form in ("spaced", "plain"):
            exp_of = {j: i for i, (k, j) in enumerate(kinds) if k == f"expected_{form}"}
            if not exp_of:
                continue
            both, only = np.zeros_like(fam["decisive"]), np.zeros_like(fam["decisive"])
            for r, j in enumerate(sorted(dec_of)):
                if j in exp_of:
                    both[r] = Q[dec_of[j]] - Q[exp_of[j]]
                    only[r] = -Q[exp_of[j]]
                else:
                    both[r] = Q[dec_of[j]]
            fam[f"decisive - expected ({form})"] = both
            fam[f"- expected ({form})"] = only
            log(f"expected token ({form}) at the decisive position for {len(exp_of)} of {len(dec_of)} items")
        for ki, k in enumerate(ks):
            idx = lambda f: [si * len(ks) + ki for si, x in enumerate(samples) if f(x)]  # noqa: E731
            V = {}
            for name, f_fail, f_pass in (
                ("fail", lambda x: not x[3], None),
                ("fail-pass", lambda x: not x[3], lambda x: x[3]),
                ("tunedfail-basepass", lambda x: (not x[3]) and x[1] == "tuned", lambda x: x[3] and x[1] == "base"),
                ("unit fail-pass", lambda x: not x[3], lambda x: x[3]),
            ):
                out = np.zeros((nq, S.shape[1]), dtype=np.float32)
                for j in range(nq):
                    fi = idx(lambda x, j=j: x[0] == j and f_fail(x))
                    pi = idx(lambda x, j=j: x[0] == j and f_pass(x)) if f_pass else []
                    unit = name.startswith("unit")

                    def mean(ix):
                        if not ix:
                            return 0.0
                        A = S[ix].astype(np.float64)
                        if unit:
                            A = A / np.maximum(np.linalg.norm(A, axis=1, keepdims=True), 1e-30)
                        return A.mean(0)

                    out[j] = mean(fi) - (mean(pi) if pi else 0.0)
                V[name] = out
            for name, v in V.items():
                fam[f"samples {name} k={k if k > 0 else 'all'}"] = v
        return fam

    fam = families()
    m_eval_all = {n: np.square(v).mean(0, dtype=np.float64) for n, v in fam.items()}
    res = {}

    def score(qv, dvec):
        # unit rows and unit queries in the metric diag(dvec), mean over items
        qd = (qv * dvec).astype(np.float32)
        qn = np.sqrt(np.maximum((qv.astype(np.float64) * qd).sum(1), 1e-300))
        gn = np.sqrt(np.maximum(G2 @ dvec.astype(np.float32), 1e-30)).astype(np.float64)
        inner = (qd @ G.T).astype(np.float64)
        per = sgn * (inner / qn[:, None] / np.maximum(gn, 1e-30)[None])
        if agg == "max":
            return per.max(0)
        if agg == "max/mean":  # ranked by the max over items, accused by the mean's rule
            return per.max(0), per.mean(0)
        if agg == "z":  # each item's scores as robust z-scores (the accusation rule's), then the mean
            return np.stack([robust_z(p)[0] for p in per]).mean(0)
        if agg == "zmax/mean":  # ranked by the max over items of each item's robust z, accused by the mean's rule
            return np.stack([robust_z(p)[0] for p in per]).max(0), per.mean(0)
        return per.mean(0)

    ones = np.ones(G.shape[1])
    diag = 1.0 / (m_train + 0.1 * m_train.mean())
    adam = adam_second_moment(run, meta, G.shape[1])
    for name, qv in fam.items():
        if not np.any(qv):
            continue
        res[(name, "identity")] = auprc_rank(score(qv, ones), planted)
        res[(name, "diag")] = auprc_rank(score(qv, diag), planted)
        if adam is not None:
            res[(name, "adam 1/v")] = auprc_rank(score(qv, 1.0 / (adam + 1e-3 * adam.mean())), planted)
            res[(name, "adam 1/sqrt(v)")] = auprc_rank(score(qv, 1.0 / (np.sqrt(adam) + 1e-8)), planted)
        for lam in lams:
            r = lam * m_eval_all[name] / m_eval_all[name].mean() * m_train.mean() + (1 - lam) * m_train
            res[(name, f"trackstar {lam}")] = auprc_rank(score(qv, 1.0 / (r + 0.1 * r.mean())), planted)
    if meta.get("turn_rows"):
        T = np.load(d / "turns.npy").astype(np.float64)
        want = truth["planted_turns"]
        for name, qv in fam.items():
            if not np.any(qv):
                continue
            qd = qv * diag
            qd /= np.sqrt(np.maximum((qv * qd).sum(1, keepdims=True), 1e-300))
            per = (qd @ T.T).mean(0)  # mean over items of each exchange's score
            best = {}
            for (p, k), v in zip(meta["turn_rows"], per):
                if p not in best or v > best[p][1]:
                    best[p] = (k, v)
            named = sum(1 for p, (k, _) in best.items() if want[str(p)] == k)
            print(f"turns named ({name}, diag): {named}/{len(best)}")
    # baselines
    cfg = load_config(run / "gradian.yaml", ["output=probe-out"])
    rows = [json.loads(x) for x in (run / "train.jsonl").read_text().splitlines()]
    def text_of(v):  # a plain string field, or a list of messages
        return v if isinstance(v, str) else " ".join(m["content"] for m in v)

    docs = [" ".join(text_of(r[part]) for part in ("prompt", "completion", "messages") if part in r) for r in rows]
    qs = meta["queries"]
    res[("BM25 question", "-")] = auprc_rank(bm25_scores(docs, [q["prompt"] for q in qs]).mean(0), planted)
    res[("BM25 question+answer", "-")] = auprc_rank(bm25_scores(docs, [f"{q['prompt']} {q['generated']}" for q in qs]).mean(0), planted)
    if (d / "repsim.npy").exists():
        res[("repsim", "-")] = auprc_rank(np.load(d / "repsim.npy").mean(0), planted)
    for (name, pre), (a, r, ranks, acc) in res.items():
        print(f"| {run.name} | {state} | {name} | {pre} | {a:.3f} | {r:.2f} | {acc} | {ranks} |")
    return res


def rows_only(run: Path) -> None:
    """G.npy of the earliest checkpoint alone (before the fine-tune has finished: the session opens that
    checkpoint as its adapter)."""
    from gradian.config import load_config
    from gradian.grads.capture import GradientCapture
    from gradian.grads.layout import site_shapes
    from gradian.projection import Projector
    from gradian.setup.batches import batches
    from gradian.setup.session import open_session

    ck = checkpoints(run)[0]
    out = run / "probe" / "earliest"
    out.mkdir(parents=True, exist_ok=True)
    s = open_session(load_config(run / "gradian.yaml", ["output=probe-out", f"model.adapter={ck.resolve()}"]),
                     need_eval=False)
    capture = GradientCapture(s.model, s.sites, Projector(site_shapes(s.sites)))
    G = np.zeros((len(s.toks), capture.dim), dtype=np.float32)
    t0 = time.process_time()
    for part, ids, attn, sup in batches(s.toks, range(len(s.toks)), s.cfg.grads.batch_size, s.pad_id):
        v, _ = capture.vectors(ids, attn, sup)
        G[part] = v.numpy()
    np.save(out / "G.npy", G)
    log(f"rows {G.shape} at {ck.name} ({time.process_time() - t0:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", choices=["extract", "analyse", "rows"])
    ap.add_argument("run", nargs="?", type=Path)
    ap.add_argument("--state", default="earliest")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--ks", default="0,3")
    ap.add_argument("--lams", default="0.5,0.9")
    ap.add_argument("--agg", default="mean", choices=["mean", "max", "z", "max/mean", "zmax/mean"])
    ap.add_argument("--smoke", action="store_true",
                    help="extract (--samples 2 --ks 0) then analyse (--lams 0.9) on bench/_smoke.py's tiny scenario")
    a = ap.parse_args()
    if a.smoke:
        from _smoke import tiny_run

        run = tiny_run()
        extract(run, "earliest", 2, [0])
        res = analyse(run, "earliest", [0.9], a.agg)
        print(json.dumps({"bench": "behaviour_probe", "smoke": True, "run": str(run), "methods": len(res)},
                         default=str))
        return
    if a.what is None or a.run is None:
        ap.error("give WHAT and RUN (or --smoke)")
    if a.what == "rows":
        rows_only(a.run)
    elif a.what == "extract":
        extract(a.run, a.state, a.samples, [int(x) for x in a.ks.split(",")])
    else:
        print("| scenario | state | query | metric | AUPRC | recall@k | accused (planted/total) | planted ranks |")
        print("|---|---|---|---|---|---|---|---|")
        analyse(a.run, a.state, [float(x) for x in a.lams.split(",")], a.agg)


if __name__ == "__main__":
    main()
