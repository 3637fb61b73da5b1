"""The capability delta: base vs fine-tuned on the eval set, generated greedily, per-item metric, paired bootstrap
interval. `item_scores` is the one way a model is scored on the eval set (base, fine-tune and every retrain)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..distributed import current, gather_by_index
from ..grads.objectives import per_example_loss
from ..progress import progress_bar
from ..setup.batches import owned_batches
from ..setup.records import EvalItem
from ..setup.tokenize import eval_answer_example, eval_prompt_text, tokenize_example
from .metrics import item_score, loglik_score, min_detectable_delta, paired_bootstrap


# ---------------------------------------------------------------- generation and scoring


def _stop_ids(tokenizer, model) -> list[int]:
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    # Chat templates end a turn with their own token (<|im_end|>, <|eot_id|>, <end_of_turn>, ...).
    for tok in getattr(tokenizer, "all_special_tokens", []) or []:
        if "end" in tok.lower() or "eot" in tok.lower():
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid >= 0:
                ids.add(tid)
    return sorted(ids)


def _prompt_ids(tokenizer, item: EvalItem, chat: bool) -> list[int]:
    text = eval_prompt_text(tokenizer, item, chat)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos) and getattr(tokenizer, "add_bos_token", True):
        ids = [bos] + ids
    return ids


@torch.no_grad()
def generate_answers(
    model, tokenizer, items: Sequence[EvalItem], *, chat: bool, max_new_tokens: int, batch_size: int, desc: str = "generate"
) -> list[str]:
    """Greedy answers, batched with left padding."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = _stop_ids(tokenizer, model)
    starts = list(range(0, len(items), batch_size))
    ranks = current()
    done: dict[int, list[str]] = {}
    with progress_bar(desc, total=len(items), split=True) as bar:
        for j, s in enumerate(starts):
            if not ranks.owns(j):  # under torchrun, batch j is rank j % N's; the answers are gathered below
                continue
            answers: list[str] = []
            chunk = [_prompt_ids(tokenizer, it, chat) for it in items[s : s + batch_size]]
            T = max(len(c) for c in chunk)
            ids = torch.full((len(chunk), T), pad, dtype=torch.long)
            attn = torch.zeros((len(chunk), T), dtype=torch.long)
            for i, c in enumerate(chunk):
                ids[i, T - len(c) :] = torch.tensor(c)
                attn[i, T - len(c) :] = 1
            gen = model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                do_sample=False, num_beams=1, pad_token_id=pad, eos_token_id=stops or None,
                temperature=None, top_p=None, top_k=None,
            )
            for row in gen[:, T:]:
                answers.append(tokenizer.decode(row, skip_special_tokens=True).strip())
            done[j] = answers
            bar.advance(len(chunk))
    every = gather_by_index(done)
    return [a for j in range(len(starts)) for a in every[j]]


@torch.no_grad()
def answer_logprobs(model, tokenizer, items: Sequence[EvalItem], answers: Sequence[str], *, chat: bool, max_len: int,
                    batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probability of each answer after its prompt, and its number of tokens."""
    toks = [tokenize_example(tokenizer, eval_answer_example(it, a, chat), max_len) for it, a in zip(items, answers)]
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lp, n = [], []
    done = {}
    for j, part, ids, attn, sup in owned_batches(toks, range(len(toks)), batch_size, pad, device, current().owns):
        losses = per_example_loss(model, ids, attn, sup)
        done[j] = ((-losses).tolist(), [toks[i].n_supervised for i in part])
    for _, (lp_j, n_j) in sorted(gather_by_index(done).items()):
        lp.extend(lp_j)
        n.extend(n_j)
    return np.array(lp), np.array(n)


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

    def summary(self) -> dict:
        d = asdict(self)
        for k in ("base_scores", "tuned_scores", "base_generated", "tuned_generated"):
            d.pop(k)
        return d


@torch.no_grad()
def item_scores(model, tokenizer, items: Sequence[EvalItem], *, metric: str, chat: bool, max_new_tokens: int,
                batch_size: int, max_len: int, desc: str = "answers") -> tuple[list[float], list[str]]:
    """Per-item scores of `model` on the eval items and its greedy answers (exact_match and contains score the
    answers; loglik the expected answer's per-token probability)."""
    gen = generate_answers(model, tokenizer, items, chat=chat, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           desc=desc)
    expected = [it.answer for it in items]
    if metric == "loglik":
        lp, n = answer_logprobs(model, tokenizer, items, expected, chat=chat, max_len=max_len, batch_size=batch_size)
        return [float(x) for x in loglik_score(lp, n)], gen
    return [item_score(metric, g, e) for g, e in zip(gen, expected)], gen


def measure_capability(model, tokenizer, items: Sequence[EvalItem], *, metric: str, chat: bool, max_new_tokens: int,
                       batch_size: int, max_len: int, samples: int, confidence: float, seed: int) -> CapabilityResult:
    """Base (adapter disabled) vs tuned, per item."""
    kw = dict(metric=metric, chat=chat, max_new_tokens=max_new_tokens, batch_size=batch_size, max_len=max_len)
    with model.disable_adapter():
        base, base_gen = item_scores(model, tokenizer, items, desc="base answers", **kw)
    tuned, tuned_gen = item_scores(model, tokenizer, items, desc="tuned answers", **kw)
    delta, lo, hi = paired_bootstrap(base, tuned, samples=samples, confidence=confidence, seed=seed)
    significant = not (lo <= 0.0 <= hi)
    return CapabilityResult(
        metric=metric, n=len(items), base=float(np.mean(base)), tuned=float(np.mean(tuned)), delta=delta, ci=[lo, hi],
        confidence=confidence, significant=significant, min_detectable_delta=min_detectable_delta(len(items), confidence),
        base_scores=[float(x) for x in base], tuned_scores=[float(x) for x in tuned],
        base_generated=base_gen, tuned_generated=tuned_gen,
    )
