"""LoRA-aware projection: keep the rank-r side of each LoRA gradient exact, compress only the wide side.

A LoRA site's per-example gradient is dA (r x d_in) and dB (d_out x r). Gradian's score is an inner product of
such gradients, sum over sites of <dA, dA'> + <dB, dB'>, and a projection must keep it.

Random kinds (`rademacher`, `gaussian`, `sjlt`): one matrix P (d x k) per site and side, applied to the wide side
only: dA -> dA P (r x k), dB -> P^T dB (k x r), a per-site width of 2 r k with k = dim // (sum of 2 r). Each P has
E[P P^T] = I, so projected inner products are unbiased. A side no wider than k stays exact.

* ``rademacher``, ``gaussian``: dense entries of variance 1/k, generated in fixed blocks of ``BLOCK_ROWS`` rows, each
  from its own seed derived from (seed, site, side, block): any block can be regenerated alone, so a large d
  never needs one huge draw (`Projector` caches whole matrices up to ``DENSE_CACHE_BYTES`` and streams the rest).
* ``sjlt``: a sparse JL transform (Kane-Nelson block construction): the k outputs are split into s blocks; every
  input coordinate hashes to one bucket per block with a random sign, scaled by 1/sqrt(s). Kept as (bucket,
  sign) per coordinate and applied as a CSR sparse product once k is large enough for that to win.

The random kinds are a pure function of (kind, seed, site name, side, shapes): reproducible from the manifest,
never stored. Their error is variance: with k of a few per side (what a 1024-wide budget leaves over 14-224
sites) the rankings they give are poor (bench/README.md).

Data-aware kind (`data-aware`), fitted on a seeded sample of training rows (`BasisFitter`, two passes with the
exact per-example gradients) and stored beside the index (`save_basis`/`load_basis`, safetensors, its sha256 in
the index meta). Per site side:

1. wide side: the top k1 singular directions U (d x k1) of the stacked per-example rows (dA rows for A, dB
   columns for B), k1 = min(d, STAGE2_WIDTH // r); the rank side stays exact: X -> X U (r x k1);
2. site PCA: the top principal directions W of the flattened (r k1) stage-1 vectors.

The budget `dim` is shared across all sides by energy: the `dim` largest stage-2 eigenvalues over every side win,
so the sites that carry gradient get the dims and a side that carries none gets zero. The width is exactly
min(dim, sum of r k1), for any dim >= 1 (no minimum). It keeps the energy the gradients actually have instead of
a random slice of it; it is biased (it drops the residual), which rankings tolerate far better than variance.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .errors import ConfigError

# Bump when any matrix this module generates changes for the same settings: it is part of spec(), so of the
# index cache key, and an index built with other matrices becomes foreign.
PROJECTION_VERSION = 2
KINDS = ("rademacher", "gaussian", "sjlt", "data-aware")
RANDOM_KINDS = ("rademacher", "gaussian", "sjlt")
BLOCK_ROWS = 2048  # rows of a dense random matrix generated from one seed
SJLT_NNZ = 4  # nonzeros per input coordinate
SJLT_SPARSE_FROM_K = 128  # from this k on the CSR product beats a dense copy of the SJLT (CPU, measured)
DENSE_CACHE_BYTES = 512 << 20  # dense matrices kept per projector; beyond it blocks are regenerated per call
DEFAULT_FIT_ROWS = 512  # rows the data-aware basis is fitted on (2 capture passes over them)
GRAM_MAX_D = 1024  # data-aware stage 1: exact d x d Gram up to this width, a Frequent Directions sketch above
STAGE2_WIDTH = 256  # data-aware: r * k1, the width of a side's stage-1 output (its stage-2 Gram is this squared)
BASIS_FILE = "projection_basis.safetensors"
BASIS_SCHEMA = "gradian.projection_basis/2"


@dataclass(frozen=True)
class SiteShape:
    name: str
    r: int
    d_in: int
    d_out: int


def _seed_for(seed: int, name: str, side: str, block: Optional[int] = None) -> int:
    tag = f"{seed}:{name}:{side}" + ("" if block is None else f":{block}")
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------- random kinds


def dense_block(kind: str, rows: int, cols: int, seed: int) -> Tensor:
    """One block [rows, cols] of a dense random projection, entries of variance 1/cols (float32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        m = torch.randn(rows, cols, generator=g)
    elif kind == "rademacher":
        m = torch.randint(0, 2, (rows, cols), generator=g).float().mul_(2).sub_(1)
    else:
        raise ValueError(f"dense_block: unknown dense kind {kind!r}")
    return m.mul_(1.0 / math.sqrt(cols))


def dense_blocks(kind: str, d: int, k: int, seed: int, name: str, side: str):
    """(start, stop, block) over the d rows of the matrix of (seed, site, side), BLOCK_ROWS at a time."""
    for b, start in enumerate(range(0, d, BLOCK_ROWS)):
        stop = min(d, start + BLOCK_ROWS)
        yield start, stop, dense_block(kind, stop - start, k, _seed_for(seed, name, side, b))


class SparseJL:
    """A d -> k sparse JL transform: every input coordinate has `s` nonzeros +-1/sqrt(s), one per output block."""

    def __init__(self, d: int, k: int, seed: int, s: int = SJLT_NNZ):
        self.d, self.k = d, k
        self.s = s = max(1, min(s, k))
        g = torch.Generator().manual_seed(seed)
        bounds = [(j * k) // s for j in range(s + 1)]  # block j covers outputs [bounds[j], bounds[j+1])
        cols, signs = [], []
        for j in range(s):
            lo, hi = bounds[j], bounds[j + 1]
            cols.append(torch.randint(lo, hi, (d,), generator=g))
            signs.append(torch.randint(0, 2, (d,), generator=g).float().mul_(2).sub_(1))
        self.cols = torch.stack(cols)  # [s, d] output bucket of each input coordinate, per block
        self.vals = torch.stack(signs).mul_(1.0 / math.sqrt(s))  # [s, d]
        self._csr: dict = {}

    def dense(self) -> Tensor:
        """The same transform as a dense [d, k] matrix (for small d*k, and for tests)."""
        m = torch.zeros(self.d, self.k)
        rows = torch.arange(self.d)
        for j in range(self.s):
            m.index_put_((rows, self.cols[j]), self.vals[j], accumulate=True)
        return m

    def _transposed_csr(self, device) -> Tensor:
        """P^T as a [k, d] CSR matrix (entries sorted by row, then column: a fixed summation order)."""
        key = str(device)
        m = self._csr.get(key)
        if m is None:
            rows = self.cols.flatten()
            cols = torch.arange(self.d).repeat(self.s)
            vals = self.vals.flatten()
            order = torch.argsort(rows * self.d + cols)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
                m = torch.sparse_coo_tensor(torch.stack([rows[order], cols[order]]), vals[order], (self.k, self.d),
                                            check_invariants=False)
                m = m.coalesce().to_sparse_csr().to(device)
            self._csr[key] = m
        return m

    def apply(self, x: Tensor) -> Tensor:
        """x [..., d] -> x P [..., k]."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = (self._transposed_csr(x.device) @ flat.T.contiguous()).T  # [N, k]
        return out.reshape(*lead, self.k)


def random_matrix(rows: int, cols: int, *, kind: str, seed: int, device=None, name: str = "", side: str = "") -> Tensor:
    """The whole rows x cols matrix (E[P P^T] = I) of (kind, seed, name, side), assembled from its blocks.

    Only for small matrices and tests; `Projector` never needs one for a large d."""
    if kind == "sjlt":
        m = SparseJL(rows, cols, _seed_for(seed, name, side)).dense()
    elif kind in ("rademacher", "gaussian"):
        m = torch.cat([blk for _, _, blk in dense_blocks(kind, rows, cols, seed, name, side)])
    else:
        raise ValueError(f"unknown projection kind {kind!r}; known: {', '.join(RANDOM_KINDS)}")
    return m.to(device) if device is not None else m


# ---------------------------------------------------------------------------------------- data-aware fit


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


class _SideFit:
    """Second moment of the rows of one wide side: the exact Gram (float64) when d <= GRAM_MAX_D, else a Frequent
    Directions sketch of l rows (Liberty 2013: deterministic, one pass, B^T B within ||A - A_k||_F^2 / (l - k) of
    the Gram, far below what the top k1 <= l / 4 directions need). On CPU, so the result depends only on the rows
    fed and their order."""

    def __init__(self, d: int, k: int):
        self.d = d
        self.l = max(4 * k, 128)
        if d <= max(GRAM_MAX_D, 2 * self.l):
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
    """Fits a data-aware projector's basis from per-example site gradients in `passes` passes over the same rows,
    in the same order: for each pass, feed `update(i, dA, dB)` (or `update_all`) for every site of every batch,
    then call `end_pass()`; finally `projector.set_basis(fitter.finish())`. Pass 1 fits the wide-side directions
    (skipped when no side needs them), the last pass the site PCA and the allocation of the budget."""

    def __init__(self, projector: "Projector"):
        if projector.kind != "data-aware" or projector.exact:
            raise ValueError("only a projecting data-aware projector is fitted")
        self.p = projector
        self.stage1_fits: dict = {}
        for s in projector.sites:
            for side in ("A", "B"):
                k1, d = projector.k1(s, side), (s.d_in if side == "A" else s.d_out)
                if k1 < d:
                    self.stage1_fits[(s.name, side)] = _SideFit(d, k1)
        self.passes = 2 if self.stage1_fits else 1
        self.pass_no = 0  # passes ended so far
        self.stage1: dict = {}
        self.grams: dict = {}
        self.examples = 0

    def update(self, i: int, dA: Tensor, dB: Tensor) -> None:
        s = self.p.sites[i]
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
            self.stage1 = {(name, side): fit.top(self.p.k1(self.p.site(name), side))
                           for (name, side), fit in self.stage1_fits.items()}
            self.stage1_fits = {}
        self.pass_no += 1

    def finish(self) -> Basis:
        if self.pass_no != self.passes:
            raise RuntimeError(f"finish() after {self.pass_no} of {self.passes} passes")
        eig = {}
        cand = []  # (energy, side order, index): the budget goes to the largest energies over all sides
        order = [(s.name, side) for s in self.p.sites for side in ("A", "B")]
        for o, key in enumerate(order):
            g = self.grams.get(key)
            if g is None:
                continue
            evals, evecs = _top_eigvecs(g)
            eig[key] = (evals, evecs)
            cand.extend((float(e), o, j) for j, e in enumerate(evals.tolist()))
        cand.sort(key=lambda c: (-c[0], c[1], c[2]))
        take: dict = {}
        for _, o, _j in cand[: self.p.dim]:
            take[order[o]] = take.get(order[o], 0) + 1
        basis = Basis(stage1=dict(self.stage1), examples=self.examples)
        for key, k2 in take.items():
            evals, evecs = eig[key]
            basis.stage2[key] = evecs[:, :k2].float().contiguous()
            basis.energy[key] = evals[:k2].float().contiguous()
        return basis


# -------------------------------------------------------------------------------------------- projector


class Projector:
    """Maps per-site (dA, dB) per-example gradients to one flat vector; exact (identity) when `dim` is None or
    at least the exact width.

    Random kinds: each side gets k = dim // (sum over sites of 2 r) wide-side directions; a dim under that minimum
    is a `ConfigError` that says so. Data-aware: `dim` is shared by energy (module docstring); fit it first.
    """

    def __init__(self, sites: Sequence[SiteShape], dim: Optional[int] = None, kind: str = "rademacher", seed: int = 0,
                 *, fit_rows: int = DEFAULT_FIT_ROWS):
        if kind not in KINDS:
            raise ConfigError(f"grads.projection_kind: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        self.sites = list(sites)
        self._by_name = {s.name: s for s in self.sites}
        self.kind, self.seed, self.fit_rows = kind, int(seed), int(fit_rows)
        self.requested_dim = dim
        self.exact_dim = sum(s.r * (s.d_in + s.d_out) for s in self.sites)
        self.k: Optional[int] = None
        self._dim = self.exact_dim
        if dim is not None and dim < self.exact_dim:
            if kind == "data-aware":
                self.k = 0  # marks "projecting"; per-side widths come from the fit
                self._dim = min(int(dim), sum(s.r * (self.k1(s, "A") + self.k1(s, "B")) for s in self.sites))
            else:
                min_width = sum(2 * s.r for s in self.sites)
                if dim < min_width:
                    raise ConfigError(
                        f"grads.projection_dim={dim} is below the narrowest {kind} projection of these "
                        f"{len(self.sites)} LoRA sites: {min_width} dims (2 x rank per site: one wide-side direction "
                        f"for A and one for B, the rank side kept exact). Set grads.projection_dim >= {min_width}, "
                        "use grads.projection_kind=data-aware (any width), capture fewer sites with "
                        "grads.module_filter, or leave projection_dim unset for exact gradients."
                    )
                self.k = dim // min_width
                self._dim = sum(s.r * (min(self.k, s.d_in) + min(self.k, s.d_out)) for s in self.sites)
        self._cache: dict = {}
        self._cache_bytes = 0
        self.basis: Optional[Basis] = None
        self.basis_sha256: Optional[str] = None

    # ------------------------------------------------------------------------------------------ shapes

    @property
    def exact(self) -> bool:
        return self.k is None

    @property
    def dim(self) -> int:
        return self._dim

    def site(self, name: str) -> SiteShape:
        return self._by_name[name]

    def k1(self, site: SiteShape, side: str = "A") -> int:
        """Data-aware stage-1 width of a side: as many wide-side directions as keep r * k1 <= STAGE2_WIDTH."""
        d = site.d_in if side == "A" else site.d_out
        return min(d, max(1, STAGE2_WIDTH // site.r))

    def side_k(self, site: SiteShape, side: str) -> int:
        """Random kinds: width kept on one wide side (its full width when not projected)."""
        d = site.d_in if side == "A" else site.d_out
        return d if self.k is None else min(self.k, d)

    def _projects(self, site: SiteShape, side: str) -> bool:
        d = site.d_in if side == "A" else site.d_out
        return self.k is not None and self.k < d

    def side_dims(self, site: SiteShape) -> tuple[int, int]:
        if self.k is None:
            return site.r * site.d_in, site.r * site.d_out
        if self.kind == "data-aware":
            if self.basis is None:
                raise RuntimeError("data-aware projector: the per-site widths are known once the basis is fitted")
            w = self.basis.stage2
            return tuple(int(w[(site.name, sd)].shape[1]) if (site.name, sd) in w else 0 for sd in ("A", "B"))
        return site.r * self.side_k(site, "A"), site.r * self.side_k(site, "B")

    def site_dims(self) -> list[int]:
        """Width of each site's block; empty for a data-aware projector before its fit (the fit decides them)."""
        if self.kind == "data-aware" and self.k is not None and self.basis is None:
            return []
        return [sum(self.side_dims(s)) for s in self.sites]

    @property
    def needs_fit(self) -> bool:
        return self.kind == "data-aware" and self.k is not None and self.basis is None

    # ---------------------------------------------------------------------------------------- matrices

    def _remember(self, key, value, nbytes: int):
        if self._cache_bytes + nbytes <= DENSE_CACHE_BYTES:
            self._cache[key] = value
            self._cache_bytes += nbytes
        return value

    def _sjlt(self, site: SiteShape, side: str, d: int) -> SparseJL:
        key = (site.name, side, "sjlt")
        m = self._cache.get(key)
        if m is None:
            m = self._remember(key, SparseJL(d, self.k, _seed_for(self.seed, site.name, side)), 12 * SJLT_NNZ * d)
        return m

    def _dense(self, site: SiteShape, side: str, d: int, device) -> Optional[Tensor]:
        """The whole [d, k] random matrix when it fits the cache, else None (apply block by block)."""
        key = (site.name, side, str(device))
        m = self._cache.get(key)
        if m is not None:
            return m
        nbytes = 4 * d * self.k
        if self._cache_bytes + nbytes > DENSE_CACHE_BYTES:
            return None
        if self.kind == "sjlt":
            if self.k >= SJLT_SPARSE_FROM_K:
                return None
            m = self._sjlt(site, side, d).dense()
        else:
            m = random_matrix(d, self.k, kind=self.kind, seed=self.seed, name=site.name, side=side)
        return self._remember(key, m.to(device), nbytes)

    def _fitted(self, stage: str, site: SiteShape, side: str, device) -> Optional[Tensor]:
        key = (site.name, side, stage, str(device))
        m = self._cache.get(key)
        if m is None:
            if self.basis is None:
                raise RuntimeError("data-aware projector used before its basis was fitted or loaded "
                                   "(gradian.indexing.ensure_basis does both)")
            src = self.basis.stage1 if stage == "U" else self.basis.stage2
            m = src.get((site.name, side))
            if m is None:
                return None
            m = self._remember(key, m.to(device), 0)
        return m

    def matrix(self, i: int, side: str, device=None) -> Tensor:
        """Random kinds: the [d, k] matrix of site i's side "A" or "B" (materialised; tests and inspection)."""
        site = self.sites[i]
        d = site.d_in if side == "A" else site.d_out
        if not self._projects(site, side) or self.kind == "data-aware":
            raise ValueError("matrix() is for the projected sides of random kinds")
        return random_matrix(d, self.k, kind=self.kind, seed=self.seed, name=site.name, side=side, device=device)

    def _apply(self, site: SiteShape, side: str, x: Tensor) -> Tensor:
        """Random kinds: x [..., d] @ P [d, k]."""
        d = x.shape[-1]
        m = self._dense(site, side, d, x.device)
        if m is not None:
            return x @ m
        if self.kind == "sjlt":
            return self._sjlt(site, side, d).apply(x)
        out = None
        for a, b, blk in dense_blocks(self.kind, d, self.k, self.seed, site.name, side):
            part = x[..., a:b] @ blk.to(x.device)
            out = part if out is None else out.add_(part)
        return out

    def _stage2(self, site: SiteShape, side: str, z: Tensor) -> Tensor:
        """Data-aware: stage-1 output [B, r, k1] -> [B, k2]."""
        w = self._fitted("W", site, side, z.device)
        if w is None:
            return z.new_zeros(z.shape[0], 0)
        return z.flatten(1) @ w

    # ---------------------------------------------------------------------------------------- project

    def project(self, i: int, dA: Tensor, dB: Tensor) -> Tensor:
        """dA [B, r, d_in], dB [B, d_out, r] (float32) -> [B, site_dim]."""
        site = self.sites[i]
        if self.k is None:
            return torch.cat([dA.flatten(1), dB.flatten(1)], dim=1)
        if self.kind == "data-aware":
            parts = []
            for side, x in (("A", dA), ("B", dB.transpose(1, 2))):  # both [B, r, d]
                u = self._fitted("U", site, side, x.device)
                parts.append(self._stage2(site, side, x @ u if u is not None else x))
            return torch.cat(parts, dim=1)
        pa = self._apply(site, "A", dA) if self._projects(site, "A") else dA  # [B, r, k]
        if self._projects(site, "B"):
            pb = self._apply(site, "B", dB.transpose(1, 2)).transpose(1, 2)  # P^T dB: [B, k, r]
        else:
            pb = dB
        return torch.cat([pa.flatten(1), pb.flatten(1)], dim=1)

    def project_inputs(self, i: int, x: Tensor, gh: Tensor, h: Tensor, gz: Tensor) -> Tensor:
        """The same vector as `project(i, dA, dB)` with dA = sum_t gh_t x_t^T and dB = sum_t gz_t h_t^T, computed
        by projecting the wide inputs first: (sum_t gh_t x_t^T) P = sum_t gh_t (x_t^T P). x [B, T, d_in],
        gh [B, T, r], h [B, T, r], gz [B, T, d_out]. Cheaper than the outer product when k < r or T is short."""
        site = self.sites[i]
        x, gh, h, gz = x.float(), gh.float(), h.float(), gz.float()
        if self.k is None:
            return self.project(i, torch.einsum("btr,bti->bri", gh, x), torch.einsum("bto,btr->bor", gz, h))
        if self.kind == "data-aware":
            ua, ub = self._fitted("U", site, "A", x.device), self._fitted("U", site, "B", x.device)
            xa = x @ ua if ua is not None else x
            zb = gz @ ub if ub is not None else gz
            za = torch.einsum("btr,btk->brk", gh, xa)  # (dA) U_A: [B, r, k1]
            zbb = torch.einsum("btr,btk->brk", h, zb)  # (dB^T) U_B: [B, r, k1]
            return torch.cat([self._stage2(site, "A", za), self._stage2(site, "B", zbb)], dim=1)
        xa = self._apply(site, "A", x) if self._projects(site, "A") else x
        zb = self._apply(site, "B", gz) if self._projects(site, "B") else gz
        pa = torch.einsum("btr,btk->brk", gh, xa)
        pb = torch.einsum("btk,btr->bkr", zb, h)
        return torch.cat([pa.flatten(1), pb.flatten(1)], dim=1)

    # ------------------------------------------------------------------------------------- data-aware

    def fitter(self) -> BasisFitter:
        return BasisFitter(self)

    def set_basis(self, basis: Basis) -> None:
        """Install a fitted basis after checking every shape against the sites and the budget."""
        if self.kind != "data-aware" or self.k is None:
            raise ValueError("set_basis: only a projecting data-aware projector has a basis")
        total = 0
        for s in self.sites:
            for side in ("A", "B"):
                d, k1 = (s.d_in if side == "A" else s.d_out), self.k1(s, side)
                u = basis.stage1.get((s.name, side))
                if k1 < d and (u is None or tuple(u.shape) != (d, k1)):
                    raise ValueError(f"basis: stage 1 of {s.name}/{side} is {None if u is None else tuple(u.shape)}, "
                                     f"expected {(d, k1)}")
                w = basis.stage2.get((s.name, side))
                if w is not None:
                    if w.ndim != 2 or w.shape[0] != s.r * k1:
                        raise ValueError(f"basis: stage 2 of {s.name}/{side} is {tuple(w.shape)}, expected "
                                         f"({s.r * k1}, k)")
                    total += int(w.shape[1])
        if total != self._dim:
            raise ValueError(f"basis: its widths sum to {total}, this projector is {self._dim} wide")
        self.basis = basis
        self._cache, self._cache_bytes = {}, 0

    def basis_spec(self) -> dict:
        """What a stored basis must have been fitted for."""
        return {"kind": self.kind, "dim": self._dim, "seed": self.seed, "fit_rows": self.fit_rows,
                "stage2_width": STAGE2_WIDTH, "version": PROJECTION_VERSION,
                "sites": [[s.name, s.r, s.d_in, s.d_out] for s in self.sites]}

    def save_basis(self, path: str | Path) -> str:
        """Write the fitted basis as safetensors (atomically: temp name, fsync, rename); returns its sha256."""
        if self.basis is None:
            raise RuntimeError("no basis to save: fit it first")
        tensors = {}
        for prefix, src in (("U", self.basis.stage1), ("W", self.basis.stage2), ("E", self.basis.energy)):
            for (name, side), m in src.items():
                tensors[f"{prefix}|{name}|{side}"] = m
        meta = {"schema": BASIS_SCHEMA, "spec": json.dumps(self.basis_spec(), sort_keys=True),
                "examples": str(self.basis.examples)}
        data = _safetensors_bytes(tensors, meta)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Not the index's ".tmp-" prefix: `GradientIndex.open` deletes those as a killed writer's debris.
        tmp = path.with_name(f".basis-tmp-{path.name}.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.basis_sha256 = hashlib.sha256(data).hexdigest()
        return self.basis_sha256

    def load_basis(self, path: str | Path, sha256: Optional[str] = None) -> str:
        """Load a basis written by `save_basis`; ValueError when the file is unreadable, was fitted for other
        settings or sites, or does not match `sha256`. Returns the file's sha256."""
        from safetensors.torch import load

        data = Path(path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if sha256 is not None and digest != sha256:
            raise ValueError(f"{path}: sha256 {digest[:16]}... does not match the expected {sha256[:16]}...")
        try:
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
            tensors = load(data)
        except Exception as e:  # safetensors raises its own error types for a malformed file
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        if meta.get("schema") != BASIS_SCHEMA:
            raise ValueError(f"{path}: schema {meta.get('schema')!r}, expected {BASIS_SCHEMA!r}")
        spec = json.loads(meta.get("spec", "null"))
        if spec != self.basis_spec():
            raise ValueError(f"{path}: fitted for other settings or sites ({spec} vs {self.basis_spec()})")
        basis = Basis(examples=int(meta.get("examples", "0")))
        dest = {"U": basis.stage1, "W": basis.stage2, "E": basis.energy}
        for key, t in tensors.items():
            parts = key.split("|")
            if len(parts) != 3 or parts[0] not in dest:
                raise ValueError(f"{path}: unexpected tensor {key!r}")
            dest[parts[0]][(parts[1], parts[2])] = t
        self.set_basis(basis)
        self.basis_sha256 = digest
        return digest

    # ---------------------------------------------------------------------------------------- describe

    def spec(self) -> Optional[dict]:
        """Settings that determine the projection (the cache key's part); None when exact."""
        if self.k is None:
            return None
        d = {"kind": self.kind, "dim": self.dim, "seed": self.seed, "version": PROJECTION_VERSION}
        if self.kind == "data-aware":
            d.update(scheme="lora-wide-side+site-pca", fit_rows=self.fit_rows, stage2_width=STAGE2_WIDTH)
        else:
            d.update(scheme="lora-wide-side", per_site_k=self.k)
            if self.kind == "sjlt":
                d["sjlt_nnz"] = SJLT_NNZ
        return d

    def describe(self) -> Optional[dict]:
        d = self.spec()
        if d is not None and self.kind == "data-aware" and self.basis is not None:
            d = {**d, "basis_sha256": self.basis_sha256, "fit_examples": self.basis.examples,
                 "site_dims": self.site_dims()}
        return d


def _safetensors_bytes(tensors: dict, metadata: dict) -> bytes:
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


def fit_basis(projector: Projector, batches: Sequence[Sequence[tuple[Tensor, Tensor]]]) -> Basis:
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
