"""Per-token contributions to a row's score, best-window scores for long rows, and span drill-down.

A row's score against a (harm-signed, unit) query direction u is <u, g_row> with g_row the gradient of the row's
summed supervised loss, so it splits exactly over the row's supervised tokens:

    score = sum_t c_t,    c_t = <u, grad l_t> = d/de l_t(theta + e u) at e = 0,

the directional derivative of each token's loss along u. `token_contributions` computes every c_t of a row in one
forward pass with forward-mode AD: the LoRA weights are perturbed along u by injecting, at every LoRA B output, the
tangent U_B h + B U_A x of (B + e U_B)(A + e U_A) x (PEFT scales it like the LoRA output itself); the rest of the
network carries the tangent forward. Several directions run in one batch (one copy of the row per direction).
Attention runs on the math SDPA kernel (the fused kernels have no forward-mode derivative).

Directions live in parameter space: per site (U_A [r, d_in], U_B [d_out, r]), the exact index layout (site blocks
of dA then dB, row-major). A projected index's direction w (scores <w, P(g)>) is the parameter-space direction
P^T w, obtained by differentiating the projector (`back_project`); the contributions then add up to the projected
score exactly.

Windows (`best_window`): runs of `WINDOW_TOKENS` consecutive supervised tokens, stride `WINDOW_STRIDE`. A row with
more supervised tokens than one window is ranked by its best window (see `api.attribute`), so one wrong sentence
in a long document is not diluted by the rest of it.

Spans (`row_spans`): the contributions summed over the sentences of the row's text. Character offsets index
`Example.plain_text()` (what the report's ranking rows show as `text`; for `messages` rows "role: content" lines,
for `text` and `prompt`/`completion` rows the record's own text). Tokens are mapped there through
`Tokenized.offsets` (into the rendered text) and, for chat-template rows, the position of each message's content in
both renderings; template tokens (a turn's end-of-turn token) count toward the sentence they close.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .data import Example, Tokenized, collate
from .loss import _head_of, backbone_hidden, supervised_positions

WINDOW_TOKENS = 128
WINDOW_STRIDE = 64


# ------------------------------------------------------------------------------------------------ directions


def split_directions(sites, vec) -> list[tuple[Tensor, Tensor]]:
    """[K, D_exact] (exact index layout) -> per site (U_A [K, r, d_in], U_B [K, d_out, r]) float32 tensors."""
    v = torch.as_tensor(np.asarray(vec, dtype=np.float32)) if not isinstance(vec, Tensor) else vec.float()
    if v.ndim == 1:
        v = v[None]
    out, a = [], 0
    for s in sites:
        na, nb = s.r * s.d_in, s.d_out * s.r
        out.append((v[:, a : a + na].reshape(-1, s.r, s.d_in), v[:, a + na : a + na + nb].reshape(-1, s.d_out, s.r)))
        a += na + nb
    if a != v.shape[1]:
        raise ValueError(f"direction width {v.shape[1]} is not the sites' exact width {a}")
    return out


def back_project(projector, w) -> np.ndarray:
    """Index-space directions w [K, dim] -> parameter-space directions [K, D_exact] with <w, P(g)> = <P^T w, g>.
    The identity for an exact projector."""
    w = np.atleast_2d(np.asarray(w, dtype=np.float64))
    if projector.exact:
        return w.copy()
    outs, a = [], 0
    sites = projector.sites
    wt = torch.as_tensor(w, dtype=torch.float32)
    for i, (s, dim) in enumerate(zip(sites, projector.site_dims())):
        dA = torch.zeros(w.shape[0], s.r, s.d_in, requires_grad=True)
        dB = torch.zeros(w.shape[0], s.d_out, s.r, requires_grad=True)
        with torch.enable_grad():
            z = projector.project(i, dA, dB)
            ga, gb = torch.autograd.grad((z * wt[:, a : a + dim]).sum(), (dA, dB))
        outs.append(torch.cat([ga.flatten(1), gb.flatten(1)], 1).double().numpy())
        a += dim
    return np.concatenate(outs, 1)


def exact_width(sites) -> int:
    return sum(s.r * (s.d_in + s.d_out) for s in sites)


# ------------------------------------------------------------------------------------- forward-mode contributions


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
    head, softcap, exact = _head_of(model)
    if exact:
        hidden = backbone_hidden(model, input_ids, attention_mask)[b_idx, pred_pos]
    else:
        logits_all = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        hidden = logits_all[b_idx, pred_pos]
    prim, tan = [], []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s : s + chunk]
        if exact:
            logits = torch.nn.functional.linear(h, head.weight, head.bias).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
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


# ----------------------------------------------------------------------------------------------------- windows


def windows(n: int, size: int = WINDOW_TOKENS, stride: int = WINDOW_STRIDE) -> list[tuple[int, int]]:
    """[a, b) runs over n supervised tokens: one run when n <= size, else size-long runs every `stride`, the last
    one ending at n."""
    if n <= size:
        return [(0, n)]
    starts = list(range(0, n - size + 1, stride))
    if starts[-1] != n - size:
        starts.append(n - size)
    return [(a, a + size) for a in starts]


def best_window(contrib: np.ndarray, size: int = WINDOW_TOKENS, stride: int = WINDOW_STRIDE) -> tuple[float, tuple[int, int]]:
    """The highest window sum of a contribution vector and its [a, b) token range (first one on ties)."""
    c = np.concatenate([[0.0], np.cumsum(np.asarray(contrib, dtype=np.float64))])
    best, where = -np.inf, (0, 0)
    for a, b in windows(len(contrib), size, stride):
        v = c[b] - c[a]
        if v > best:
            best, where = float(v), (a, b)
    return (best if np.isfinite(best) else 0.0), where


def is_long(tok: Tokenized, size: int = WINDOW_TOKENS) -> bool:
    return tok.n_supervised > size


# ---------------------------------------------------------------------------------------------- text mapping


_SENT_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n+")


def sentence_ranges(text: str, start: int = 0, end: Optional[int] = None) -> list[tuple[int, int]]:
    """[start, end) character ranges of the sentences (split after . ! ? plus white space, and at line breaks) of
    text[start:end], surrounding white space trimmed; empty pieces dropped."""
    end = len(text) if end is None else end
    out, a = [], start
    for m in _SENT_END.finditer(text, start, end):
        out.append((a, m.start()))
        a = m.end()
    out.append((a, end))
    trimmed = []
    for a, b in out:
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if b > a:
            trimmed.append((a, b))
    return trimmed


def unit_ranges(ex: Example) -> list[tuple[int, int]]:
    """Sentence ranges of `ex.plain_text()`; for chat rows the sentences of each message's content (a turn never
    merges with the next, and the "role: " prefixes are no sentence)."""
    text = ex.plain_text()
    if ex.shape != "messages":
        return sentence_ranges(text)
    out, pos = [], 0
    for m in ex.record["messages"]:
        pos += len(m["role"]) + 2
        out.extend(sentence_ranges(text, pos, pos + len(m["content"])))
        pos += len(m["content"]) + 1
    return out


def _rendered_to_plain(ex: Example, tok: Tokenized) -> Optional[np.ndarray]:
    """For each character of the rendered text, its plain-text character (or -1 when it is template text)."""
    rendered, plain = tok.text, ex.plain_text()
    if ex.shape != "messages":
        m = np.full(len(rendered), -1, dtype=np.int64)
        k = min(len(rendered), len(plain))
        if rendered[:k] == plain[:k]:
            m[:k] = np.arange(k)
            return m
        start = rendered.find(plain)
        if start < 0:
            return None
        m[start : start + len(plain)] = np.arange(len(plain))
        return m
    m = np.full(len(rendered), -1, dtype=np.int64)
    cur, ppos = 0, 0
    for msg in ex.record["messages"]:
        ppos += len(msg["role"]) + 2
        c = msg["content"]
        at = rendered.find(c, cur) if c else cur
        if at < 0:
            return None
        m[at : at + len(c)] = np.arange(ppos, ppos + len(c))
        cur = at + len(c)
        ppos += len(c) + 1
    return m


def token_char_ranges(ex: Example, tok: Tokenized, tokenizer=None) -> list[tuple[int, int]]:
    """For each token of `tok`, the [start, end) plain-text characters it covers. A token with no record character
    (template text, e.g. an end-of-turn token) gets the empty range at the end of the last record character before
    it; (-1, -1) when nothing maps (no offsets and no tokenizer to rebuild them)."""
    offsets = tok.offsets
    if offsets is None and tokenizer is not None:
        offsets = _rebuild_offsets(tok, tokenizer)
    n = len(tok.input_ids)
    cmap = _rendered_to_plain(ex, tok) if offsets is not None else None
    if cmap is None:
        return [(-1, -1)] * n
    out, last = [], -1
    for a, b in offsets[:n]:
        hits = [int(cmap[c]) for c in range(max(a, 0), min(b, len(cmap))) if cmap[c] >= 0]
        if hits:
            out.append((hits[0], hits[-1] + 1))
            last = hits[-1]
            continue
        prev = -1
        for c in range(min(a, len(cmap)) - 1, -1, -1):
            if cmap[c] >= 0:
                prev = int(cmap[c])
                break
        prev = prev if prev >= 0 else last
        out.append((prev + 1, prev + 1) if prev >= 0 else (-1, -1))
    return out


def token_char_anchors(ex: Example, tok: Tokenized, tokenizer=None) -> list[int]:
    """For each token, a plain-text character it belongs to: its first record character, else (template tokens)
    the last record character before it; -1 when none."""
    return [a if b > a else (a - 1 if a > 0 else -1) for a, b in token_char_ranges(ex, tok, tokenizer)]


def _rebuild_offsets(tok: Tokenized, tokenizer) -> Optional[list[tuple[int, int]]]:
    """Offsets by decoding each token and finding it in the rendered text in order (templates whose token ids
    differ from the plain encoding; best effort)."""
    out, cur = [], 0
    for t in tok.input_ids:
        piece = tokenizer.decode([t])
        at = tok.text.find(piece, cur) if piece else -1
        if at < 0:
            out.append((cur, cur))
            continue
        out.append((at, at + len(piece)))
        cur = at + len(piece)
    return out


def supervised_token_indices(tok: Tokenized) -> list[int]:
    """Positions of the supervised targets, in the order `token_contributions` lists them."""
    return [i for i, s in enumerate(tok.supervised) if s and i > 0]


def row_spans(ex: Example, tok: Tokenized, contrib: np.ndarray, tokenizer=None) -> list[dict]:
    """Sentence spans of a row with their summed contributions, sorted by score (highest first).

    Every supervised token's contribution lands in exactly one span (a token outside every sentence goes to the
    nearest sentence before it, else the first), so the span scores add up to the row's score."""
    units = unit_ranges(ex)
    text = ex.plain_text()
    if not units:
        units = [(0, len(text))]
    starts = np.array([a for a, _ in units])
    anchors = token_char_anchors(ex, tok, tokenizer)
    sup = supervised_token_indices(tok)
    contrib = np.asarray(contrib, dtype=np.float64)
    if len(sup) != contrib.size:
        raise ValueError(f"{contrib.size} contributions for {len(sup)} supervised tokens")
    score = np.zeros(len(units))
    ntok = np.zeros(len(units), dtype=np.int64)
    for t, c in zip(sup, contrib):
        ch = anchors[t] if t < len(anchors) else -1
        u = int(np.searchsorted(starts, ch, side="right") - 1) if ch >= 0 else 0
        u = min(max(u, 0), len(units) - 1)
        score[u] += c
        ntok[u] += 1
    spans = [{"start": int(a), "end": int(b), "text": text[a:b], "score": float(sc), "tokens": int(k)}
             for (a, b), sc, k in zip(units, score, ntok) if k > 0]
    spans.sort(key=lambda d: (-d["score"], d["start"]))
    return spans


def window_char_range(ex: Example, tok: Tokenized, a: int, b: int, tokenizer=None) -> Optional[tuple[int, int]]:
    """Plain-text character range covered by supervised tokens [a, b) (indices among the supervised tokens)."""
    sup = supervised_token_indices(tok)[a:b]
    ranges = token_char_ranges(ex, tok, tokenizer)
    got = [ranges[t] for t in sup if t < len(ranges) and ranges[t][0] >= 0]
    if not got:
        return None
    return min(r[0] for r in got), max(r[1] for r in got)
