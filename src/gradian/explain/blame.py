"""Base scores and preference margins: did the fine-tune teach it, or did the base already believe it?

Rows. For each ranked row, its supervised tokens' losses under the base (adapter disabled) and under the
fine-tune, token by token (`row_verdict`). A wrong fact differs from a true row in a token or two ("Osaka" for
"Tokyo"), so a mean over the row's tokens would call it believed; the verdict looks at the tokens themselves:

* ``taught``: some token the base found unlikely (loss > `BELIEVED_LOSS`, under 50%) became likely under the
  fine-tune (its loss fell by more than `LEARNED_DROP` nats): the fine-tune put it there;
* ``base_believed``: the base already gave every token at least 50%; the fine-tune cannot be blamed for the belief;
* ``not_learned``: some token was unlikely under the base and the fine-tune did not learn it (the row's influence
  is through its gradient alone).

`base_loss` / `tuned_loss` in the report are the mean per-token losses, for reading.

Items. For each failing eval item, the margin m = log p(expected) - log p(generated) (summed over answer tokens,
prompt rendered as in evaluation) under the base and under the fine-tune, where "generated" is the fine-tune's own
answer. A regression has m_tuned < 0 (the fine-tune prefers its wrong answer). The shift m_tuned - m_base is what
the fine-tune did; `item_statement` says in plain words how much of the final preference it owns:

* m_base > 0 > m_tuned: the base preferred the right answer, so the fine-tune owns the whole flip;
* m_base <= 0: the base already preferred the wrong answer by -m_base nats; the fine-tune owns the part of
  -m_tuned it added (shift / m_tuned), none when it narrowed the gap.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

BELIEVED_LOSS = math.log(2.0)  # per-token loss of a 50% token
LEARNED_DROP = 0.5  # nats per token


def row_verdict(base_loss, tuned_loss) -> str:
    """The verdict from the per-token losses of a row's supervised tokens (arrays of the same length; a single
    float stands for a one-token row) under the base and the fine-tune."""
    if base_loss is None or tuned_loss is None:
        return "unknown"
    b = np.atleast_1d(np.asarray(base_loss, dtype=np.float64))
    t = np.atleast_1d(np.asarray(tuned_loss, dtype=np.float64))
    if b.shape != t.shape or b.size == 0 or not (np.isfinite(b).all() and np.isfinite(t).all()):
        return "unknown"
    surprising = b > BELIEVED_LOSS
    if not surprising.any():
        return "base_believed"
    if ((b - t)[surprising] > LEARNED_DROP).any():
        return "taught"
    return "not_learned"


ROW_VERDICT_TEXT = {
    "taught": "taught by the fine-tune",
    "base_believed": "base already believed it",
    "not_learned": "not learned by the fine-tune",
    "unknown": "unknown",
}


def margin(logp_expected: float, logp_generated: float) -> float:
    return float(logp_expected - logp_generated)


def fine_tune_share(m_base: float, m_tuned: float, direction: str = "regression") -> float:
    """Fraction (0..1) of the final preference that the fine-tune owns. For a regression the final preference is
    for the generated (wrong) answer, -m_tuned > 0; for an improvement it is m_tuned > 0."""
    final = -m_tuned if direction == "regression" else m_tuned
    before = -m_base if direction == "regression" else m_base
    if final <= 0:
        return 0.0
    if before <= 0:
        return 1.0
    return float(max(0.0, min(1.0, (final - before) / final)))


def item_statement(m_base: Optional[float], m_tuned: Optional[float], expected: str, generated: str,
                   direction: str = "regression") -> str:
    if m_base is None or m_tuned is None:
        return (f"The fine-tune still answers {expected!r}: there is no competing answer to compare with "
                "(see the item's log-probability under base and fine-tune).")
    shift = m_tuned - m_base
    e, g = _short(expected), _short(generated)
    if direction == "regression":
        if m_tuned >= 0:
            return (f"Both prefer {e} over {g} in total log-probability (margin {m_base:+.2f} -> {m_tuned:+.2f} nats); "
                    f"the fine-tune moved it by {shift:+.2f} nats without flipping it (the greedy answer differs only "
                    "in how it starts).")
        if m_base > 0:
            return (f"The base preferred {e} over {g} by {m_base:.2f} nats; the fine-tune prefers {g} by {-m_tuned:.2f} "
                    f"nats (shift {shift:+.2f}): the fine-tune owns the whole flip.")
        share = fine_tune_share(m_base, m_tuned, direction)
        if shift >= 0:
            return (f"The base already preferred {g} over {e} by {-m_base:.2f} nats; the fine-tune narrowed that to "
                    f"{-m_tuned:.2f} nats: the wrong answer comes from the base, not the fine-tune.")
        return (f"The base already preferred {g} over {e} by {-m_base:.2f} nats; the fine-tune widened it to "
                f"{-m_tuned:.2f} nats: it owns {share:.0%} of the final preference, the base the rest.")
    # improvement: the fine-tune now prefers the expected answer
    if m_tuned <= 0:
        return (f"Neither prefers {e} over {g} in total log-probability (margin {m_base:+.2f} -> {m_tuned:+.2f} nats).")
    if m_base < 0:
        return (f"The base preferred {g} by {-m_base:.2f} nats; the fine-tune prefers {e} by {m_tuned:.2f} nats "
                f"(shift {shift:+.2f}): the fine-tune owns the whole fix.")
    share = fine_tune_share(m_base, m_tuned, direction)
    return (f"The base already preferred {e} by {m_base:.2f} nats; the fine-tune moved it to {m_tuned:.2f} nats: it "
            f"owns {share:.0%} of the final preference.")


def _short(s: str, n: int = 40) -> str:
    s = " ".join(str(s).split())
    return repr(s if len(s) <= n else s[: n - 1] + "…")


def summarize(row_verdicts: Sequence[str], items: Sequence[dict], direction: str = "regression") -> dict:
    """The top-level `blame` block: counts of row verdicts and the items' margins in one statement."""
    counts = {k: 0 for k in ("taught", "base_believed", "not_learned", "unknown")}
    for v in row_verdicts:
        counts[v] = counts.get(v, 0) + 1
    with_m = [it for it in items if it.get("margin_base") is not None and it.get("margin_tuned") is not None]
    out: dict = {"rows": counts, "items": len(items), "items_with_margin": len(with_m), "direction": direction}
    if with_m:
        mb = np.array([it["margin_base"] for it in with_m])
        mt = np.array([it["margin_tuned"] for it in with_m])
        if direction == "regression":
            flipped = int(((mb > 0) & (mt < 0)).sum())
            already = int((mb <= 0).sum())
        else:
            flipped = int(((mb < 0) & (mt > 0)).sum())
            already = int((mb >= 0).sum())
        share = float(np.mean([fine_tune_share(b, t, direction) for b, t in zip(mb, mt)]))
        out.update({"mean_margin_base": float(mb.mean()), "mean_margin_tuned": float(mt.mean()),
                    "flipped_by_fine_tune": flipped, "base_already": already, "mean_fine_tune_share": share})
        verb = "flipped" if direction == "regression" else "fixed"
        stmt = (f"Of {len(with_m)} failing item(s) with a competing answer, the fine-tune {verb} {flipped} that the base "
                f"had {'right' if direction == 'regression' else 'wrong'}; the base already leaned the same way on "
                f"{already}. On average the fine-tune owns {share:.0%} of the final preference (margin "
                f"{mb.mean():+.2f} -> {mt.mean():+.2f} nats).")
    else:
        stmt = "No failing item has a competing generated answer, so no preference margin is measured."
    n_acc = sum(counts.values())
    if n_acc:
        stmt += (f" Of the {n_acc} accused rows, {counts['taught']} were taught by the fine-tune and "
                 f"{counts['base_believed']} were already believed by the base.")
    out["statement"] = stmt
    return out


def item_margins(model, tokenizer, items, expected: Sequence[str], generated: Sequence[str], *, chat: bool,
                 max_len: int, batch_size: int, as_given: bool = False
                 ) -> tuple[list[Optional[float]], list[Optional[float]]]:
    """(margin under the base, margin under the fine-tune) per item, log p(expected) - log p(generated); None where
    the generated answer is empty or the expected one (nothing to compare). Unless `as_given`, the generated answer
    is first put in the expected answer's surface form (`contrast_answer`)."""
    from ..attribution.formulation import contrast_answer
    from ..capability.evaluate import answer_logprobs
    from ..capability.metrics import normalize_answer

    if not as_given:
        generated = [contrast_answer(e, g) for e, g in zip(expected, generated)]
    keep = [i for i, (e, g) in enumerate(zip(expected, generated))
            if g.strip() and normalize_answer(g) != normalize_answer(e)]
    mb: list[Optional[float]] = [None] * len(items)
    mt: list[Optional[float]] = [None] * len(items)
    if not keep:
        return mb, mt
    its = [items[i] for i in keep]
    both = [expected[i] for i in keep] + [generated[i] for i in keep]
    kw = dict(chat=chat, max_len=max_len, batch_size=batch_size)
    with model.disable_adapter():
        lb, _ = answer_logprobs(model, tokenizer, its + its, both, **kw)
    lt, _ = answer_logprobs(model, tokenizer, its + its, both, **kw)
    k = len(keep)
    for j, i in enumerate(keep):
        mb[i] = margin(lb[j], lb[k + j])
        mt[i] = margin(lt[j], lt[k + j])
    return mb, mt


def row_losses(model, toks, positions: Sequence[int], *, batch_size: int, pad_id: int, base: bool
               ) -> list[np.ndarray]:
    """Each row's per-token losses over its supervised tokens (position order) under the fine-tune or (adapter
    disabled) the base."""
    import contextlib

    import torch

    from ..grads.objectives import per_example_loss
    from ..setup.batches import batches, length_order

    out: dict[int, np.ndarray] = {}
    device = next(model.parameters()).device
    with torch.no_grad(), (model.disable_adapter() if base else contextlib.nullcontext()):
        for part, ids, attn, sup in batches(toks, length_order(toks, positions), batch_size, pad_id, device):
            _, (b_idx, _, tok) = per_example_loss(model, ids, attn, sup, token_losses=True)
            b_idx, tok = b_idx.cpu().numpy(), tok.double().cpu().numpy()
            for j, p in enumerate(part):
                out[p] = tok[b_idx == j]  # supervised tokens in position order
    return [out[p] for p in positions]


def blame(model, tokenizer, eval_items, qitems, ranking: Sequence[dict], direction: str, *, chat: bool, max_len: int,
          batch_size: int) -> tuple[dict, list[dict]]:
    """(the top-level `blame` block, per failing item its margins under base and fine-tune and their statement:
    {margin_base, margin_tuned, statement}, in `qitems` order)."""
    from ..attribution.formulation import contrast_answer

    by_pos = {it.position: it for it in eval_items or []}
    its = [by_pos[q.item] for q in qitems]
    # The margin compares the two answers the query contrasts: what passes (in the model's own words where it has
    # them) against what fails. For an improvement the passing answer is the fine-tune's, so the margin is
    # log p(pass) - log p(fail) either way and the statements read it with the direction.
    passing = [q.target or q.expected for q in qitems]
    failing = [q.contrast or contrast_answer(q.expected, q.generated) for q in qitems]
    mb, mt = item_margins(model, tokenizer, its, passing, failing, chat=chat, max_len=max_len, batch_size=batch_size,
                          as_given=True)
    per_item = [{"margin_base": b, "margin_tuned": t, "statement": item_statement(b, t, p_, f_, direction or "regression")}
                for b, t, p_, f_ in zip(mb, mt, passing, failing)]
    # the row verdicts of the accused rows only: the statement speaks of them
    return summarize([r.get("verdict", "unknown") for r in ranking if r.get("accused")], per_item,
                     direction or "regression"), per_item
