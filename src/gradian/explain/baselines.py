"""Honest baselines for attribution, scored by the same harness as Gradian's gradient scores.

Published work finds that simple baselines often match influence functions on LLM tasks; `bench/fidelity.py`
runs these beside every preconditioner on the scenario suite. Each baseline gives per-item scores [Q, N] (one row
per failing eval item, one column per training row, higher = more accused), averaged over items like Gradian's.

* ``bm25``: Okapi BM25 of each training row's text (`Example.plain_text()`) against the failing item's prompt plus
  the answer the fine-tune generated. Implemented here with numpy/scipy (no extra dependency): the Lucene
  non-negative idf ln(1 + (N - n_t + 0.5) / (n_t + 0.5)), k1 = 1.5, b = 0.75, lower-cased alphanumeric words, a
  query term counted once per occurrence.
* ``bm25_question``: the same BM25 over the failing item's prompt alone (what a user greps for before reading the
  answers; on a behaviour the fine-tune's answer is one wording of it, which matches the rows worded that way).
* ``repsim``: cosine similarity of mean last-layer hidden states (the tuned model, adapter on, mean over every
  attended token) between each training row, rendered exactly as it is indexed, and the failing item's prompt with
  the generated answer, rendered as a training row.
* ``gradcos``: cosine between each row's index vector and the item's query gradient (the same vectors Gradian's
  identity score uses, normalised on both sides, so large-norm rows no longer dominate), with Gradian's harm sign.

The maths (`bm25_scores`, `cosine_matrix`, `gradient_cosine`) is pure numpy; `mean_hidden_states` runs the
model; `compute_baselines` wires them to an open `gradian.setup.session.Session`.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "BASELINES",
    "bm25_tokenize",
    "bm25_scores",
    "cosine_matrix",
    "mean_hidden_states",
    "representation_similarity",
    "gradient_cosine",
    "index_row_norms",
    "compute_baselines",
]

BASELINES = ("repsim", "bm25", "bm25_question", "gradcos")
_WORD = re.compile(r"[a-z0-9]+")


# ---------------------------------------------------------------------------------------------------- BM25
def bm25_tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric words ("Zorvath's favorite" -> ["zorvath", "s", "favorite"])."""
    return _WORD.findall(text.lower())


def bm25_scores(docs: Sequence[str], queries: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """Okapi BM25 scores [Q, N] of every document for every query.

    score(q, d) = sum over query words t (with repetition) of
    idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5)), n_t the number of documents containing t, |d| in words.
    Words that no document contains add nothing."""
    from scipy import sparse

    toks = [bm25_tokenize(d) for d in docs]
    n = len(toks)
    vocab: dict[str, int] = {}
    rows, cols, vals = [], [], []
    for i, t in enumerate(toks):
        for w, c in Counter(t).items():
            j = vocab.setdefault(w, len(vocab))
            rows.append(i)
            cols.append(j)
            vals.append(c)
    out = np.zeros((len(queries), n), dtype=np.float64)
    if n == 0 or not vocab:
        return out
    tf = sparse.csr_matrix((np.asarray(vals, dtype=np.float64), (rows, cols)), shape=(n, len(vocab)))
    dl = np.array([len(t) for t in toks], dtype=np.float64)
    avgdl = max(dl.mean(), 1e-12)
    df = np.bincount(np.asarray(cols, dtype=np.int64), minlength=len(vocab)).astype(np.float64)
    idf = np.log1p((n - df + 0.5) / (df + 0.5))
    # BM25 term weight of every (doc, word) pair, kept sparse: tf (k1 + 1) / (tf + k1 (1 - b + b dl / avgdl))
    norm = k1 * (1.0 - b + b * dl / avgdl)
    coo = tf.tocoo()
    w = coo.data * (k1 + 1.0) / (coo.data + norm[coo.row]) * idf[coo.col]
    weights = sparse.csr_matrix((w, (coo.row, coo.col)), shape=tf.shape)
    for qi, q in enumerate(queries):
        counts = Counter(t for t in bm25_tokenize(q) if t in vocab)
        if not counts:
            continue
        qv = np.zeros(len(vocab))
        for t, c in counts.items():
            qv[vocab[t]] = c
        out[qi] = weights @ qv
    return out


# ---------------------------------------------------------------------------------------------------- similarities
def cosine_matrix(a: np.ndarray, b: np.ndarray, eps: float = 1e-30) -> np.ndarray:
    """Cosine similarity [len(a), len(b)] of the rows of a and b (a zero row has similarity 0 to everything)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    an = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), eps)
    bn = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), eps)
    return an @ bn.T


def representation_similarity(train_states: np.ndarray, query_states: np.ndarray) -> np.ndarray:
    """Per-item scores [Q, N]: cosine of each failing item's mean hidden state with each training row's."""
    return cosine_matrix(query_states, train_states)


def gradient_cosine(inner: np.ndarray, query_norms: np.ndarray, row_norms: np.ndarray, eps: float = 1e-30
                    ) -> np.ndarray:
    """Per-item harm scores [Q, N] = -cos(q, g) from raw inner products <q, g> and the norms of both sides (the
    minus is Gradian's harm sign: a row whose gradient step lowers the wrong answer's margin scores high)."""
    from ..attribution.scoring import harm_from_inner

    inner = np.asarray(inner, dtype=np.float64)
    qn = np.maximum(np.asarray(query_norms, dtype=np.float64), eps)[:, None]
    rn = np.maximum(np.asarray(row_norms, dtype=np.float64), eps)[None, :]
    return harm_from_inner(inner / qn / rn)


def index_row_norms(index, row_keys: Sequence[str]) -> np.ndarray:
    """L2 norm of each row's stored vector, streamed shard by shard from a `GradientIndex`."""
    norms: dict[str, float] = {}
    for keys, block in index.iter_shards():
        sq = np.einsum("ij,ij->i", block, block, dtype=np.float64)
        norms.update(zip(keys, np.sqrt(sq).tolist()))
    return np.array([norms[k] for k in row_keys], dtype=np.float64)


def mean_hidden_states(model, toks, pad_id: int, *, batch_size: int = 8) -> np.ndarray:
    """[N, H] mean of the last hidden state over each row's attended tokens (model as given: adapter on)."""
    import torch

    from ..setup.batches import batches

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(toks)), key=lambda i: (len(toks[i].input_ids), i))  # less padding
    res: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for batch, ids, attn, _ in batches(toks, order, batch_size, pad_id, device):
            o = model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
            h = o.hidden_states[-1].float()
            m = attn.unsqueeze(-1).float()
            mean = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
            for i, v in zip(batch, mean.cpu().numpy()):
                res[i] = v
    if was_training:
        model.train()
    out = [res[i] for i in range(len(toks))]
    return np.stack(out).astype(np.float64) if out else np.zeros((0, 0))


# ---------------------------------------------------------------------------------------------------- harness
def compute_baselines(session, queries, *, which: Sequence[str] = BASELINES, capture=None, index=None,
                      row_keys: Optional[Sequence[str]] = None, timings: Optional[dict] = None
                      ) -> dict[str, np.ndarray]:
    """Per-item scores [Q, N] of each baseline in `which` for the failing items `queries` (`query.QueryItem`s, or
    dicts with item/prompt/generated as in report.json's `query.items`), over the session's training rows.

    `gradcos` needs the session's gradient `capture` and open `index` (with `row_keys`), as `pipeline.index_stage` returns."""
    import time

    from ..setup.tokenize import eval_answer_example, tokenize_example

    s = session
    qs = [q if isinstance(q, dict) else {"item": q.item, "prompt": q.prompt, "generated": q.generated,
                                         "expected": q.expected, "formulation": q.formulation} for q in queries]
    by_pos = {it.position: it for it in (s.eval_items or [])}
    out: dict[str, np.ndarray] = {}
    timings = timings if timings is not None else {}
    pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else 0
    L = s.cfg.grads.max_seq_length
    bs = s.cfg.grads.batch_size
    if "bm25" in which:
        t0 = time.process_time()
        docs = [e.plain_text() for e in s.examples]
        out["bm25"] = bm25_scores(docs, [f"{q['prompt']} {q['generated']}" for q in qs])
        timings["bm25"] = time.process_time() - t0
    if "bm25_question" in which:
        t0 = time.process_time()
        docs = [e.plain_text() for e in s.examples]
        out["bm25_question"] = bm25_scores(docs, [q["prompt"] for q in qs])
        timings["bm25_question"] = time.process_time() - t0
    if "repsim" in which:
        t0 = time.process_time()
        train_h = mean_hidden_states(s.model, s.toks, pad, batch_size=bs)
        q_toks = [tokenize_example(s.tokenizer, eval_answer_example(by_pos[q["item"]], q["generated"], s.chat), L)
                  for q in qs]
        q_h = mean_hidden_states(s.model, q_toks, pad, batch_size=bs) if q_toks else np.zeros((0, train_h.shape[1]))
        out["repsim"] = representation_similarity(train_h, q_h)
        timings["repsim"] = time.process_time() - t0
    if "gradcos" in which:
        if capture is None or index is None or row_keys is None:
            raise ValueError("gradcos needs the gradient capture, the open index and its row keys (pipeline.index_stage)")
        from ..attribution.formulation import Formulation
        from ..attribution.queries import query_vectors
        from ..report.read import query_from_entry
        from ..report.schema import QueryEntry

        t0 = time.process_time()
        # every query field the report holds (own-words target, side and span): the query `attribute` scored
        qitems = [q if not isinstance(q, dict) else query_from_entry(QueryEntry.model_validate(q), Formulation.contrastive)
                  for q in queries]
        qv = query_vectors(capture, s.tokenizer, s.eval_items, qitems, chat=s.chat, max_len=L,
                           batch_size=bs).numpy().astype(np.float64)
        inner = index.score(qv.astype(np.float32), list(row_keys))
        out["gradcos"] = gradient_cosine(inner, np.linalg.norm(qv, axis=1), index_row_norms(index, row_keys))
        timings["gradcos"] = time.process_time() - t0
    return out
