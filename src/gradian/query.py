"""Failing eval items -> query gradients in the same space as the index.

contrastive: grad [loss(expected) - loss(the model's own generated wrong answer)]: it isolates what separates the
right answer from the wrong one, instead of everything that makes the expected string likely.
classic: grad loss(expected).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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
    formulation: str  # contrastive | classic


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


def query_items(cap: CapabilityResult, items: Sequence[EvalItem], idx: Sequence[int], formulation: str) -> list[QueryItem]:
    out = []
    for i in idx:
        gen = cap.tuned_generated[i] if cap.tuned_generated else ""
        f = formulation
        # Nothing to contrast against when the model's answer is empty or already the expected one.
        if f == "contrastive" and (not gen.strip() or gen.strip() == items[i].answer.strip()):
            f = "classic"
        out.append(QueryItem(items[i].position, items[i].question_text(), items[i].answer, gen,
                             cap.base_generated[i] if cap.base_generated else "", f))
    return out


def query_vectors(capture: GradientCapture, tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *,
                  chat: bool, max_len: int, batch_size: int) -> torch.Tensor:
    """[Q, dim] query gradients (contrastive differences where formulated so)."""
    by_pos = {it.position: it for it in items}
    rows, sign, owner = [], [], []
    for qi, q in enumerate(queries):
        it = by_pos[q.item]
        rows.append(tokenize_example(tokenizer, eval_answer_example(it, q.expected, chat), max_len))
        sign.append(1.0)
        owner.append(qi)
        if q.formulation == "contrastive":
            rows.append(tokenize_example(tokenizer, eval_answer_example(it, q.generated, chat), max_len))
            sign.append(-1.0)
            owner.append(qi)
    out = torch.zeros(len(queries), capture.dim)
    device = next(capture.model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for s in range(0, len(rows), batch_size):
        ids, attn, sup = collate(rows[s : s + batch_size], pad)
        vecs, _ = capture.vectors(ids.to(device), attn.to(device), sup.to(device))
        for j, v in enumerate(vecs.cpu()):
            out[owner[s + j]] += sign[s + j] * v
    return out
