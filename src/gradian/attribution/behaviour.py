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
from transformers import LogitsProcessorList

from ..capability.evaluate import _stop_ids, answer_text
from ..setup.tokenize import eval_prompt_ids
from .formulation import Formulation

__all__ = ["Sample", "sample_answers", "behaviour_weights", "greedy_weights", "with_samples"]

SOURCES = ("tuned",)  # the models sampled (`sample_answers`)


@dataclass(frozen=True)
class Sample:
    text: str
    source: str  # "tuned" | "base"
    passes: bool  # the metric's verdict (score >= 0.5)


SAMPLE_ROWS = 64  # sampled sequences one `generate` call draws at most (items x samples, whole items)


@torch.no_grad()
def sample_answers(model, tokenizer, items: Sequence, qitems: Sequence, metric, *, chat: bool, n: int,
                   max_new_tokens: int, seed: int, one_line: bool, sources: Sequence[str] = ("tuned",),
                   temperature: float) -> list[tuple[Sample, ...]]:
    """For each query, `n` answers sampled from each model of `sources` ("tuned": the fine-tune, adapter on;
    "base": adapter off) at `temperature` with no top-k / top-p truncation, each labelled by `metric`. Seeded per
    item and model (`seed`, the item's position), so a rerun draws the same answers.

    Items are drawn together, `SAMPLE_ROWS // n` at a time (one left-padded `generate` call: a decoding step over
    64 sequences costs little more than over 16), each from its own generator (`PerItemSampler`): an item's draws
    are those of `model.generate` on its prompt alone with its seed, up to the last bits of batched logits."""
    by_pos = {it.position: it for it in items}
    stops = _stop_ids(tokenizer, model, chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    per = max(1, SAMPLE_ROWS // max(n, 1))
    got: list[list[Sample]] = [[] for _ in qitems]
    for k, source in enumerate(("tuned", "base")):
        if source not in sources:
            continue
        ctx = model.disable_adapter() if source == "base" else contextlib.nullcontext()
        for a in range(0, len(qitems), per):
            group = list(range(a, min(len(qitems), a + per)))
            prompts = [eval_prompt_ids(tokenizer, by_pos[qitems[g].item], chat) for g in group]
            T = max(len(x) for x in prompts)
            ids = torch.full((len(group), T), pad, dtype=torch.long)
            attn = torch.zeros((len(group), T), dtype=torch.long)
            for r, x in enumerate(prompts):
                ids[r, T - len(x):] = torch.tensor(x)
                attn[r, T - len(x):] = 1
            gens = [torch.Generator(device="cpu").manual_seed(int(seed) * 1_000_003 + 2 * int(qitems[g].item) + k)
                    for g in group]
            sampler = PerItemSampler([_item_seed(gn) for gn in gens], n, float(temperature))
            rows = torch.arange(len(group)).repeat_interleave(n)  # each item's n rows together, as its own call had
            with ctx:
                seqs = model.generate(input_ids=ids[rows].to(device), attention_mask=attn[rows].to(device),
                                      do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                      eos_token_id=stops or None, temperature=None, top_p=None, top_k=None,
                                      logits_processor=LogitsProcessorList([sampler]))
            for r, row in enumerate(seqs[:, T:].tolist()):
                g = group[r // n]
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                text = answer_text(tokenizer, row[:cut], one_line=one_line)
                got[g].append(Sample(text, source, metric.score(by_pos[qitems[g].item], text) >= 0.5))
    return [tuple(x) for x in got]


def _item_seed(gen: torch.Generator) -> int:
    """The seed `model.generate` on one item would have drawn its answers with (the global generator seeded from
    `gen`, as the item's own call always did)."""
    return int(torch.randint(0, 2**62, (1,), generator=gen))


class PerItemSampler:
    """A logits processor that samples each item's `n` rows from the tempered distribution (no top-k / top-p) with
    the item's own generator, and returns that choice as the only finite logit, so a greedy `generate` takes it:
    batching items changes no item's draws (each generator sees one [n, V] draw per step, as its own call did)."""

    def __init__(self, seeds: Sequence[int], n: int, temperature: float):
        self.gens = [torch.Generator(device="cpu").manual_seed(int(x)) for x in seeds]
        self.n, self.temperature = n, temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        pick = torch.cat([torch.multinomial(probs[k * self.n:(k + 1) * self.n].cpu(), 1, generator=g)
                          for k, g in enumerate(self.gens)]).to(scores.device)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, pick, 0.0)


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
        out.append(replace(q, formulation=Formulation.behaviour, samples=w) if w else q)
    return out


def greedy_weights(q, direction: str) -> tuple[tuple[str, float], ...]:
    """The fine-tune's greedy answer as the one answer on its side (`behaviour_weights`' sign), or () when empty."""
    if not q.generated.strip():
        return ()
    return ((q.generated, -1.0 if direction != "improvement" else 1.0),)

