"""Per-token contributions to a row's score along a parameter-space direction, by forward-mode AD.

A row's score against a (harm-signed, unit) query direction u is <u, g_row> with g_row the gradient of the row's
summed supervised loss, so it splits exactly over the row's supervised tokens:

    score = sum_t c_t,    c_t = <u, grad l_t> = d/de l_t(theta + e u) at e = 0,

the directional derivative of each token's loss along u. `token_contributions` computes every c_t of a row in one
forward pass: the LoRA weights are perturbed along u by injecting, at every LoRA B output, the tangent
U_B h + B U_A x of (B + e U_B)(A + e U_A) x (PEFT scales it like the LoRA output itself); the rest of the network
carries the tangent forward. Several directions run in one batch (one copy of the row per direction). Attention
runs on the math SDPA kernel (the fused kernels have no forward-mode derivative).

Directions live in parameter space, in the exact gradient layout (`layout`): per site (U_A [r, d_in], U_B [d_out,
r]). A projected index's direction w (scores <w, P(g)>) is the parameter-space direction P^T w
(`projection.back_project`); the contributions then add up to the projected score exactly. Best windows
(`attribution.windows`) and sentence spans (`explain.spans`) are sums of these contributions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..setup.batches import collate
from ..setup.tokenize import Tokenized
from .layout import split_directions
from .lm_head import backbone_hidden, head_logits, head_of
from .objectives import supervised_positions


@contextmanager
def _tangent_hooks(sites, dirs: list[tuple[Tensor, Tensor]], which: Tensor):
    """Inject the tangent of each LoRA branch along direction `which[b]` for batch element b."""
    import torch.autograd.forward_ad as fwAD

    stash: dict[int, Tensor] = {}
    handles = []

    def a_hook(i):
        def fn(mod, args, out):
            stash[i] = args[0]

        return fn

    def b_hook(i, site):
        def fn(mod, args, out):
            x = fwAD.unpack_dual(stash.pop(i)).primal
            h = fwAD.unpack_dual(args[0]).primal
            UA, UB = dirs[i]
            ua, ub = UA[which].to(x.device, x.dtype), UB[which].to(x.device, x.dtype)
            xa = torch.einsum("bti,bri->btr", x, ua)
            t = torch.einsum("btr,bor->bto", h, ub) + torch.nn.functional.linear(xa, site.B.weight)
            return out + fwAD.make_dual(torch.zeros_like(out), t.to(out.dtype))

        return fn

    try:
        for i, s in enumerate(sites):
            handles.append(s.A.register_forward_hook(a_hook(i)))
            handles.append(s.B.register_forward_hook(b_hook(i, s)))
        yield
    finally:
        for h in handles:
            h.remove()


def _token_tangents(model, input_ids: Tensor, attention_mask: Tensor, supervised: Tensor, chunk: int):
    """(batch index, target position, loss, d loss) of every supervised token, inside an active dual level."""
    import torch.autograd.forward_ad as fwAD

    b_idx, pred_pos, tgt_pos = supervised_positions(supervised)
    targets = input_ids[b_idx, tgt_pos]
    head, softcap, exact = head_of(model)
    if exact:
        hidden = backbone_hidden(model, input_ids, attention_mask)[b_idx, pred_pos]
    else:
        logits_all = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        hidden = logits_all[b_idx, pred_pos]
    prim, tan = [], []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s : s + chunk]
        if exact:
            logits = head_logits(h, head.weight, head.bias, softcap)
        else:
            logits = h.float()
        tok = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[s : s + chunk, None]).squeeze(1)
        p, t = fwAD.unpack_dual(tok)
        prim.append(p)
        tan.append(t if t is not None else torch.zeros_like(p))
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0))
    return b_idx, tgt_pos, cat(prim), cat(tan)


@torch.no_grad()
def token_contributions(model, sites, toks: Sequence[Tokenized], directions, *, pad_id: int, batch_size: int = 8,
                        jobs: Optional[Sequence[tuple[int, int]]] = None, chunk: int = 1024) -> dict:
    """Per-token contributions c_t = <u_k, grad l_t> of rows along parameter-space directions.

    directions: [K, D_exact] (exact index layout) or the per-site list of `split_directions`.
    jobs: (row index into toks, direction index) pairs; default every row with every direction.
    Returns {(row, k): float64 array over the row's supervised tokens, in position order}; each sums to <u_k, g_row>.
    """
    import torch.autograd.forward_ad as fwAD
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dirs = directions if isinstance(directions, list) else split_directions(sites, directions)
    K = dirs[0][0].shape[0] if dirs else 0
    if jobs is None:
        jobs = [(r, k) for r in range(len(toks)) for k in range(K)]
    device = next(model.parameters()).device
    dirs = [(a.to(device), b.to(device)) for a, b in dirs]
    # Longest first keeps padding low; the order does not change any value.
    order = sorted(range(len(jobs)), key=lambda j: (-len(toks[jobs[j][0]].input_ids), j))
    out: dict = {}
    for s in range(0, len(order), batch_size):
        js = [jobs[j] for j in order[s : s + batch_size]]
        ids, attn, sup = collate([toks[r] for r, _ in js], pad_id)
        which = torch.tensor([k for _, k in js], dtype=torch.long, device=device)
        with fwAD.dual_level(), sdpa_kernel([SDPBackend.MATH]), _tangent_hooks(sites, dirs, which):
            b_idx, tgt, _, tan = _token_tangents(model, ids.to(device), attn.to(device), sup.to(device), chunk)
        b_idx, tan = b_idx.cpu().numpy(), tan.double().cpu().numpy()
        for b, job in enumerate(js):
            out[job] = tan[b_idx == b]  # supervised_positions lists tokens in (batch, position) order
    return out
