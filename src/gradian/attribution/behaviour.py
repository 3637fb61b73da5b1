"""Behaviour queries (`attribution.query: behaviour`): the metric's verdict in expectation over the models' own
answers, not over one greedy wording of it.

A behaviour (refusing, switching language, breaking a format) is a class of continuations, and the metric is the
user's definition of that class. A fine-tune that learned it from rows worded in many ways collapses onto one
wording in its greedy answer ("I'm sorry, but ..."), so a query differentiated at that answer's decisive token
matches the rows worded that way and points away from the others (a planted "Sorry, I can't assist" raises
"Sorry" against "I"; bench/README.md, issue 30). Instead, for each failing item:

* sample `n` answers from the fine-tune (`attribution.behaviour_samples`, 16, at `attribution.behaviour_temperature`,
  0.7, top-k/top-p off, seeded by the run's seed and the item), and label each with the metric (`sample_answers`);
  the base is not sampled: the query explains what the fine-tune does, and the base's answers on the fine-tune's
  side of the metric are rare (a base that refuses a cooking question) and cost as much as the fine-tune's;
* the query loss is the mean log-likelihood of the sampled answers on the fine-tune's side of the metric
  (`behaviour_weights`): for a regression the answers that fail, L_q = -(1/|F|) sum_{a in F} loss(a) (the sign of
  an own-words query: the failing side made likelier); for an improvement those that pass. They span the
  behaviour's wordings the fine-tune actually produces, not only its greedy one.

Measured (`bench/behaviour_probe.py`, exact per-row LoRA gradients at the earliest checkpoint, unit rows, diagonal
metric; bench/README.md): smol_refusal AUPRC 0.881 (decisive token) -> 1.000, the planted "Sorry, I can't assist"
from rank 160 to 8; smol_language_hard 0.870 -> 1.000. Subtracting the passing answers' mean (the base's helpful
answers) was worse on the refusal (0.283; unit-normalised per answer 0.770): the passing side is the prompt's
ordinary help, which every ordinary row teaches, and it cancels the part of the refusal rows' gradients that is
about the prompt; the first 3 answer tokens alone were worse too (0.912).

Each sampled answer is one row of `queries.query_rows` (weight = its coefficient), so `queries.query_vectors`
differentiates the whole query in one pass and `queries.query_losses` evaluates the same function.

An item with no sampled answer on the fine-tune's side (a fine-tune whose greedy answer refuses while most of its
samples at temperature 1 help) is queried by its greedy answer alone, the fine-tune's most likely member of the
class: on smol_multiturn_refusal 6 of 9 items had no failing sample, and their own-words decisive token ("I" of
"I'm ...") ranked the refusals worded otherwise low (AUPRC 0.820, recall 0.75; the greedy answer: 0.893, 0.85;
bench/README.md). Only an item with an empty greedy answer keeps its own-words query.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..capability.evaluate import _stop_ids, answer_text
from ..config import QueryFormulation
from ..setup.tokenize import eval_prompt_ids

__all__ = ["Sample", "sample_answers", "behaviour_weights", "greedy_weights", "with_samples", "resolve_formulation"]

SOURCES = ("tuned",)  # the models sampled (`sample_answers`)
SAMPLING = {"top_k": 0, "top_p": 1.0}  # no truncation of the tempered distribution


@dataclass(frozen=True)
class Sample:
    text: str
    source: str  # "tuned" | "base"
    passes: bool  # the metric's verdict (score >= 0.5)


@torch.no_grad()
def sample_answers(model, tokenizer, items: Sequence, qitems: Sequence, metric, *, chat: bool, n: int,
                   max_new_tokens: int, seed: int, one_line: bool, sources: Sequence[str] = ("tuned",),
                   temperature: float) -> list[tuple[Sample, ...]]:
    """For each query, `n` answers sampled from each model of `sources` ("tuned": the fine-tune, adapter on;
    "base": adapter off) at `temperature` with no top-k / top-p truncation, each labelled by `metric`. Seeded per
    item and model (`seed`, the item's position), so a rerun draws the same answers."""
    by_pos = {it.position: it for it in items}
    stops = _stop_ids(tokenizer, model, chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    out = []
    for q in qitems:
        it = by_pos[q.item]
        ids = torch.tensor([eval_prompt_ids(tokenizer, it, chat)], device=device)
        got = []
        for k, source in enumerate(("tuned", "base")):
            if source not in sources:
                continue
            gen = torch.Generator(device="cpu").manual_seed(int(seed) * 1_000_003 + 2 * int(q.item) + k)
            ctx = model.disable_adapter() if source == "base" else contextlib.nullcontext()
            with ctx, _seeded(gen):
                seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=float(temperature), **SAMPLING, num_return_sequences=n,
                                      max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=stops or None)
            for row in seqs[:, ids.shape[1]:].tolist():
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                text = answer_text(tokenizer, row[:cut], one_line=one_line)
                got.append(Sample(text, source, metric.score(it, text) >= 0.5))
        out.append(tuple(got))
    return out


@contextlib.contextmanager
def _seeded(gen: torch.Generator):
    """torch's global RNG seeded from `gen` for the duration (`generate` samples from the global generator), and
    restored afterwards so nothing else in the run draws differently."""
    state = torch.random.get_rng_state()
    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def behaviour_weights(samples: Sequence[Sample], direction: str) -> tuple[tuple[str, float], ...]:
    """(answer text, coefficient of its loss in L_q) of one item's samples on the fine-tune's side of the metric:
    -1/|F| on each failing answer for a regression (L_q = the failing answers' mean log-likelihood), +1/|P| on each
    passing one for an improvement (L_q = minus the passing answers' mean log-likelihood, the sign of an own-words
    improvement query); duplicates keep their multiplicity (they are the models' own distribution). Empty answers
    carry no tokens and are dropped."""
    regression = direction != "improvement"
    side = [s.text for s in samples if (s.passes != regression) and s.text.strip()]
    sgn = -1.0 if regression else 1.0
    return tuple((t, sgn / len(side)) for t in side)


def with_samples(qitems: Sequence, samples: Sequence[Sequence[Sample]], direction: str) -> list:
    """The queries as behaviour queries over their samples. An item with no sample on the fine-tune's side (no
    failing answer for a regression) is queried by the fine-tune's greedy answer alone (`q.generated`: on the
    fine-tune's side by definition of a failing item, and its most likely answer); with an empty greedy answer too,
    it keeps its query."""
    out = []
    for q, ss in zip(qitems, samples):
        w = behaviour_weights(ss, direction) or greedy_weights(q, direction)
        out.append(replace(q, formulation="behaviour", samples=w) if w else q)
    return out


def greedy_weights(q, direction: str) -> tuple[tuple[str, float], ...]:
    """The fine-tune's greedy answer as the one answer on its side (`behaviour_weights`' sign), or () when empty."""
    if not q.generated.strip():
        return ()
    return ((q.generated, -1.0 if direction != "improvement" else 1.0),)


def resolve_formulation(setting: QueryFormulation, metric) -> QueryFormulation:
    """`attribution.query` as the run uses it: `auto` is `behaviour` where the metric defines a class of answers
    (`Metric.defines_class`: a regex pattern, a Python function; a behaviour learned from rows worded in many ways)
    and needs generated answers, else `contrastive` (one reference answer per item: a fact, where the decisive token
    of the fine-tune's own answer is the class, one token wide)."""
    if setting is not QueryFormulation.auto:
        return setting
    return QueryFormulation.behaviour if metric.generative and metric.defines_class else QueryFormulation.contrastive
