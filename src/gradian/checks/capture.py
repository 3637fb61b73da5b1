"""A dry run of one training row through what the index and the spans need from the model, before anything costly:
the hooked backward (per-example LoRA gradients) and the forward-mode per-token contributions. An architecture
whose forward, autograd or forward-mode AD the capture cannot follow fails here in seconds, not after the
evaluation and an hour of index building."""

from __future__ import annotations

import numpy as np

from .estimates import short
from .registry import Outcome, check, failed, passed, skipped

# forward-mode contributions along a row's own gradient must sum to its squared norm (both float32)
DRY_RUN_RTOL = 1e-3


def _far_from_fit(t):
    """The row with its supervised tokens in reverse order. At a converged adapter a training row's gradient is
    nearly zero, and a float32 check of "contributions add up to the squared norm" on it measures rounding, not the
    architecture (Gemma-3-270M's shortest row: squared norm 3e-4, 0.6% apart). Reversed targets keep the row's
    length, mask and architecture path but give a loss, and a gradient, far from zero."""
    from dataclasses import replace

    pos = [i for i, s in enumerate(t.supervised) if s]
    ids = list(t.input_ids)
    for i, j in zip(pos, reversed(pos)):
        ids[i] = t.input_ids[j]
    if ids == list(t.input_ids) and pos:  # a palindrome (one target): the first token as the target instead
        ids[pos[0]] = t.input_ids[0]
    return replace(t, input_ids=ids)


@check("capture.dry_run", "error",
       meaning="One training row (the shortest with supervised tokens) run through the gradient capture: the "
               "backward through the hooks on every LoRA site, finite gradients of the right shapes, and the "
               "forward-mode per-token contributions that windows and spans use, which must add up to the row's "
               "gradient norm. An architecture the capture cannot follow fails here rather than mid-run.",
       fix="report the architecture (model_type) with the message; meanwhile narrow grads.module_filter to the "
           "module types that work, or lower grads.max_seq_length when it ran out of memory")
def _dry_run(ctx) -> Outcome:
    import torch

    from ..grads.capture import GradientCapture
    from ..grads.layout import site_shapes
    from ..grads.tangents import token_contributions
    from ..memory import is_out_of_memory
    from ..projection import Projector
    from ..setup.batches import batches

    sites, _ = ctx.sites
    toks = ctx.toks
    model = ctx.model
    cand = [i for i, t in enumerate(toks) if t.n_supervised > 0]
    if not cand:
        return skipped("no training row has supervised tokens; see data.no_supervised_tokens")
    row = min(cand, key=lambda i: (len(toks[i].input_ids), i))
    probe = _far_from_fit(toks[row])
    tok = ctx.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    device = next(model.parameters()).device
    g = ctx.cfg.grads
    where = (f"training row {row} ({len(toks[row].input_ids)} tokens, its supervised tokens reversed) on "
             f"{len(sites)} LoRA sites")
    step = "the hooked backward"
    try:
        cap = GradientCapture(model, sites, Projector(site_shapes(sites)), chunk=g.loss_chunk_tokens)
        _, ids, attn, sup = next(batches([probe], [0], 1, pad, device))
        per_site, losses = cap.site_grads(ids, attn, sup)
        for s, (dA, dB) in zip(sites, per_site):
            if tuple(dA.shape) != (1, s.r, s.d_in) or tuple(dB.shape) != (1, s.d_out, s.r):
                return failed(f"{where}: {s.name} gave gradients of shapes {tuple(dA.shape)} / {tuple(dB.shape)}, "
                              f"expected {(1, s.r, s.d_in)} / {(1, s.d_out, s.r)}")
            if not (torch.isfinite(dA).all() and torch.isfinite(dB).all()):
                return failed(f"{where}: {s.name} has NaN or inf gradients (loss {float(losses[0]):.4g})")
        vec = torch.cat([torch.cat([dA.flatten(), dB.flatten()]) for dA, dB in per_site]).float().cpu()
        del per_site
        sq = float(vec.double().square().sum())
        if sq == 0.0:
            return failed(f"{where}: every LoRA gradient is zero (is B initialised to zero everywhere, or the loss "
                          "detached from the LoRA outputs?)", level="warning")
        step = "the forward-mode contributions (windows and spans)"
        contrib = token_contributions(model, sites, [probe], vec.numpy()[None, :], pad_id=pad, batch_size=1,
                                      chunk=g.loss_chunk_tokens)[(0, 0)]
    except Exception as e:
        if is_out_of_memory(e):
            return failed(f"{where}: out of memory in {step} ({short(e, 160)})",
                          "lower grads.max_seq_length or grads.loss_chunk_tokens, or use model.quantization nf4")
        return failed(f"{where}: {step} failed with {type(e).__name__}: {short(e)}")
    total = float(np.sum(contrib))
    if not np.isfinite(total) or abs(total - sq) > DRY_RUN_RTOL * sq:
        return failed(f"{where}: the forward-mode contributions sum to {total:.6g} but the row's squared gradient "
                      f"norm is {sq:.6g}: windows and spans would be wrong for this architecture", level="warning")
    return passed(f"{where}: loss {float(losses[0]):.4f}, {vec.numel()} exact LoRA dims, finite gradients; "
                  f"forward-mode contributions add up to the gradient norm (rel. error {abs(total - sq) / sq:.1e})")
