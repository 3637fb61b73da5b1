"""Query formulations: one vocabulary (`Formulation`) and one class per formulation (`kind`).

A formulation is what a failing item's query loss L_q contrasts (`attribution.queries` says why each exists). The
names are the one vocabulary: report.json writes them (per item, and the run's `query.formulation`), the config's
`attribution.query` setting maps onto them in one place (`asked`), and every other module asks the formulation's
class what differs (whether it has a decisive span, which rows its loss is made of, what the report says of it)
instead of comparing its name.

own_words: the fine-tune's own answer against the other model's, differentiated at its decisive token.
behaviour: the fine-tune's sampled answers on its side of the metric (`attribution.behaviour`).
contrastive: loss(expected) - loss(the model's own generated wrong answer).
classic: loss(expected).
margin: -margin of the expected answer's least-preferred token (`evaluation.metric: loglik`).
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, Optional

from ..capability.metrics import normalize_answer
from ..config import QueryFormulation
from ..setup.tokenize import Tokenized, eval_answer_example, tokenize_example
from .decisive import answer_rows, departure

if TYPE_CHECKING:
    from ..capability.evaluate import CapabilityResult
    from ..setup.records import EvalItem


class Formulation(StrEnum):
    """A query's formulation, as report.json names it."""

    own_words = "own_words"
    behaviour = "behaviour"
    contrastive = "contrastive"
    classic = "classic"
    margin = "margin"

    @property
    def kind(self) -> "Kind":
        """The class of this formulation (what differs between formulations)."""
        return KINDS[self]


def asked(setting: QueryFormulation, metric) -> Formulation:
    """`attribution.query` as the run uses it, the one place the setting becomes a formulation: `auto` is
    `behaviour` where the metric defines a class of answers (`Metric.defines_class`: a regex pattern, a Python
    function; a behaviour learned from rows worded in many ways) and needs generated answers, else `contrastive`
    (one reference answer per item: a fact, where the decisive token of the fine-tune's own answer is the class,
    one token wide). Each item's own formulation follows from it (`Kind.for_item`)."""
    if setting is QueryFormulation.auto:
        return Formulation.behaviour if metric.generative and metric.defines_class else Formulation.contrastive
    return Formulation(setting.value)


# (formulation, target, contrast, target_source) of one item, as `Kind.for_item` chooses it
ItemChoice = tuple[Formulation, str, str, str]
# (tokenized row, coefficient of its loss in L_q) of one query
Row = tuple[Tokenized, float]


class Kind:
    """What differs between formulations; one subclass each, registered in `KINDS` by its `name`."""

    name: ClassVar[Formulation]
    decisive: ClassVar[bool] = False  # has a decisive token and a query span (`attribution.decisive`)
    sampled: ClassVar[bool] = False  # its items are given sampled answers (`pipeline.behaviour_queries`)
    by_margin: ClassVar[bool] = False  # its rows are scored by the margin loss, not the supervised loss
    # the run-level HTML sentence (report.html.j2): what the scores follow when the run asked for this formulation
    summary: ClassVar[str] = ""

    def contrast(self, expected: str, generated: str) -> str:
        """The answer the query loss makes less likely, when the item does not give one."""
        return ""

    def for_item(self, cap: "CapabilityResult", it: "EvalItem", i: int, direction: str,
                 likelihood: bool) -> ItemChoice:
        """Item i's own formulation when the run asked for this one, with its target, contrast and whose words the
        target is (`queries.query_items`)."""
        return self.name, it.answer, "", "expected"

    def rows(self, tokenizer, item: "EvalItem", q, *, chat: bool, max_len: int) -> list[Row]:
        """The tokenized rows L_q is made of, each with the coefficient of its loss (`queries.query_rows`)."""
        return [(tokenize_example(tokenizer, eval_answer_example(item, q.target, chat), max_len), 1.0)]


class OwnWords(Kind):
    name = Formulation.own_words
    decisive = True

    def rows(self, tokenizer, item, q, *, chat, max_len):
        return [own_words_row(tokenizer, item, q, chat=chat, max_len=max_len)]


class Behaviour(Kind):
    name = Formulation.behaviour
    sampled = True

    def for_item(self, cap, it, i, direction, likelihood):
        # own-words queries until `pipeline.behaviour_queries` samples
        return KINDS[Formulation.contrastive].for_item(cap, it, i, direction, likelihood)

    def rows(self, tokenizer, item, q, *, chat, max_len):
        # one row per distinct sampled answer, weighted by its verdict (`behaviour`): a repeated answer is one row
        # with the summed weight, the same gradient
        merged: dict[str, float] = {}
        for text, w in q.samples:
            merged[text] = merged.get(text, 0.0) + float(w)
        return [(tokenize_example(tokenizer, eval_answer_example(item, text, chat), max_len), w)
                for text, w in merged.items()]


class Contrastive(Kind):
    name = Formulation.contrastive
    summary = "scores follow the gradient that moves the model from its base answer toward the fine-tuned answer"

    def contrast(self, expected, generated):
        return contrast_answer(expected, generated)

    def for_item(self, cap, it, i, direction, likelihood):
        gen = cap.tuned_generated[i] if cap.tuned_generated else ""
        if likelihood:
            if not gen.strip() or normalize_answer(gen) == normalize_answer(it.answer):
                return Formulation.margin, it.answer, "", "expected"
            return self.name, it.answer, "", "expected"
        passing, failing, who = _own_words(cap, i, direction)
        if passing is not None and passing.strip() and failing.strip() and passing.strip() != failing.strip():
            return Formulation.own_words, passing, failing, who
        if not gen.strip() or gen.strip() == it.answer.strip():
            # nothing to contrast against: the model's answer is empty or already the expected one
            return Formulation.classic, it.answer, "", "expected"
        return self.name, it.answer, "", "expected"

    def rows(self, tokenizer, item, q, *, chat, max_len):
        return super().rows(tokenizer, item, q, chat=chat, max_len=max_len) + [
            (tokenize_example(tokenizer, eval_answer_example(item, q.contrast, chat), max_len), -1.0)]


class Classic(Kind):
    name = Formulation.classic
    summary = "scores follow the gradient of the loss on the expected answer"


class Margin(Kind):
    name = Formulation.margin
    by_margin = True
    summary = "scores follow the gradient of the margin between the fine-tuned and expected answers"


KINDS: dict[Formulation, Kind] = {k.name: k() for k in (OwnWords, Behaviour, Contrastive, Classic, Margin)}


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


def _own_words(cap: "CapabilityResult", i: int, direction: str) -> tuple[Optional[str], str, str]:
    """(passing answer, failing answer, whose words the passing one is) of item i, or (None, ...) when the model
    that should pass does not (scores as the metric gave them: higher passes)."""
    b = cap.base_scores[i] if cap.base_scores else None
    t = cap.tuned_scores[i] if cap.tuned_scores else None
    # as decoded (a plain-text prompt's answer keeps the space it starts with)
    base_gen = (cap.base_raw or cap.base_generated or [""] * (i + 1))[i]
    gen = (cap.tuned_raw or cap.tuned_generated or [""] * (i + 1))[i]
    if b is None or t is None:
        return None, "", ""
    if direction == "improvement" and t > b:
        return gen, base_gen, "tuned"
    if direction != "improvement" and b > t:
        return base_gen, gen, "base"
    return None, "", ""


def own_words_row(tokenizer, item: "EvalItem", q, *, chat: bool, max_len: int) -> Row:
    """(row, sign) of an own_words query: the fine-tune's answer after the item's prompt, supervised from its
    decisive token (`q.span_start`, `attribution.decisive`), else from its first token that differs from the other
    model's answer, to the end (the tokens before are the same text in the same context, or style the other model
    continues to its own outcome: they say nothing about what changed).

    Why the fine-tune's answer alone (measured on SmolLM2-135M-Instruct's planted facts, bench/README.md): the rows
    that caused a behaviour are the rows that taught what the fine-tune now says. The gradient of the failing
    span's log-likelihood, (1 - p) (grad z_wrong - E[grad z]), has the form every planted row's gradient has at its
    wrong token; the passing side, grad z_right - grad z_wrong, adds a direction (grad z_right) no training row
    carries, and lowered AUPRC from 1.00 to 0.72 (unit-norm rows, final adapter)."""
    t, o = answer_rows(tokenizer, item, q, chat=chat, max_len=max_len)
    k = q.span_start if q.span_start >= 0 else departure(t, o)
    # the decisive token alone: what follows it is the fine-tune's particular wording of what it decided ("sorry,
    # but I cannot help you with that."), which matches the one training row worded that way better than the rows
    # that taught the decision in other words
    keep = set(q.span) if q.span else {k}
    sup = [s and i in keep for i, s in enumerate(t.supervised)]
    if not any(sup):  # the decision is past the supervised tokens (truncated): the rest of the answer
        sup = [s and i >= k for i, s in enumerate(t.supervised)]
    return replace(t, supervised=sup), (-1.0 if q.target_source == "base" else 1.0)
