"""Per-example supervised loss from the model's own outputs, with the fp32 upcast done in chunks.

The loss never goes through `labels=`: HF models average over tokens and over the batch, while attribution needs
each example's *sum* over its supervised tokens (the token-weighted objective HF training optimises) and gradients
that stay exact. Only supervised positions are projected to the vocabulary and upcast to fp32, chunk by chunk, and
the backward pass recomputes each chunk instead of keeping B x T x V fp32 activations alive.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .lm_head import backbone_hidden, chunked_head_loss, chunked_logits_loss, head_logits, head_of


def supervised_positions(supervised: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(batch index, predicting position, target position) for each supervised target token.

    Token t is predicted by the logits at t-1, so a target at position 0 can never be supervised.
    """
    sup = supervised.clone()
    sup[:, 0] = False
    b, t = sup.nonzero(as_tuple=True)
    return b, t - 1, t


def naive_per_example_loss(logits: Tensor, input_ids: Tensor, supervised: Tensor) -> Tensor:
    """Reference: full fp32 upcast of B x T x V logits. Tests and the memory benchmark compare against it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    tgt = input_ids[:, 1:]
    tok = -logp[:, :-1].gather(2, tgt[..., None]).squeeze(-1)
    mask = supervised[:, 1:].to(tok.dtype)
    return (tok * mask).sum(1)


def per_example_loss(
    model, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor, *, chunk: int = 1024, token_losses: bool = False
):
    """Sum over each example's supervised tokens of -log p(token). Returns [B] (and per-token losses if asked).

    The backbone runs once; the LM head is applied only at supervised positions, in chunks.
    """
    b_idx, pred_pos, tgt_pos = supervised_positions(supervised)
    targets = input_ids[b_idx, tgt_pos]
    head, softcap, exact = head_of(model)
    if exact:
        hidden = backbone_hidden(model, input_ids, attention_mask)
        tok = chunked_head_loss(hidden[b_idx, pred_pos], head.weight, head.bias, targets, chunk=chunk, softcap=softcap)
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        tok = chunked_logits_loss(out.logits[b_idx, pred_pos], targets, chunk=chunk)
    per_ex = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=tok.device).index_add(0, b_idx, tok)
    if token_losses:
        return per_ex, (b_idx, tgt_pos, tok)
    return per_ex


# ------------------------------------------------------------------------------------------------ margin


def _answer_logits(model, input_ids, attention_mask, supervised):
    """(batch index, target ids, fp32 logits [n, V]) at every supervised answer token."""
    b_idx, pred_pos, tgt_pos = supervised_positions(supervised)
    targets = input_ids[b_idx, tgt_pos]
    head, softcap, exact = head_of(model)
    if exact:
        hidden = backbone_hidden(model, input_ids, attention_mask)
        logits = head_logits(hidden[b_idx, pred_pos], head.weight, head.bias, softcap)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[b_idx, pred_pos].float()
    return b_idx, targets, logits


def token_margins(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """z_y - logsumexp_{v != y} z_v per row (the log-odds of the target against everything else)."""
    zy = logits.gather(1, targets[:, None]).squeeze(1)
    others = logits.scatter(1, targets[:, None], float("-inf"))
    return zy - torch.logsumexp(others, dim=-1)


def margin_losses(model, input_ids, attention_mask, supervised):
    """Per example, -margin at its decisive answer token (the lowest margin; the first on ties), and that token's
    index among the example's supervised tokens. Differentiable through the model."""
    b_idx, targets, logits = _answer_logits(model, input_ids, attention_mask, supervised)
    m = token_margins(logits, targets)
    B = input_ids.shape[0]
    pick, which = [], []
    md = m.detach()
    for b in range(B):
        sel = (b_idx == b).nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            which.append(-1)
            continue
        j = int(torch.argmin(md[sel]))
        which.append(j)
        pick.append(int(sel[j]))
    pick_t = torch.tensor(pick, dtype=torch.long, device=logits.device)
    losses = torch.zeros(B, dtype=torch.float32, device=logits.device).index_add(0, b_idx[pick_t], -m[pick_t])
    return losses, which
