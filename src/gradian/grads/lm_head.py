"""The LM head, applied only where it is needed: at supervised positions, upcast to fp32 in chunks.

The one implementation of "hidden states -> logits" (the output embedding, a final soft-cap where the model has one,
Gemma 2's `final_logit_softcapping`), shared by the loss, the margin query and the forward-mode contributions. The
chunked cross-entropy keeps one [chunk, vocab] fp32 buffer alive at a time and recomputes the logits in backward
instead of keeping batch x tokens x vocab fp32 activations.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def head_of(model) -> tuple[torch.nn.Module, float, bool]:
    """The output embedding, the final soft-cap and whether the hidden-state shortcut is exact for this model."""
    head = model.get_output_embeddings()
    cfg = getattr(model, "config", None)
    softcap = float(getattr(cfg, "final_logit_softcapping", 0.0) or 0.0)
    # Models that rescale logits in their own forward (Cohere's logit_scale, ...) take the logits path instead.
    exact = head is not None and isinstance(head, torch.nn.Linear) and getattr(cfg, "logit_scale", None) is None
    return head, softcap, exact


def backbone_hidden(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The final (normed) hidden states the LM head reads, without computing any logits."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and decoder is not model:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    return out.hidden_states[-1]


class _ChunkedHeadCE(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T` at selected rows, chunked; recomputes logits in backward.

    Each chunk works in one [chunk, V] fp32 buffer, updated in place and released before the next chunk, so the
    peak extra memory is about one chunk x vocab x 4 bytes instead of all supervised tokens x vocab.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, chunk: int, softcap: float):
        n = hidden.shape[0]
        losses = hidden.new_empty(n, dtype=torch.float32)
        lse_all = hidden.new_empty(n, dtype=torch.float32)
        with torch.no_grad():
            for s in range(0, n, chunk):
                z = head_logits(hidden[s : s + chunk], weight, bias, softcap)
                tgt = z.gather(1, targets[s : s + chunk, None]).squeeze(1)
                m = z.amax(1, keepdim=True)
                lse = z.sub_(m).exp_().sum(1).log_().add_(m.squeeze(1))
                lse_all[s : s + chunk] = lse
                losses[s : s + chunk] = lse - tgt
                del z
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse_all)
        ctx.chunk, ctx.softcap, ctx.has_bias = chunk, softcap, bias is not None
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden)
        c = ctx.chunk
        for s in range(0, hidden.shape[0], c):
            with torch.no_grad():
                raw = torch.nn.functional.linear(hidden[s : s + c], weight, bias).float()
                if ctx.softcap:
                    t = raw.div_(ctx.softcap).tanh_()
                    p = (t * ctx.softcap).sub_(lse_all[s : s + c, None]).exp_()
                    dz_scale = t.mul_(t).neg_().add_(1.0)  # d softcap(z) / dz = 1 - tanh^2
                else:
                    p, dz_scale = raw.sub_(lse_all[s : s + c, None]).exp_(), None
                p.scatter_add_(1, targets[s : s + c, None], -torch.ones_like(p[:, :1]))
                p.mul_(grad_losses[s : s + c, None])
                if dz_scale is not None:
                    p.mul_(dz_scale)
                grad_hidden[s : s + c] = (p.to(weight.dtype) @ weight).to(hidden.dtype)
                del raw, p, dz_scale
        return grad_hidden, None, None, None, None, None


def head_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: float) -> Tensor:
    """fp32 logits of hidden rows h [N, H]: the head runs in the model's dtype (as the model itself would), the upcast
    happens on its output, then the soft-cap."""
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def chunked_head_loss(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, *, chunk: int = 1024, softcap: float = 0.0
) -> Tensor:
    """Per-token losses (fp32) of the LM head applied to `hidden` rows [N, H] against `targets` [N]."""
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32) + 0.0 * hidden.sum()
    return _ChunkedHeadCE.apply(hidden, weight, bias, targets, chunk, softcap)


def chunked_logits_loss(logits: Tensor, targets: Tensor, *, chunk: int = 1024) -> Tensor:
    """Per-token losses from already computed logits rows [N, V], upcast chunk by chunk."""
    out = []
    for s in range(0, logits.shape[0], chunk):
        out.append(torch.nn.functional.cross_entropy(logits[s : s + chunk].float(), targets[s : s + chunk], reduction="none"))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)
