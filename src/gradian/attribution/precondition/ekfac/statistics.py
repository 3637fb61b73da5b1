"""EK-FAC's statistics, streamed: one model pass over the training rows accumulates the covariances of a group of
sites (float32 sums, at most `memory_bytes` of them at a time: more groups mean more passes, never more memory),
eigendecomposed into the Kronecker eigenbases; then the correction streams the rows' exact per-example gradients,
read from the index when it is exact and float32, else from a second model pass. Nothing grows with rows."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ....grads.capture import GradientCapture, _Recorder
from ....grads.layout import SiteShape, exact_widths, site_shapes
from ....grads.objectives import per_example_loss
from ....progress import progress_bar
from ....projection import Projector
from ....setup.batches import batches, length_order
from .factors import SIDES, DEFAULT_MEMORY_BYTES, ModuleFactors, site_groups
from .maths import eigenbasis, rotate


def _masked(x, attn):
    """Tokens of [B, T, d] where the attention mask is 1, as [n, d] float32."""
    return x.float()[attn.bool()]


def covariance_pass(model, sites, toks, positions, batch_size: int, pad_id: int, chunk: int, bar=None) -> dict:
    """One pass over the rows: per site, the float32 sums of the A input (activation) covariance, the A output
    gradient covariance, the B input and B output gradient covariances, over every real token; and the token count.
    The gradients are those of each row's summed supervised-token loss (the index's loss)."""
    import torch

    device = next(model.parameters()).device
    z = lambda d: torch.zeros(d, d, dtype=torch.float32, device=device)  # noqa: E731
    sums = {i: {"A_act": z(s.d_in), "A_grad": z(s.r), "B_act": z(s.r), "B_grad": z(s.d_out)}
            for i, s in enumerate(sites)}
    tokens = 0
    for part, ids, attn, sup in batches(toks, positions, batch_size, pad_id, device):
        with _Recorder(sites) as rec:
            losses = per_example_loss(model, ids, attn, sup, chunk=chunk)
        tokens += int(attn.sum())
        targets, spans = [], []
        for i in range(len(sites)):
            spans.append((len(targets), len(rec.a_out[i]), len(rec.b_out[i])))
            targets.extend(rec.a_out[i])
            targets.extend(rec.b_out[i])
        total = losses.sum()
        grads = (torch.autograd.grad(total, targets, allow_unused=True) if total.requires_grad
                 else [None] * len(targets))
        with torch.no_grad():
            for i in range(len(sites)):
                st, na, nb = spans[i]
                acc = sums[i]
                for x in rec.a_in[i]:
                    x = _masked(x, attn)
                    acc["A_act"].addmm_(x.T, x)
                for h in rec.b_in[i]:
                    h = _masked(h, attn)
                    acc["B_act"].addmm_(h.T, h)
                for g in grads[st : st + na]:
                    if g is not None:
                        g = _masked(g, attn)
                        acc["A_grad"].addmm_(g.T, g)
                for g in grads[st + na : st + na + nb]:
                    if g is not None:
                        g = _masked(g, attn)
                        acc["B_grad"].addmm_(g.T, g)
        del rec, grads, targets, losses
        if bar is not None:
            bar.advance(len(part))
    return {"sums": sums, "tokens": tokens}


def _bases(sums: dict) -> dict:
    """Per site and module: (left, right) eigenbases (float32, decomposed in float64). A: left from its output
    gradients (r x r), right from its inputs (d_in x d_in); B: left from its output gradients (d_out x d_out),
    right from its inputs (r x r). Each covariance is dropped once decomposed, so a group never holds both."""
    out = {}
    for i in list(sums):
        acc = sums.pop(i)
        for sd in SIDES:
            g, a = acc.pop(f"{sd}_grad"), acc.pop(f"{sd}_act")
            out[(i, sd)] = (eigenbasis(g.double().cpu().numpy()).astype(np.float32),
                            eigenbasis(a.double().cpu().numpy()).astype(np.float32))
            del g, a
    return out


def _correct_batch(lam: dict, bases: dict, local: int, dA, dB) -> None:
    """Add one batch's rotated squared gradients (dA [B, r, d_in], dB [B, d_out, r], numpy float64) to `lam`."""
    for sd, G in (("A", dA), ("B", dB)):
        left, right = bases[(local, sd)]
        lam[(local, sd)] += np.square(rotate(G, left, right)).sum(0)


def correction_from_model(model, sites, toks, positions, batch_size: int, pad_id: int, chunk: int, bases: dict,
                          bar=None) -> dict:
    """Corrected eigenvalue sums from exact per-example gradients of one more model pass."""

    cap = GradientCapture(model, sites, Projector(site_shapes(sites)), chunk=chunk)
    device = next(model.parameters()).device
    lam = {(i, sd): np.zeros((s.r, s.d_in) if sd == "A" else (s.d_out, s.r)) for i, s in enumerate(sites) for sd in SIDES}
    for part, ids, attn, sup in batches(toks, positions, batch_size, pad_id, device):
        per_site, _ = cap.site_grads(ids, attn, sup)
        for i, (dA, dB) in enumerate(per_site):
            _correct_batch(lam, bases, i, dA.detach().double().cpu().numpy(), dB.detach().double().cpu().numpy())
        if bar is not None:
            bar.advance(len(part))
    return lam


def correction_from_rows(rows, all_sites: Sequence[SiteShape], group: Sequence[int], bases: dict, bar=None) -> dict:
    """Corrected eigenvalue sums of the sites in `group` from an exact index's rows (streamed in chunks)."""
    offs = np.concatenate([[0], np.cumsum(exact_widths(all_sites))])
    lam = {(j, sd): np.zeros((all_sites[i].r, all_sites[i].d_in) if sd == "A" else (all_sites[i].d_out, all_sites[i].r))
           for j, i in enumerate(group) for sd in SIDES}
    for a, b, R in rows.chunks():
        for j, i in enumerate(group):
            s, o = all_sites[i], int(offs[i])
            na = s.r * s.d_in
            dA = R[:, o : o + na].reshape(-1, s.r, s.d_in)
            dB = R[:, o + na : o + na + s.d_out * s.r].reshape(-1, s.d_out, s.r)
            _correct_batch(lam, bases, j, dA, dB)
        if bar is not None:
            bar.advance(b - a)
    return lam


def fit_factors(model, sites, toks, *, batch_size: int, pad_id: int, chunk: int, rows=None,
                memory_bytes: int = DEFAULT_MEMORY_BYTES, progress: bool = True, sink=None) -> tuple[dict, dict]:
    """Every site's factors {(site, side): ModuleFactors} and how they were computed. `rows`, an exact float32
    `RowSource` over the same training rows, serves the correction (no second model pass); None: a model pass.
    `sink(group, site indices, factors)`, when given, receives each group's factors as they are fitted (and
    nothing is kept here): what holds memory to one group."""

    t0 = time.time()
    shapes = site_shapes(sites)
    groups = site_groups(shapes, memory_bytes)
    positions = length_order(toks)  # the index's batches: the same bits on every run
    n = len(toks)
    out: dict = {}
    tokens = 0
    with progress_bar("ekfac factors", total=2 * n * len(groups)) as bar:
        for gi, grp in enumerate(groups):
            gsites = [sites[i] for i in grp]
            stats = covariance_pass(model, gsites, toks, positions, batch_size, pad_id, chunk, bar)
            tokens = stats["tokens"]
            bases = _bases(stats.pop("sums"))
            if rows is not None:
                lam = correction_from_rows(rows, shapes, grp, bases, bar)
            else:
                lam = correction_from_model(model, gsites, toks, positions, batch_size, pad_id, chunk, bases, bar)
            got = {(i, sd): ModuleFactors(*bases.pop((j, sd)), lam.pop((j, sd)) / max(n, 1))
                   for j, i in enumerate(grp) for sd in SIDES}
            if sink is None:
                out.update(got)
            else:
                sink(gi, grp, got)
            del got, bases, lam
    info = {"rows": n, "tokens": tokens, "groups": len(groups),
            "model_passes": len(groups) * (1 if rows is not None else 2),
            "correction": "index rows" if rows is not None else "model pass", "fit_seconds": round(time.time() - t0, 3)}
    return out, info
