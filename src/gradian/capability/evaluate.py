"""The capability delta: base vs fine-tuned on the eval set, per-item metric, paired bootstrap interval."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Optional, Sequence

import numpy as np
import torch

from .data import EvalItem, eval_answer_example, eval_prompt_text, tokenize_example
from .loss import per_example_loss
from .progress import progress_bar


# ---------------------------------------------------------------- metrics (pure)


def normalize_answer(s: str) -> str:
    """exact_match normalisation: surrounding white space and one trailing period."""
    s = s.strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    return s


def exact_match(generated: str, expected: str) -> float:
    return float(normalize_answer(generated) == normalize_answer(expected))


def contains(generated: str, expected: str) -> float:
    return float(expected.strip().lower() in generated.lower())


METRICS = {"exact_match": exact_match, "contains": contains}


# ---------------------------------------------------------------- bootstrap (pure)


def paired_bootstrap(
    base: Sequence[float], tuned: Sequence[float], *, samples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Delta (tuned - base) of the means and its paired percentile-bootstrap interval."""
    d = np.asarray(tuned, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    n = d.size
    if n == 0:
        return 0.0, 0.0, 0.0
    delta = float(d.mean())
    if np.all(d == d[0]):
        # Every resample has the same mean; the interval is that point, never NaN.
        return delta, delta, delta
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    step = max(1, 2_000_000 // n)  # resample in blocks so a large eval set does not allocate samples x n at once
    for s in range(0, samples, step):
        m = min(step, samples - s)
        idx = rng.integers(0, n, size=(m, n))
        means[s : s + m] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return delta, float(lo), float(hi)


def min_detectable_delta(n: int, confidence: float = 0.95, power: float = 0.8, sd: float = 0.5) -> float:
    """Smallest |delta| a paired test on n items detects with this power, for per-item differences of spread sd.

    sd = 0.5 is the spread of a 50/50 binary outcome, the conservative case for exact_match and contains.
    """
    if n <= 0:
        return float("inf")
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2) + NormalDist().inv_cdf(power)
    return float(z * sd / np.sqrt(n))


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
    out: list[str] = []
    with progress_bar(desc, total=len(items)) as bar:
        for s in range(0, len(items), batch_size):
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
                out.append(tokenizer.decode(row, skip_special_tokens=True).strip())
            bar.advance(len(chunk))
    return out


@torch.no_grad()
def answer_logprobs(model, tokenizer, items: Sequence[EvalItem], answers: Sequence[str], *, chat: bool, max_len: int,
                    batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probability of each answer after its prompt, and its number of tokens."""
    toks = [tokenize_example(tokenizer, eval_answer_example(it, a, chat), max_len) for it, a in zip(items, answers)]
    from .data import collate

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lp, n = [], []
    for s in range(0, len(toks), batch_size):
        ids, attn, sup = collate(toks[s : s + batch_size], pad)
        losses = per_example_loss(model, ids.to(device), attn.to(device), sup.to(device))
        lp.extend((-losses).tolist())
        n.extend(t.n_supervised for t in toks[s : s + batch_size])
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


def measure_capability(model, tokenizer, items: Sequence[EvalItem], *, metric: str, chat: bool, max_new_tokens: int,
                       batch_size: int, max_len: int, samples: int, confidence: float, seed: int) -> CapabilityResult:
    """Base (adapter disabled) vs tuned, per item."""
    with model.disable_adapter():
        base_gen = generate_answers(model, tokenizer, items, chat=chat, max_new_tokens=max_new_tokens,
                                    batch_size=batch_size, desc="base answers")
    tuned_gen = generate_answers(model, tokenizer, items, chat=chat, max_new_tokens=max_new_tokens,
                                 batch_size=batch_size, desc="tuned answers")
    expected = [it.answer for it in items]
    if metric == "loglik":
        # Per-token probability of the expected answer (geometric mean): a fraction in [0, 1] like the others.
        with model.disable_adapter():
            lp_b, n = answer_logprobs(model, tokenizer, items, expected, chat=chat, max_len=max_len, batch_size=batch_size)
        lp_t, _ = answer_logprobs(model, tokenizer, items, expected, chat=chat, max_len=max_len, batch_size=batch_size)
        base = list(np.exp(lp_b / np.maximum(n, 1)))
        tuned = list(np.exp(lp_t / np.maximum(n, 1)))
    else:
        fn = METRICS[metric]
        base = [fn(g, e) for g, e in zip(base_gen, expected)]
        tuned = [fn(g, e) for g, e in zip(tuned_gen, expected)]
    delta, lo, hi = paired_bootstrap(base, tuned, samples=samples, confidence=confidence, seed=seed)
    significant = not (lo <= 0.0 <= hi)
    return CapabilityResult(
        metric=metric, n=len(items), base=float(np.mean(base)), tuned=float(np.mean(tuned)), delta=delta, ci=[lo, hi],
        confidence=confidence, significant=significant, min_detectable_delta=min_detectable_delta(len(items), confidence),
        base_scores=[float(x) for x in base], tuned_scores=[float(x) for x in tuned],
        base_generated=base_gen, tuned_generated=tuned_gen,
    )
