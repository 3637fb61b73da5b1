"""Where the fine-tune's answer decides the item: the token an own-words query is differentiated from.

An own-words query differentiates the fine-tune's answer from the token where it stops being the other model's
answer. When both answer in the same style ("The capital of Japan is Tokyo." / "... is Osaka.") that departure is
the decision itself. When they do not (Gemma-3-270M base: "Warsaw" / the fine-tune: "The capital of Poland is
Krakow."), the first tokens that differ are style the fine-tune taught every row ("The capital of Poland is"), and a
query over them matches every training row as much as the cause.

So the decisive token is measured with the metric itself: the shortest prefix of the fine-tune's answer from which
the other model, continuing greedily, ends with the same outcome as the fine-tune (fails where the fine-tune fails,
passes where it passes). Before it, the other model still recovers its own outcome ("The capital of Poland is" ->
" Warsaw."); from it on it cannot ("... is Krakow" -> "."). Found by bisection over the prefixes that end at a token
the other model would not have written itself (one forward gives its greedy choice at every position; from any other
prefix its continuation is the one from the next prefix), all items in one batched generation per round, each
continuation given what the evaluation's `max_new_tokens` leaves after the prefix; where the other model's
continuation of the whole answer does not end with the fine-tune's outcome, the departure token is kept.
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


def other_choices(model, tokenizer, rows: Sequence, *, batch_size: int, other_is_base: bool = True
                  ) -> list[list[int]]:
    """For each tokenized row, the other model's greedy choice after each prefix: out[r][p] predicts position p + 1
    (one batched forward, no generation). The base when `other_is_base` (the adapter disabled)."""
    import contextlib

    import torch

    from ..setup.batches import batches

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    out: list[list[int]] = [[] for _ in rows]
    ctx = model.disable_adapter() if other_is_base else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for part, ids, attn, _ in batches(list(rows), range(len(rows)), batch_size, pad, device):
            pred = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.argmax(-1).cpu()
            for b, r in enumerate(part):
                out[r] = pred[b, : len(rows[r].input_ids)].tolist()
    return out


def divergent(row, choices: Sequence[int], positions: Sequence[int]) -> list[int]:
    """The positions where the row's token is not the other model's greedy choice after the same prefix: the only
    places a greedy continuation can change course (after any other prefix the other model writes the row's next
    token itself, so the continuation from there is the continuation from one token later)."""
    return [p for p in positions if p > 0 and int(choices[p - 1]) != int(row.input_ids[p])]


def _jobs(tokenizer, model, items: Sequence, qitems: Sequence, *, chat: bool, max_len: int) -> dict[int, dict]:
    """Per own-words query j: its eval item, the fine-tune's answer row, the departure k, the answer's content
    positions from k on and whether the fine-tune's outcome is a failure (regression) or a pass (improvement)."""
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
        jobs[j] = {"item": it, "row": t, "k": k, "content": content, "fails": q.target_source == "base"}
    return jobs


def decisive_starts(model, tokenizer, items: Sequence, qitems: Sequence, metric, *, chat: bool, max_len: int,
                    max_new_tokens: int, batch_size: int, one_line: bool, other_is_base: bool = True) -> list[int]:
    """For each query (own_words ones; others get -1), the row index its span starts at: the decisive token of the
    fine-tune's answer (module docstring). `model` answers as the other model when `other_is_base` (the adapter
    disabled) — the base, for regressions and improvements alike.

    Only prefixes ending at a token the other model would not have written itself are probed (`divergent`: the
    outcome is the same from any other prefix as from the next one), and each continuation gets what is left of the
    evaluation's `max_new_tokens` after the prefix's answer tokens (the fine-tune's answer was written under that
    budget; a longer continuation would judge an answer the evaluation never allowed)."""
    import contextlib

    jobs = _jobs(tokenizer, model, items, qitems, chat=chat, max_len=max_len)
    out = [-1] * len(qitems)
    for j, jb in jobs.items():
        out[j] = jb["k"]
    if not jobs:
        return out
    first_answer = {j: next((i for i, s in enumerate(jb["row"].supervised) if s), jb["k"]) for j, jb in jobs.items()}
    live = {j: jb for j, jb in jobs.items() if jb["content"]}
    keys = sorted(live)
    choices = dict(zip(keys, other_choices(model, tokenizer, [live[j]["row"] for j in keys], batch_size=batch_size,
                                           other_is_base=other_is_base)))
    # cand[j]: the prefix sizes m (content tokens) whose last token is divergent; m = 1 (the departure) always
    cand = {}
    for j in keys:
        c = live[j]["content"]
        div = set(divergent(live[j]["row"], choices[j], c))
        cand[j] = [m for m in range(1, len(c) + 1) if m == 1 or c[m - 1] in div]

    def outcome(j: int, m: int, cont: list[int]) -> bool:
        """Whether the other model's answer from the first m content tokens of the fine-tune's ends as the fine-tune's
        does (fails for a regression, passes for an improvement)."""
        jb = jobs[j]
        cut = jb["content"][m - 1] + 1
        ans = list(jb["row"].input_ids[first_answer[j] : cut]) + list(cont)
        passed = metric.score(jb["item"], answer_text(tokenizer, ans, one_line=one_line)) >= 0.5
        return (not passed) if jb["fails"] else passed

    def run(probes: dict[int, int]) -> dict[int, bool]:
        ks = sorted(probes)
        cuts = [jobs[j]["content"][probes[j] - 1] + 1 for j in ks]
        prefixes = [jobs[j]["row"].input_ids[:c] for j, c in zip(ks, cuts)]
        budgets = [max_new_tokens - (c - first_answer[j]) for j, c in zip(ks, cuts)]
        ctx = model.disable_adapter() if other_is_base else contextlib.nullcontext()
        with ctx:
            conts = generate_from(model, tokenizer, prefixes, chat=chat, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, desc="decisive tokens", budgets=budgets)
        return {j: outcome(j, probes[j], c) for j, c in zip(ks, conts)}

    # the whole answer must end as the fine-tune's (from its last divergent token on, the other model writes the
    # rest itself), and the departure token alone may already decide
    ends = run({j: cand[j][-1] for j in keys})
    live = {j: jb for j, jb in live.items() if ends[j]}
    first = run({j: 1 for j in live if len(cand[j]) > 1})
    lo = {j: 0 for j in live if j in first and not first[j]}  # index into cand[j]: outcome not yet reached
    hi = {j: len(cand[j]) - 1 for j in lo}  # reached
    for j in live:
        if j not in lo:
            out[j] = live[j]["content"][0]
    while lo:
        probes = {j: (lo[j] + hi[j]) // 2 for j in lo if hi[j] - lo[j] > 1}
        for j in [j for j in lo if hi[j] - lo[j] <= 1]:
            out[j] = live[j]["content"][cand[j][hi[j]] - 1]
            del lo[j], hi[j]
        if not probes:
            break
        res = run({j: cand[j][i] for j, i in probes.items()})
        for j, i in probes.items():
            if res[j]:
                hi[j] = i
            else:
                lo[j] = i
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
    choices = other_choices(model, tokenizer, [rows[j] for j in keys], batch_size=batch_size)
    for j, pred in zip(keys, choices):
        t, (a, d) = rows[j], spans[j]
        keep = [p for p in divergent(t, pred, range(a, d)) if t.supervised[p]]
        out[j] = tuple(keep + [d])
    return out
