"""Failing eval items -> query gradients in the same space as the index.

contrastive: grad [loss(expected) - loss(the model's own generated wrong answer)]: it isolates what separates the
right answer from the wrong one, instead of everything that makes the expected string likely.
classic: grad loss(expected).
margin: grad [-(z_y - logsumexp_{v != y} z_v)] at the expected answer's least-preferred token (its "decisive" token:
the lowest margin under the fine-tune), i.e. the expected token's logit against the log-sum-exp of all the others.

With `evaluation.metric: loglik` an item "fails" because the expected answer became less likely, and the fine-tune
may still generate it, so there is nothing to subtract. The classic query is not used silently there: its gradient
is dominated by making the expected string likely in general, and its sign inverts on substitution failures (the
wrong-value rows also lower the loss of the shared answer prefix and end-of-turn). Instead (`query_items` with
metric="loglik"): an item whose greedy answer differs from the expected one gets the contrastive query against that
greedy answer (the full expected-answer log-prob against the model's own answer); an item whose greedy answer *is*
the expected one gets the margin query. `api.attribute` raises `attribution.loglik_margin` (info) saying which items
used which, or `attribution.loglik_classic_fallback` (warning) when the classic query was asked for explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .capability import CapabilityResult
from .capture import GradientCapture
from .data import EvalItem, collate, eval_answer_example, tokenize_example


@dataclass
class QueryItem:
    item: int  # position in the eval file
    prompt: str
    expected: str
    generated: str
    base_generated: str
    formulation: str  # contrastive | classic | margin


def contrast_answer(expected: str, generated: str) -> str:
    """The generated answer in the expected answer's surface form, so the contrast is about the answer and not about
    how it was printed: generation strips white space (a completion-style expected answer keeps its leading space,
    " Paris", where the decoded answer has none) and exact_match ignores one trailing period (a short generation
    often ends with one). The contrast then takes the expected answer's leading white space, and loses a trailing
    period the expected answer does not have."""
    lead = expected[: len(expected) - len(expected.lstrip())]
    g = generated.strip()
    if g.endswith(".") and not expected.rstrip().endswith("."):
        g = g[:-1].rstrip()
    return lead + g if g else generated


def select_failing(cap: CapabilityResult, items: Sequence[EvalItem]) -> tuple[list[int], str]:
    """Indices of the items the fine-tune moved, and the direction ("regression" or "improvement").

    A regression is an item the base got right and the fine-tune gets wrong; those are what the fine-tune broke.
    When the capability improved, the items it fixed are the target instead.
    """
    b, t = cap.base_scores, cap.tuned_scores
    if cap.delta > 0:
        idx = [i for i in range(len(items)) if t[i] > b[i]]
        return idx, "improvement"
    idx = [i for i in range(len(items)) if t[i] < b[i]]
    if not idx:
        idx = [i for i in range(len(items)) if t[i] < 1.0]
    return idx, "regression"


def query_items(cap: CapabilityResult, items: Sequence[EvalItem], idx: Sequence[int], formulation: str,
                metric: Optional[str] = None) -> list[QueryItem]:
    """One query per selected item. With metric "loglik" (default: the capability's metric) and the contrastive
    formulation, an item with nothing to contrast against gets the margin query instead of the classic one."""
    from .capability import normalize_answer

    metric = metric if metric is not None else getattr(cap, "metric", None)
    out = []
    for i in idx:
        gen = cap.tuned_generated[i] if cap.tuned_generated else ""
        f = formulation
        if f == "contrastive" and metric == "loglik":
            if not gen.strip() or normalize_answer(gen) == normalize_answer(items[i].answer):
                f = "margin"
        # Nothing to contrast against when the model's answer is empty or already the expected one.
        elif f == "contrastive" and (not gen.strip() or gen.strip() == items[i].answer.strip()):
            f = "classic"
        out.append(QueryItem(items[i].position, items[i].question_text(), items[i].answer, gen,
                             cap.base_generated[i] if cap.base_generated else "", f))
    return out


def query_rows(tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *, chat: bool, max_len: int):
    """The tokenized rows each query is made of: (rows, sign, owner) for the loss-based queries (loss(expected),
    minus loss(generated) for contrastive ones, each row's query in `owner`) and [(query, row)] for margin queries.
    `query_vectors` differentiates these rows and `query_losses` evaluates them, so the two agree by construction."""
    by_pos = {it.position: it for it in items}
    rows, sign, owner, margin_rows = [], [], [], []
    for qi, q in enumerate(queries):
        it = by_pos[q.item]
        t = tokenize_example(tokenizer, eval_answer_example(it, q.expected, chat), max_len)
        if q.formulation == "margin":
            margin_rows.append((qi, t))
            continue
        rows.append(t)
        sign.append(1.0)
        owner.append(qi)
        if q.formulation == "contrastive":
            rows.append(tokenize_example(tokenizer, eval_answer_example(it, contrast_answer(q.expected, q.generated), chat),
                                         max_len))
            sign.append(-1.0)
            owner.append(qi)
    return rows, sign, owner, margin_rows


def query_vectors(capture: GradientCapture, tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *,
                  chat: bool, max_len: int, batch_size: int) -> torch.Tensor:
    """[Q, dim] query gradients (contrastive differences where formulated so)."""
    rows, sign, owner, margin_rows = query_rows(tokenizer, items, queries, chat=chat, max_len=max_len)
    out = torch.zeros(len(queries), capture.dim)
    device = next(capture.model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for s in range(0, len(rows), batch_size):
        ids, attn, sup = collate(rows[s : s + batch_size], pad)
        vecs, _ = capture.vectors(ids.to(device), attn.to(device), sup.to(device))
        for j, v in enumerate(vecs.cpu()):
            out[owner[s + j]] += sign[s + j] * v
    for s in range(0, len(margin_rows), batch_size):
        part = margin_rows[s : s + batch_size]
        ids, attn, sup = collate([t for _, t in part], pad)
        vecs, _ = margin_vectors(capture, ids.to(device), attn.to(device), sup.to(device))
        for (qi, _), v in zip(part, vecs.cpu()):
            out[qi] += v
    return out


# ------------------------------------------------------------------------------------------------ margin query


def _answer_logits(model, input_ids, attention_mask, supervised):
    """(batch index, target ids, fp32 logits [n, V]) at every supervised answer token."""
    from .loss import _head_of, backbone_hidden, supervised_positions

    b_idx, pred_pos, tgt_pos = supervised_positions(supervised)
    targets = input_ids[b_idx, tgt_pos]
    head, softcap, exact = _head_of(model)
    if exact:
        hidden = backbone_hidden(model, input_ids, attention_mask)
        logits = torch.nn.functional.linear(hidden[b_idx, pred_pos], head.weight, head.bias).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[b_idx, pred_pos].float()
    return b_idx, targets, logits


def token_margins(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """z_y - logsumexp_{v != y} z_v per row (the log-odds of the target against everything else)."""
    zy = logits.gather(1, targets[:, None]).squeeze(1)
    others = logits.scatter(1, targets[:, None], float("-inf"))
    return zy - torch.logsumexp(others, dim=-1)


def margin_losses(model, input_ids, attention_mask, supervised):
    """Per example, -margin at its decisive answer token (the lowest margin; the first on ties), and that token's
    index among the example's supervised tokens. Differentiable through the model."""
    b_idx, targets, logits = _answer_logits(model, input_ids, attention_mask, supervised)
    m = token_margins(logits, targets)
    B = input_ids.shape[0]
    pick, which = [], []
    md = m.detach()
    for b in range(B):
        sel = (b_idx == b).nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            which.append(-1)
            continue
        j = int(torch.argmin(md[sel]))
        which.append(j)
        pick.append(int(sel[j]))
    pick_t = torch.tensor(pick, dtype=torch.long, device=logits.device)
    losses = torch.zeros(B, dtype=torch.float32, device=logits.device).index_add(0, b_idx[pick_t], -m[pick_t])
    return losses, which


def margin_vectors(capture: GradientCapture, input_ids, attention_mask, supervised):
    """[B, dim] gradients of each example's margin-query loss in the capture's (index) space, and the losses.
    The same per-example hook algebra as `GradientCapture.site_grads`, with the margin loss in place of the
    summed token loss."""
    with capture._recording() as rec:
        losses, _ = margin_losses(capture.model, input_ids, attention_mask, supervised)
    per_site = capture.grads_from_recording(rec, losses.sum(), input_ids.shape[0])
    vecs = [capture.projector.project(i, dA, dB) for i, (dA, dB) in enumerate(per_site)]
    return torch.cat(vecs, dim=1), losses.detach()


@torch.no_grad()
def query_losses(model, tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *, chat: bool, max_len: int,
                 batch_size: int) -> np.ndarray:
    """The scalar query loss L_q of each query under `model` (float64), the function whose gradient
    `query_vectors` takes: loss(expected) - loss(generated) (contrastive), loss(expected) (classic) or -margin at
    the decisive token (margin; the token is chosen under this model)."""
    from .loss import per_example_loss

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = np.zeros(len(queries))
    rows, sign, owner, mrows = query_rows(tokenizer, items, queries, chat=chat, max_len=max_len)
    for s in range(0, len(rows), batch_size):
        ids, attn, sup = collate(rows[s : s + batch_size], pad)
        l = per_example_loss(model, ids.to(device), attn.to(device), sup.to(device)).double().cpu().numpy()
        for j, v in enumerate(l):
            out[owner[s + j]] += sign[s + j] * float(v)
    for s in range(0, len(mrows), batch_size):
        part = mrows[s : s + batch_size]
        ids, attn, sup = collate([t for _, t in part], pad)
        l, _ = margin_losses(model, ids.to(device), attn.to(device), sup.to(device))
        for (qi, _), v in zip(part, l.double().cpu().numpy()):
            out[qi] += float(v)
    return out
