"""Failing eval items -> query gradients in the same space as the index.

own_words (the default for exact_match, contains and every metric that scores generated answers): the fine-tune's
own answer, differentiated from the token where it departs from the other model's answer: for a regression the
fine-tune's failing answer against the base's passing one (L_q = log p(the failing span)), for an improvement its
passing answer against the base's failing one (L_q = -log p(the passing span)). The query is about what the
fine-tune now says, in its own words, not about a reference string's style (`formulation.own_words_row` says why the span
and why that side). One class per formulation says what differs between them (`formulation.Kind`).
contrastive (where no generated answer passes): grad [loss(expected) - loss(the model's own generated wrong answer)]: it isolates what separates the
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
the expected one gets the margin query. `pipeline.attribute` raises `attribution.loglik_margin` (info) saying which items
used which, or `attribution.loglik_classic_fallback` (warning) when the classic query was asked for explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..capability.evaluate import CapabilityResult
from ..config import MetricKind, metric_kind
from ..grads.capture import GradientCapture
from ..grads.objectives import margin_losses, per_example_loss
from ..setup.batches import batches, length_order, owned_batches
from ..setup.records import EvalItem
from .formulation import Formulation


@dataclass(frozen=True)
class QueryItem:
    """One failing item's query, complete as built (`new_query`); a later stage adds to it with
    `dataclasses.replace` (sampled answers, decisive span)."""

    item: int  # position in the eval file
    prompt: str
    expected: str
    generated: str
    base_generated: str
    formulation: Formulation
    target: str  # the answer the query loss makes likelier: what passes the metric
    contrast: str  # the answer it makes less likely: what fails (own_words and contrastive)
    target_source: str  # whose words the target is: base | tuned | expected
    span_start: int = -1  # own_words: the row index of the decisive token (`decisive`); -1: the departure
    span: tuple = ()  # own_words: the row positions the query differentiates (`decisive.decision_positions`)
    samples: tuple = ()  # behaviour: ((answer text, coefficient of its loss in L_q), ...) (`behaviour`)

    @property
    def own_words(self) -> bool:
        """A query with a decisive token (decisive tokens, a query span in the report)."""
        return self.formulation.kind.decisive

    def __post_init__(self):
        # every caller asks `formulation.kind`: a bare name (as report.json writes it) goes through `new_query`
        if not isinstance(self.formulation, Formulation):
            raise TypeError(f"QueryItem.formulation must be a Formulation, not {self.formulation!r} (use new_query)")


def new_query(item: int, prompt: str, expected: str, generated: str, base_generated: str,
              formulation: Formulation | str, target: str = "", contrast: str = "", target_source: str = "expected",
              span_start: int = -1, span: tuple = (), samples: tuple = ()) -> QueryItem:
    """A complete QueryItem: the target defaults to the expected answer, and the contrast to what the formulation
    contrasts the target with (`Kind.contrast`: the generated answer in the expected answer's surface form for a
    contrastive query). `formulation` may be its name as report.json writes it."""
    f = Formulation(formulation)
    return QueryItem(item, prompt, expected, generated, base_generated, f, target or expected,
                     contrast or f.kind.contrast(expected, generated), target_source, span_start, tuple(span),
                     tuple(samples))


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


def query_items(cap: CapabilityResult, items: Sequence[EvalItem], idx: Sequence[int], formulation: Formulation | str,
                metric: Optional[str] = None, direction: str = "regression") -> list[QueryItem]:
    """One query per selected item, contrasting what passes the metric with what fails, in the models' own words.

    `own_words` (attribution.query: contrastive, the default): the answer one model generated that passes against
    the one the other generated that fails: for a regression the base's answer against the fine-tune's, for an
    improvement the fine-tune's against the base's. Both are full answers in the model's own style, so their loss
    difference is about what differs (the tokens before they part cancel exactly: a causal LM's loss of a token
    depends only on the tokens before it), not about the gap between a reference string and how the model talks.
    Where no generated answer passes (an item the selection kept although neither model passes), the reference
    answer is the target instead (`contrastive`: grad[loss(expected) - loss(generated)]). `classic`: grad
    loss(expected). With metric "loglik" an item with nothing to contrast against gets the margin query. The
    formulation asked for (`formulation.asked`, or its name) chooses each item's own (`Kind.for_item`)."""
    metric = metric if metric is not None else getattr(cap, "metric", None)
    kind = Formulation(formulation).kind
    likelihood = metric is not None and metric_kind(str(metric)) is MetricKind.loglik
    out = []
    for i in idx:
        it = items[i]
        gen = cap.tuned_generated[i] if cap.tuned_generated else ""
        base_gen = cap.base_generated[i] if cap.base_generated else ""
        f, target, contrast, source = kind.for_item(cap, it, i, direction, likelihood)
        out.append(new_query(it.position, it.question_text(), it.answer, gen, base_gen, f, target, contrast, source))
    return out


def query_rows(tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *, chat: bool, max_len: int):
    """The tokenized rows each query is made of: (rows, sign, owner) for the loss-based queries and [(query, row)]
    for margin queries. `query_vectors` differentiates these rows and `query_losses` evaluates them, so the two
    agree by construction.

    behaviour: one row per sampled answer, the whole answer supervised, its sign the coefficient of its loss
    (`behaviour.behaviour_weights`); own_words: one row, the fine-tune's own answer supervised from the token where
    it departs from the other model's answer (sign -1 for a regression, where that answer fails: L_q = -loss(the failing span); +1 for an
    improvement, where it passes: L_q = loss(the passing span)); contrastive: loss(expected) - loss(generated);
    classic: loss(expected)."""
    by_pos = {it.position: it for it in items}
    rows, sign, owner, margin_rows = [], [], [], []
    for qi, q in enumerate(queries):
        kind = q.formulation.kind
        for t, w in kind.rows(tokenizer, by_pos[q.item], q, chat=chat, max_len=max_len):
            if kind.by_margin:
                margin_rows.append((qi, t))
                continue
            rows.append(t)
            sign.append(w)
            owner.append(qi)
    return rows, sign, owner, margin_rows


def query_vectors(capture: GradientCapture, tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *,
                  chat: bool, max_len: int, batch_size: int) -> torch.Tensor:
    """[Q, dim] query gradients (contrastive differences where formulated so)."""
    rows, sign, owner, margin_rows = query_rows(tokenizer, items, queries, chat=chat, max_len=max_len)
    out = torch.zeros(len(queries), capture.dim)
    device = next(capture.model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for part, vecs in _split_batches(rows, batch_size, pad, device, capture.vectors):
        for j, v in zip(part, vecs):
            out[owner[j]] += sign[j] * v
    mtoks = [t for _, t in margin_rows]
    for part, vecs in _split_batches(mtoks, batch_size, pad, device, capture.margin_vectors):
        for j, v in zip(part, vecs):
            out[margin_rows[j][0]] += v
    return out


def _split_batches(toks, batch_size: int, pad: int, device, fn):
    """(positions, vectors on CPU) per batch, in batch order. Under torchrun batch j is computed by rank j % N and
    every rank gets all of them (`distributed.gather_by_index`), so the sums above run in one process's order."""
    from ..distributed import current, gather_by_index

    ranks = current()
    got = {}
    # batches of similar lengths: a behaviour query's sampled answers differ in length, items in their prompts
    for j, part, ids, attn, sup in owned_batches(toks, length_order(toks), batch_size, pad, device, ranks.owns):
        vecs, _ = fn(ids, attn, sup)
        got[j] = (part, vecs.detach().cpu())
    if ranks.active:
        got = gather_by_index(got)
    return [got[j] for j in sorted(got)]


@torch.no_grad()
def query_losses(model, tokenizer, items: Sequence[EvalItem], queries: Sequence[QueryItem], *, chat: bool, max_len: int,
                 batch_size: int) -> np.ndarray:
    """The scalar query loss L_q of each query under `model` (float64), the function whose gradient
    `query_vectors` takes: loss(expected) - loss(generated) (contrastive), loss(expected) (classic) or -margin at
    the decisive token (margin; the token is chosen under this model)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = np.zeros(len(queries))
    rows, sign, owner, mrows = query_rows(tokenizer, items, queries, chat=chat, max_len=max_len)
    for part, ids, attn, sup in batches(rows, range(len(rows)), batch_size, pad, device):
        losses = per_example_loss(model, ids, attn, sup).double().cpu().numpy()
        for j, v in zip(part, losses):
            out[owner[j]] += sign[j] * float(v)
    mtoks = [t for _, t in mrows]
    for part, ids, attn, sup in batches(mtoks, range(len(mtoks)), batch_size, pad, device):
        losses, _ = margin_losses(model, ids, attn, sup)
        for j, v in zip(part, losses.double().cpu().numpy()):
            out[mrows[j][0]] += float(v)
    return out


def loglik_flags(qitems: Sequence[QueryItem]) -> list[tuple[str, str, str, str]]:
    """The report flags (id, level, message, fix) of queries built for `evaluation.metric: loglik`."""
    forms = [q.formulation for q in qitems]
    n_classic = forms.count(Formulation.classic)
    out = []
    if n_classic:
        out.append(("attribution.loglik_classic_fallback", "warning",
                    f"evaluation.metric is loglik and {n_classic} item(s) use the classic query "
                    "(grad loss(expected)), whose sign can invert on substitution failures",
                    "set attribution.query: contrastive (the margin query is used where no answer differs)"))
    n_c, n_m = forms.count(Formulation.contrastive), forms.count(Formulation.margin)
    if n_c or n_m:
        out.append(("attribution.loglik_margin", "info",
                    f"evaluation.metric is loglik: {n_c} item(s) use the contrastive query against the fine-tune's "
                    f"greedy answer (full expected-answer log-prob against it); {n_m} item(s) whose greedy answer is the "
                    "expected one use the margin query (the expected token's logit against the log-sum-exp of the "
                    "others, at its least-preferred answer token)", ""))
    return out
