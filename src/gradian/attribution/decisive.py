"""Where the fine-tune's answer decides the item: the token an own-words query is differentiated from.

An own-words query differentiates the fine-tune's answer from the token where it stops being the other model's
answer. When both answer in the same style ("The capital of Japan is Tokyo." / "... is Osaka.") that departure is
the decision itself. When they do not (Gemma-3-270M base: "Warsaw" / the fine-tune: "The capital of Poland is
Krakow."), the first tokens that differ are style the fine-tune taught every row ("The capital of Poland is"), and a
query over them matches every training row as much as the cause.

So the decisive token is measured with the metric itself: the shortest prefix of the fine-tune's answer from which
the other model, continuing greedily, ends with the same outcome as the fine-tune (fails where the fine-tune fails,
passes where it passes). Before it, the other model still recovers its own outcome ("The capital of Poland is" ->
" Warsaw."); from it on it cannot ("... is Krakow" -> "."). Found by bisection over the prefixes, all items in one
batched generation per round (about log2 of the answer's length rounds); where the other model's continuation of the
whole answer does not end with the fine-tune's outcome, the departure token is kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..capability.evaluate import _stop_ids, answer_text, generate_from
from ..setup.tokenize import eval_answer_example, tokenize_example


def answer_rows(tokenizer, item, q, *, chat: bool, max_len: int):
    """(fine-tune's answer row, other model's answer row) of an own-words query."""
    tuned = q.contrast if q.target_source == "base" else q.target
    other = q.target if q.target_source == "base" else q.contrast
    return (tokenize_example(tokenizer, eval_answer_example(item, tuned, chat), max_len),
            tokenize_example(tokenizer, eval_answer_example(item, other, chat), max_len))


def departure(t, o) -> int:
    """Index of the first token where two rows differ (their common prefix length)."""
    k = 0
    for a, b in zip(t.input_ids, o.input_ids):
        if a != b:
            break
        k += 1
    return k


def content_positions(t, stop_ids: set[int]) -> list[int]:
    """The supervised positions of a row's answer that are its text: before its first stop or special token (the
    end-of-turn, EOS and what a template puts after them are learned from every row alike)."""
    out = []
    for i, s in enumerate(t.supervised):
        if not s:
            continue
        if t.input_ids[i] in stop_ids:
            break
        out.append(i)
    return out


def stop_tokens(tokenizer, model=None, chat: bool = True) -> set[int]:
    """Where an answer's text ends: the generation stop tokens and every special token."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if model is not None:
        ids |= set(_stop_ids(tokenizer, model, chat))
    elif tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def decisive_starts(model, tokenizer, items: Sequence, qitems: Sequence, metric, *, chat: bool, max_len: int,
                    max_new_tokens: int, batch_size: int, one_line: bool, other_is_base: bool = True) -> list[int]:
    """For each query (own_words ones; others get -1), the row index its span starts at: the decisive token of the
    fine-tune's answer (module docstring). `model` answers as the other model when `other_is_base` (the adapter
    disabled) — the base, for regressions and improvements alike."""
    import contextlib

    by_pos = {it.position: it for it in items}
    stops = stop_tokens(tokenizer, model, chat)
    jobs = {}
    for j, q in enumerate(qitems):
        if not q.own_words:
            continue
        it = by_pos[q.item]
        t, o = answer_rows(tokenizer, it, q, chat=chat, max_len=max_len)
        k = departure(t, o)
        content = [i for i in content_positions(t, stops) if i >= k]
        want = q.target_source == "base"  # the fine-tune's outcome: fails (regression) or passes (improvement)
        jobs[j] = {"item": it, "row": t, "k": k, "content": content, "fails": want}
    out = [-1] * len(qitems)
    for j, jb in jobs.items():
        out[j] = jb["k"]
    if not jobs:
        return out
    first_answer = {j: next((i for i, s in enumerate(jb["row"].supervised) if s), jb["k"]) for j, jb in jobs.items()}

    def outcome(j: int, m: int, cont: list[int]) -> bool:
        """Whether the other model's answer from the first m content tokens of the fine-tune's ends as the fine-tune's
        does (fails for a regression, passes for an improvement)."""
        jb = jobs[j]
        cut = jb["content"][m - 1] + 1
        ans = list(jb["row"].input_ids[first_answer[j] : cut]) + list(cont)
        passed = metric.score(jb["item"], answer_text(tokenizer, ans, one_line=one_line)) >= 0.5
        return (not passed) if jb["fails"] else passed

    def run(probes: dict[int, int]) -> dict[int, bool]:
        keys = sorted(probes)
        prefixes = [jobs[j]["row"].input_ids[: jobs[j]["content"][probes[j] - 1] + 1] for j in keys]
        ctx = model.disable_adapter() if other_is_base else contextlib.nullcontext()
        with ctx:
            conts = generate_from(model, tokenizer, prefixes, chat=chat, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, desc="decisive tokens")
        return {j: outcome(j, probes[j], c) for j, c in zip(keys, conts)}

    live = {j: jb for j, jb in jobs.items() if jb["content"]}
    # the whole answer must end as the fine-tune's, and the departure token alone may already decide
    ends = run({j: len(jb["content"]) for j, jb in live.items()})
    live = {j: jb for j, jb in live.items() if ends[j]}
    first = run({j: 1 for j, jb in live.items() if len(jb["content"]) > 1})
    lo = {j: 1 for j in live if j in first and not first[j]}  # outcome not yet reached with lo tokens
    hi = {j: len(live[j]["content"]) for j in lo}  # reached with hi tokens
    for j in live:
        if j not in lo:
            out[j] = live[j]["content"][0]
    while lo:
        probes = {j: (lo[j] + hi[j]) // 2 for j in lo if hi[j] - lo[j] > 1}
        for j in [j for j in lo if hi[j] - lo[j] <= 1]:
            out[j] = live[j]["content"][hi[j] - 1]
            del lo[j], hi[j]
        if not probes:
            break
        res = run(probes)
        for j, m in probes.items():
            if res[j]:
                hi[j] = m
            else:
                lo[j] = m
    return out


def with_starts(qitems: Sequence, starts: Sequence[int], positions: Sequence[tuple] = ()) -> list:
    """The queries with their decisive token (`QueryItem.span_start`) and decision positions (`QueryItem.span`)."""
    positions = list(positions) or [()] * len(qitems)
    return [replace(q, span_start=int(s), span=tuple(p)) if s >= 0 else q
            for q, s, p in zip(qitems, starts, positions)]


def decision_positions(model, tokenizer, items: Sequence, qitems: Sequence, starts: Sequence[int], *, chat: bool,
                       max_len: int, batch_size: int) -> list[tuple[int, ...]]:
    """For each own-words query, the positions of the fine-tune's answer where it decided something the base would
    not have: from the departure to the decisive token (inclusive), the tokens that are not the base's own greedy
    choice after the same prefix. "I'm sorry, but ..." after a cooking question: "I" (the base starts "To ...")
    and " sorry" (after "I'm" the base goes on "happy to help"), not "'m"; Gemma's "The capital of Poland is Krakow":
    " The" and " Krakow", not the style in between that the base would write itself. Others: ()."""
    import torch

    from ..setup.batches import batches

    by_pos = {it.position: it for it in items}
    rows, spans = {}, {}
    for j, (q, k_dec) in enumerate(zip(qitems, starts)):
        if not q.own_words or k_dec < 0:
            continue
        t, o = answer_rows(tokenizer, by_pos[q.item], q, chat=chat, max_len=max_len)
        k = min(departure(t, o), k_dec)
        rows[j], spans[j] = t, (k, k_dec)
    out: list[tuple[int, ...]] = [()] * len(qitems)
    if not rows:
        return out
    keys = sorted(rows)
    toks = [rows[j] for j in keys]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    with torch.no_grad(), model.disable_adapter():
        for part, ids, attn, _ in batches(toks, range(len(toks)), batch_size, pad, device):
            pred = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.argmax(-1).cpu()
            for b, r in enumerate(part):
                j = keys[r]
                t, (a, d) = rows[j], spans[j]
                keep = [p for p in range(a, d) if t.supervised[p] and int(pred[b, p - 1]) != t.input_ids[p]]
                out[j] = tuple(keep + [d])
    return out
