"""The data-aware projection's basis: fitted on a seeded sample of training rows, stored beside the index.

Per site side (`BasisFitter`, two passes with the exact per-example gradients):

1. wide side: the top k1 singular directions U (d x k1) of the stacked per-example rows (dA rows for A, dB
   columns for B), k1 = min(d, STAGE2_WIDTH // r), from the exact Gram (d <= GRAM_MAX_D, while all Grams fit
   FIT_GRAM_BYTES) or a Frequent Directions sketch; the rank side stays exact: X -> X U (r x k1);
2. site PCA: the top principal directions W of the flattened (r k1) stage-1 vectors.

The budget `dim` is shared across all sides by energy: the `dim` largest stage-2 eigenvalues over every side win.
The basis is written as safetensors whose bytes are a function of its content (`basis_bytes`), so its sha256 can
bind an index to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..grads.layout import SiteShape

GRAM_MAX_D = 1024  # data-aware stage 1: exact d x d Gram up to this width, a Frequent Directions sketch above
FIT_GRAM_BYTES = 256 << 20  # ... while all the exact Grams together stay within this
STAGE2_WIDTH = 256  # data-aware: r * k1, the width of a side's stage-1 output (its stage-2 Gram is this squared)
BASIS_FILE = "projection_basis.safetensors"
BASIS_SCHEMA = "gradian.projection_basis/2"


def stage1_width(site: SiteShape, side: str = "A") -> int:
    """Stage-1 width k1 of a side: as many wide-side directions as keep r * k1 <= STAGE2_WIDTH."""
    d = site.d_in if side == "A" else site.d_out
    return min(d, max(1, STAGE2_WIDTH // site.r))


def _top_eigvecs(gram: Tensor) -> tuple[Tensor, Tensor]:
    """All eigenpairs of a symmetric PSD float64 matrix, largest first, with deterministic signs (the
    largest-magnitude entry of each vector positive, the first one on ties)."""
    evals, evecs = torch.linalg.eigh(gram)
    evals, evecs = evals.flip(0).clamp(min=0.0), evecs.flip(1)
    return evals, _fix_signs(evecs)


def _fix_signs(u: Tensor) -> Tensor:
    if u.shape[1] == 0:
        return u
    piv = u.abs().argmax(0)
    sign = torch.sign(u[piv, torch.arange(u.shape[1])])
    sign[sign == 0] = 1.0
    return u * sign


class SideFit:
    """Second moment of the rows of one wide side: the exact Gram (float64) when d <= GRAM_MAX_D, else a Frequent
    Directions sketch of l rows (Liberty 2013: deterministic, one pass, B^T B within ||A - A_k||_F^2 / (l - k) of
    the Gram, far below what the top k1 <= l / 4 directions need). On CPU, so the result depends only on the rows
    fed and their order."""

    def __init__(self, d: int, k: int, gram_up_to: int = GRAM_MAX_D):
        self.d = d
        self.l = max(4 * k, 128)
        if d <= max(gram_up_to, 2 * self.l):
            self.gram: Optional[Tensor] = torch.zeros(d, d, dtype=torch.float64)
        else:
            self.gram = None
            self.buf = torch.zeros(2 * self.l, d, dtype=torch.float32)
            self.fill = 0

    def update(self, rows: Tensor) -> None:
        rows = rows.detach().reshape(-1, self.d)
        if self.gram is not None:
            r64 = rows.to("cpu", torch.float64)
            self.gram += r64.T @ r64
            return
        rows = rows.to("cpu", torch.float32)
        for a in range(0, rows.shape[0], self.l):
            part = rows[a : a + self.l]
            if self.fill + part.shape[0] > self.buf.shape[0]:
                self._shrink()
            self.buf[self.fill : self.fill + part.shape[0]] = part
            self.fill += part.shape[0]

    def _spectrum(self) -> tuple[Tensor, Tensor]:
        """Eigenvalues (desc) of B^T B and the matching orthonormal right singular vectors of B, as rows [m, d]."""
        b = self.buf[: self.fill].double()
        evals, v = _top_eigvecs(b @ b.T)  # the small side: (2 l) x (2 l)
        keep = evals > (evals[0] * 1e-12 if evals.numel() else 0)
        evals, v = evals[keep], v[:, keep]
        return evals, (v.T @ b) / evals.sqrt()[:, None]

    def _shrink(self) -> None:
        evals, vt = self._spectrum()
        delta = evals[self.l] if evals.numel() > self.l else evals.new_zeros(())
        s2 = torch.clamp(evals[: self.l] - delta, min=0.0).sqrt()
        self.buf.zero_()
        self.buf[: s2.numel()] = (s2[:, None] * vt[: s2.numel()]).float()
        self.fill = s2.numel()

    def top(self, k: int) -> Tensor:
        """Top-k directions [d, k], float32, orthonormal columns."""
        if self.gram is not None:
            _, u = _top_eigvecs(self.gram)
        else:
            _, vt = self._spectrum()
            u = _fix_signs(vt.T)
        u = u[:, :k]
        if u.shape[1] < k:  # fewer nonzero directions than asked: complete with a fixed orthonormal set
            q, _ = torch.linalg.qr(torch.cat([u, torch.eye(self.d, dtype=u.dtype)], 1))
            u = _fix_signs(q[:, :k])
        return u.float().contiguous()


@dataclass
class Basis:
    """A fitted data-aware projection. Per (site, side): `stage1` U [d, k1] (absent when k1 = d: identity),
    `stage2` W [r k1, k2] (absent when the side got no dims), `energy` [k2] (its eigenvalues)."""

    stage1: dict = field(default_factory=dict)
    stage2: dict = field(default_factory=dict)
    energy: dict = field(default_factory=dict)
    examples: int = 0


class BasisFitter:
    """Fits the basis of a data-aware projection of `sites` to `dim` dims (`Projector.fitter()`) from per-example
    site gradients in `passes` passes over the same rows, in the same order: for each pass, feed `update(i, dA, dB)`
    (or `update_all`) for every site of every batch, then call `end_pass()`; finally
    `projector.set_basis(fitter.finish())`. Pass 1 fits the wide-side directions (skipped when no side needs them),
    the last pass the site PCA and the allocation of the budget."""

    def __init__(self, sites: Sequence[SiteShape], dim: int):
        self.sites = list(sites)
        self.dim = int(dim)
        self._by_name = {s.name: s for s in self.sites}
        self.stage1_fits: dict = {}
        wide = [(s, side, stage1_width(s, side), (s.d_in if side == "A" else s.d_out))
                for s in self.sites for side in ("A", "B")]
        wide = [w for w in wide if w[2] < w[3]]
        # Exact d x d Grams up to GRAM_MAX_D while all of them fit FIT_GRAM_BYTES; beyond that (a real model: 876 MB
        # on SmolLM-135M's 420 sides) every side wider than 2 l takes the Frequent Directions sketch (2 l x d floats).
        gram_bytes = sum(8 * d * d for _, _, _, d in wide if d <= GRAM_MAX_D)
        gram_up_to = GRAM_MAX_D if gram_bytes <= FIT_GRAM_BYTES else 0
        for s, side, k1, d in wide:
            self.stage1_fits[(s.name, side)] = SideFit(d, k1, gram_up_to)
        self.passes = 2 if self.stage1_fits else 1
        self.pass_no = 0  # passes ended so far
        self.stage1: dict = {}
        self.grams: dict = {}
        self.examples = 0

    def update(self, i: int, dA: Tensor, dB: Tensor) -> None:
        s = self.sites[i]
        xs = {"A": dA, "B": dB.transpose(1, 2)}  # both [B, r, d]: rows of dA, columns of dB
        if self.pass_no >= self.passes:
            raise RuntimeError("update() after the last pass")
        if self.passes == 2 and self.pass_no == 0:
            for side, x in xs.items():
                fit = self.stage1_fits.get((s.name, side))
                if fit is not None:
                    fit.update(x.reshape(-1, x.shape[-1]))
            return
        if i == 0:
            self.examples += dA.shape[0]
        for side, x in xs.items():
            u = self.stage1.get((s.name, side))
            z = (x.float() @ u.to(x.device) if u is not None else x.float()).flatten(1).to("cpu", torch.float64)
            g = self.grams.get((s.name, side))
            self.grams[(s.name, side)] = z.T @ z if g is None else g.add_(z.T @ z)

    def update_all(self, per_site: Sequence[tuple[Tensor, Tensor]]) -> None:
        for i, (dA, dB) in enumerate(per_site):
            self.update(i, dA, dB)

    def end_pass(self) -> None:
        if self.passes == 2 and self.pass_no == 0:
            self.stage1 = {(name, side): fit.top(stage1_width(self._by_name[name], side))
                           for (name, side), fit in self.stage1_fits.items()}
            self.stage1_fits = {}
        self.pass_no += 1

    def finish(self) -> Basis:
        if self.pass_no != self.passes:
            raise RuntimeError(f"finish() after {self.pass_no} of {self.passes} passes")
        eig = {}
        cand = []  # (energy, side order, index): the budget goes to the largest energies over all sides
        order = [(s.name, side) for s in self.sites for side in ("A", "B")]
        for o, key in enumerate(order):
            g = self.grams.get(key)
            if g is None:
                continue
            evals, evecs = _top_eigvecs(g)
            eig[key] = (evals, evecs)
            cand.extend((float(e), o, j) for j, e in enumerate(evals.tolist()))
        cand.sort(key=lambda c: (-c[0], c[1], c[2]))
        take: dict = {}
        for _, o, _j in cand[: self.dim]:
            take[order[o]] = take.get(order[o], 0) + 1
        basis = Basis(stage1=dict(self.stage1), examples=self.examples)
        for key, k2 in take.items():
            evals, evecs = eig[key]
            basis.stage2[key] = evecs[:, :k2].float().contiguous()
            basis.energy[key] = evals[:k2].float().contiguous()
        return basis


def basis_bytes(tensors: dict, metadata: dict) -> bytes:
    """float32 tensors as a safetensors file, byte for byte a function of the input (sorted names and metadata
    keys: `safetensors.torch.save` orders its metadata by a hash map, so its bytes, and the sha256 the index
    meta records, could differ between two saves of the same basis)."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, off = [], 0
    for name in sorted(tensors):
        arr = tensors[name].detach().cpu().float().contiguous().numpy().astype("<f4")
        b = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(blobs)


class FitsBasis(Protocol):
    """What `fit_basis` needs of a projector (`projector.Projector`)."""

    def fitter(self) -> BasisFitter: ...

    def set_basis(self, basis: Basis) -> None: ...


def fit_basis(projector: FitsBasis, batches: Sequence[Sequence[tuple[Tensor, Tensor]]]) -> Basis:
    """Fit (and set) a data-aware projector's basis from per-site exact gradients, one list per batch (a sequence:
    the fit may go over it twice)."""
    f = projector.fitter()
    for _ in range(f.passes):
        for per_site in batches:
            f.update_all(per_site)
        f.end_pass()
    basis = f.finish()
    projector.set_basis(basis)
    return basis
