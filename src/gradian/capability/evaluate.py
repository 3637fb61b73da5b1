"""The capability delta: base vs fine-tuned on the eval set, generated greedily, per-item metric, paired bootstrap
interval. `item_scores` is the one way a model is scored on the eval set (base, fine-tune and every retrain)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..distributed import current, gather_by_index
from ..grads.objectives import per_example_loss
from ..progress import progress_bar
from ..setup.batches import length_order, owned_batches
from ..setup.records import EvalItem
from ..setup.tokenize import eval_answer_example, eval_prompt_ids, tokenize_example
from .metrics import as_metric, loglik_score, min_detectable_delta, paired_bootstrap


# ---------------------------------------------------------------- generation and scoring


def _stop_ids(tokenizer, model, chat: bool = True) -> list[int]:
    """Where greedy generation stops: the model's generation_config EOS and the tokenizer's EOS (what
    `model.generate` stops at), and, for prompts rendered through a chat template, the template's end-of-turn
    token. A plain-text prompt of a base model stops where `model.generate` does."""
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    if not (chat and getattr(tokenizer, "chat_template", None)):
        return sorted(ids)
    # Chat templates end a turn with their own token (<|im_end|>, <|eot_id|>, <end_of_turn>, ...).
    for tok in getattr(tokenizer, "all_special_tokens", []) or []:
        if "end" in tok.lower() or "eot" in tok.lower():
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid >= 0:
                ids.add(tid)
    return sorted(ids)


@torch.no_grad()
def generate_from(model, tokenizer, prefixes: Sequence[Sequence[int]], *, chat: bool, max_new_tokens: int,
                  batch_size: int, desc: str = "generate", budgets: Optional[Sequence[int]] = None
                  ) -> list[list[int]]:
    """Greedy continuations (token ids, up to and without the stop token) of token-id prefixes, batched with left
    padding: each equals `model.generate` on its prefix alone (tests/test_generation_parity.py). `budgets` (one per
    prefix, at most `max_new_tokens`) caps each continuation: the prefixes are batched by decreasing budget, each
    batch generates its largest budget and every continuation is cut to its own (greedy decoding makes the first n
    tokens of a longer run the run of n); a budget of 0 is an empty continuation, with no model call."""
    cap = [max_new_tokens] * len(prefixes) if budgets is None else [min(int(b), max_new_tokens) for b in budgets]
    todo = [i for i in sorted(range(len(prefixes)), key=lambda i: (-cap[i], i)) if cap[i] > 0]
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = _stop_ids(tokenizer, model, chat)
    starts = list(range(0, len(todo), batch_size))
    ranks = current()
    done: dict[int, list[list[int]]] = {}
    with progress_bar(desc, total=len(todo), split=True) as bar:
        for j, s in enumerate(starts):
            if not ranks.owns(j):  # under torchrun, batch j is rank j % N's; the answers are gathered below
                continue
            idx = todo[s : s + batch_size]
            chunk = [list(prefixes[i]) for i in idx]
            T = max(len(c) for c in chunk)
            ids = torch.full((len(chunk), T), pad, dtype=torch.long)
            attn = torch.zeros((len(chunk), T), dtype=torch.long)
            for i, c in enumerate(chunk):
                ids[i, T - len(c) :] = torch.tensor(c)
                attn[i, T - len(c) :] = 1
            gen = model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max(cap[i] for i in idx),
                do_sample=False, num_beams=1, pad_token_id=pad, eos_token_id=stops or None,
                temperature=None, top_p=None, top_k=None,
            )
            out = []
            for i, row in zip(idx, gen[:, T:].tolist()):
                row = row[: cap[i]]
                cut = next((k for k, t in enumerate(row) if t in stops), len(row))
                out.append(row[:cut])
            done[j] = out
            bar.advance(len(chunk))
    every = gather_by_index(done)
    got = {i: a for j in range(len(starts)) for i, a in zip(todo[starts[j] : starts[j] + batch_size], every[j])}
    return [got.get(i, []) for i in range(len(prefixes))]


def answer_text(tokenizer, ids: Sequence[int], *, raw: bool = False, one_line: bool = False) -> str:
    """An answer's text from its token ids: special tokens dropped, surrounding white space stripped unless `raw`
    (a plain-text prompt's answer keeps the space it starts with, which a query built on it needs), and, with
    `one_line`, cut at its first line break after some text (`one_line_answers`)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    if one_line:
        lead = len(text) - len(text.lstrip())
        nl = text.find("\n", lead)
        if nl >= 0:
            text = text[:nl]
    return text.rstrip() if raw else text.strip()


def one_line_answers(examples, chat: bool) -> bool:
    """Whether answers end at their first line break: plain-text prompts (no chat template: a base model does not
    stop, it goes on with the next "Question: ...") when every training completion is one line, so the answer a
    user reads, and the one the fine-tune learned to give, is that line."""
    if chat:
        return False
    comps = [e.record.get("completion") for e in examples if e.shape == "prompt_completion"]
    return bool(comps) and all(isinstance(c, str) and "\n" not in c.strip() for c in comps)


def generate_answers(
    model, tokenizer, items: Sequence[EvalItem], *, chat: bool, max_new_tokens: int, batch_size: int, desc: str = "generate",
    raw: bool = False, one_line: bool = False,
) -> list[str]:
    """Greedy answers to the eval prompts (`generate_from` over `eval_prompt_ids`), as text (`answer_text`)."""
    prompts = [eval_prompt_ids(tokenizer, it, chat) for it in items]
    gen = generate_from(model, tokenizer, prompts, chat=chat, max_new_tokens=max_new_tokens, batch_size=batch_size,
                        desc=desc)
    return [answer_text(tokenizer, g, raw=raw, one_line=one_line) for g in gen]


@torch.no_grad()
def answer_logprobs(model, tokenizer, items: Sequence[EvalItem], answers: Sequence[str], *, chat: bool, max_len: int,
                    batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probability of each answer after its prompt, and its number of tokens."""
    toks = [tokenize_example(tokenizer, eval_answer_example(it, a, chat), max_len) for it, a in zip(items, answers)]
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lp, n = np.zeros(len(toks)), np.array([t.n_supervised for t in toks])
    done = {}
    # batches of similar lengths (a long expected answer beside a short generated one would pad the short)
    for j, part, ids, attn, sup in owned_batches(toks, length_order(toks), batch_size, pad, device, current().owns):
        done[j] = (part, (-per_example_loss(model, ids, attn, sup)).tolist())
    for _, (part, lp_j) in sorted(gather_by_index(done).items()):
        lp[part] = lp_j
    return lp, n


@dataclass
class CapabilityResult:
    metric: str
    n: int
    base: float
    tuned: float
    delta: float
    ci: list[float]
    confidence: float
    significant: bool
    min_detectable_delta: float
    base_scores: list[float] = field(default_factory=list)
    tuned_scores: list[float] = field(default_factory=list)
    base_generated: list[str] = field(default_factory=list)
    tuned_generated: list[str] = field(default_factory=list)
    # the same answers as decoded, leading white space kept (what own-words queries are built on)
    base_raw: list[str] = field(default_factory=list)
    tuned_raw: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        for k in ("base_scores", "tuned_scores", "base_generated", "tuned_generated", "base_raw", "tuned_raw"):
            d.pop(k)
        return d


@torch.no_grad()
def item_scores(model, tokenizer, items: Sequence[EvalItem], *, metric: str, chat: bool, max_new_tokens: int,
                batch_size: int, max_len: int, desc: str = "answers", raw: Optional[list] = None,
                one_line: bool = False) -> tuple[list[float], list[str]]:
    """Per-item scores of `model` on the eval items and its greedy answers (exact_match and contains score the
    answers; loglik the expected answer's per-token probability). `raw`, a list, receives the answers with their
    leading white space."""
    raw_gen = generate_answers(model, tokenizer, items, chat=chat, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, desc=desc, raw=True, one_line=one_line)
    gen = [g.strip() for g in raw_gen]
    if raw is not None:
        raw.extend(raw_gen)
    m = as_metric(metric)
    if not m.generative:
        expected = [it.answer for it in items]
        lp, n = answer_logprobs(model, tokenizer, items, expected, chat=chat, max_len=max_len, batch_size=batch_size)
        return [float(x) for x in loglik_score(lp, n)], gen
    return [m.score(it, g) for it, g in zip(items, gen)], gen


def measure_capability(model, tokenizer, items: Sequence[EvalItem], *, metric: str, chat: bool, max_new_tokens: int,
                       batch_size: int, max_len: int, samples: int, confidence: float, seed: int,
                       one_line: bool = False) -> CapabilityResult:
    """Base (adapter disabled) vs tuned, per item."""
    kw = dict(metric=metric, chat=chat, max_new_tokens=max_new_tokens, batch_size=batch_size, max_len=max_len,
              one_line=one_line)
    base_raw: list[str] = []
    tuned_raw: list[str] = []
    with model.disable_adapter():
        base, base_gen = item_scores(model, tokenizer, items, desc="base answers", raw=base_raw, **kw)
    tuned, tuned_gen = item_scores(model, tokenizer, items, desc="tuned answers", raw=tuned_raw, **kw)
    delta, lo, hi = paired_bootstrap(base, tuned, samples=samples, confidence=confidence, seed=seed)
    significant = not (lo <= 0.0 <= hi)
    return CapabilityResult(
        metric=as_metric(metric).name, n=len(items), base=float(np.mean(base)), tuned=float(np.mean(tuned)), delta=delta, ci=[lo, hi],
        confidence=confidence, significant=significant, min_detectable_delta=min_detectable_delta(len(items), confidence),
        base_scores=[float(x) for x in base], tuned_scores=[float(x) for x in tuned],
        base_generated=base_gen, tuned_generated=tuned_gen, base_raw=base_raw, tuned_raw=tuned_raw,
    )
