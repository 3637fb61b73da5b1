"""LoRA-aware projection: keep the rank-r side of each LoRA gradient exact, project only the wide side.

A LoRA site's per-example gradient is dA (r x d_in) and dB (d_out x r). Projecting d_in and d_out down to k keeps
the r x k and k x r blocks, a per-site width of 2 r k (a side whose width is already <= k stays exact). The
projected inner product is  sum_sites <dA P_A, dA' P_A> + <P_B^T dB, P_B^T dB'>.

Kinds of P (d x k, one per site and side):

* ``rademacher``, ``gaussian``: dense random entries scaled by 1/sqrt(k), so E[P P^T] = I and projected inner
  products are unbiased. Generated in fixed blocks of ``BLOCK_ROWS`` rows, each from its own seed derived from
  (seed, site, side, block), so any block can be regenerated alone and a large d never needs one huge draw.
* ``sjlt``: a sparse JL transform (Kane-Nelson block construction). The k outputs are split into s blocks; each
  input coordinate hashes to one bucket in every block with a random sign, scaled by 1/sqrt(s): s nonzeros per
  input coordinate, E[P P^T] = I. Stored as (bucket, sign) per coordinate and applied as a CSR sparse matmul.
* ``data-aware``: P holds the top-k singular directions of the training gradients' wide side at that site (top
  right singular vectors of the stacked dA rows [n r, d_in]; top left singular vectors of the stacked dB columns
  [d_out, n r]), fitted deterministically on a seeded sample of training rows (see `BasisFitter`), stored next to
  the index (`save_basis`/`load_basis`, safetensors, sha256 in the index meta). It keeps the energy the
  gradients actually have instead of a random slice of it, so far fewer dims give the same ranking. It is biased
  (it drops the residual), which rankings tolerate far better than variance.

The random kinds are a pure function of (kind, seed, site name, side, shapes): reproducible from the manifest
and never stored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .errors import ConfigError

# Bump when any matrix this module generates changes for the same settings: it is part of describe(), so of
# the index cache key, and an index built with other matrices becomes foreign.
PROJECTION_VERSION = 2
KINDS = ("rademacher", "gaussian", "sjlt", "data-aware")
RANDOM_KINDS = ("rademacher", "gaussian", "sjlt")
BLOCK_ROWS = 2048  # rows of a dense random matrix generated from one seed
SJLT_NNZ = 4  # nonzeros per input coordinate
DENSE_CACHE_BYTES = 512 << 20  # dense matrices kept per projector; beyond it blocks are regenerated per call
SJLT_SPARSE_FROM_K = 128  # from this k on the CSR product beats a dense copy of the SJLT (CPU, measured)
DEFAULT_FIT_ROWS = 256
BASIS_FILE = "projection_basis.safetensors"
BASIS_SCHEMA = "gradian.projection_basis/1"
SKETCH_ROWS = 512  # Frequent Directions sketch size for a wide side whose d exceeds it (d x d Gram below)


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


class _SideFit:
    """Second moment of the rows of one wide side: exact Gram when d <= SKETCH_ROWS, else a Frequent
    Directions sketch of SKETCH_ROWS rows (deterministic; B^T B approximates the Gram within ||A - A_k||^2 /
    (l - k), far below what the top k directions need). float64 on CPU."""

    def __init__(self, d: int, sketch_rows: int = SKETCH_ROWS):
        self.d = d
        self.rows_seen = 0
        if d <= sketch_rows:
            self.gram: Optional[Tensor] = torch.zeros(d, d, dtype=torch.float64)
            self.buf = None
        else:
            self.gram = None
            self.l = sketch_rows
            self.buf = torch.zeros(2 * sketch_rows, d, dtype=torch.float64)
            self.fill = 0

    def update(self, rows: Tensor) -> None:
        rows = rows.detach().to("cpu", torch.float64).reshape(-1, self.d)
        self.rows_seen += rows.shape[0]
        if self.gram is not None:
            self.gram += rows.T @ rows
            return
        for a in range(0, rows.shape[0], self.l):
            part = rows[a : a + self.l]
            if self.fill + part.shape[0] > self.buf.shape[0]:
                self._shrink()
            self.buf[self.fill : self.fill + part.shape[0]] = part
            self.fill += part.shape[0]

    def _shrink(self) -> None:
        _, s, vt = torch.linalg.svd(self.buf[: self.fill], full_matrices=False)
        delta = s[self.l] ** 2 if s.numel() > self.l else s.new_zeros(())
        s2 = torch.clamp(s[: self.l] ** 2 - delta, min=0.0).sqrt()
        n = s2.numel()
        self.buf.zero_()
        self.buf[:n] = s2[:, None] * vt[:n]
        self.fill = self.l

    def top(self, k: int) -> tuple[Tensor, Tensor]:
        """Top-k directions [d, k] (float32, orthonormal columns, deterministic signs) and their energies [k]."""
        if self.gram is not None:
            evals, evecs = torch.linalg.eigh(self.gram)
            evals, evecs = evals.flip(0), evecs.flip(1)
        else:
            _, s, vt = torch.linalg.svd(self.buf[: self.fill], full_matrices=False)
            evals, evecs = s**2, vt.T
        k = min(k, evecs.shape[1])
        u = evecs[:, :k].clone()
        # Sign convention: the largest-magnitude entry of each direction is positive (first one on ties).
        piv = u.abs().argmax(0)
        sign = torch.sign(u[piv, torch.arange(k)])
        sign[sign == 0] = 1.0
        u *= sign
        return u.float().contiguous(), evals[:k].clamp(min=0.0).float()


class BasisFitter:
    """Accumulates per-example site gradients (dA [B, r, d_in], dB [B, d_out, r]) and yields the data-aware basis
    of a projector: feed `update(i, dA, dB)` for every site of every batch, then `projector.set_basis(fitter
    .finish())`. The result depends only on the rows fed and their order (float64 accumulation on CPU)."""

    def __init__(self, projector: "Projector"):
        self.projector = projector
        self.sides: dict[tuple[str, str], _SideFit] = {}
        self.examples = 0
        for s in projector.sites:
            for side, d in (("A", s.d_in), ("B", s.d_out)):
                if projector.side_k(s, side) < d:
                    self.sides[(s.name, side)] = _SideFit(d)

    def update(self, i: int, dA: Tensor, dB: Tensor) -> None:
        s = self.projector.sites[i]
        if i == 0:
            self.examples += dA.shape[0]
        fa = self.sides.get((s.name, "A"))
        if fa is not None:
            fa.update(dA.reshape(-1, s.d_in))  # rows of dA
        fb = self.sides.get((s.name, "B"))
        if fb is not None:
            fb.update(dB.transpose(1, 2).reshape(-1, s.d_out))  # columns of dB

    def update_all(self, per_site: Sequence[tuple[Tensor, Tensor]]) -> None:
        for i, (dA, dB) in enumerate(per_site):
            self.update(i, dA, dB)

    def finish(self) -> "Basis":
        mats, energy = {}, {}
        for s in self.projector.sites:
            for side in ("A", "B"):
                fit = self.sides.get((s.name, side))
                if fit is None:
                    continue
                u, e = fit.top(self.projector.side_k(s, side))
                mats[(s.name, side)] = u
                energy[(s.name, side)] = e
        return Basis(mats, energy, self.examples)


@dataclass
class Basis:
    """Fitted data-aware matrices per (site, side): [d, k] with orthonormal columns, plus their energies."""

    mats: dict
    energy: dict
    examples: int


# -------------------------------------------------------------------------------------------- projector


class Projector:
    """Maps per-site (dA, dB) per-example gradients to one flat vector; exact (identity) when dim is None.

    `dim` is a budget: each site side gets k = dim // (sum over sites of 2 r) wide-side directions (a side no
    wider than k stays exact), so the width is at most `dim`. A budget under the minimum, sum of 2 r (one
    direction per side), is an error that says so rather than a silent round-up.
    """

    def __init__(self, sites: Sequence[SiteShape], dim: Optional[int] = None, kind: str = "rademacher", seed: int = 0,
                 *, fit_rows: int = DEFAULT_FIT_ROWS):
        if kind not in KINDS:
            raise ConfigError(f"grads.projection_kind: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        self.sites = list(sites)
        self.kind, self.seed, self.fit_rows = kind, int(seed), int(fit_rows)
        self.requested_dim = dim
        min_width = sum(2 * s.r for s in self.sites)
        if dim is None:
            self.k: Optional[int] = None
        else:
            if dim < min_width:
                raise ConfigError(
                    f"grads.projection_dim={dim} is below the narrowest LoRA-aware projection of these "
                    f"{len(self.sites)} LoRA sites: {min_width} dims (2 x rank per site: one wide-side direction for "
                    f"A and one for B, the rank side kept exact). Set grads.projection_dim >= {min_width}, capture "
                    "fewer sites with grads.module_filter, or leave projection_dim unset for exact gradients."
                )
            self.k = dim // min_width
        self._cache: dict = {}
        self._cache_bytes = 0
        self.basis: Optional[Basis] = None
        self.basis_sha256: Optional[str] = None

    # ------------------------------------------------------------------------------------------ shapes

    @property
    def exact(self) -> bool:
        return self.k is None

    def side_k(self, site: SiteShape, side: str) -> int:
        """Width kept on one wide side (its full width when not projected)."""
        d = site.d_in if side == "A" else site.d_out
        return d if self.k is None else min(self.k, d)

    def _projects(self, site: SiteShape, side: str) -> bool:
        d = site.d_in if side == "A" else site.d_out
        return self.k is not None and self.k < d

    def site_dims(self) -> list[int]:
        return [s.r * (self.side_k(s, "A") + self.side_k(s, "B")) for s in self.sites]

    @property
    def dim(self) -> int:
        return sum(self.site_dims())

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
        """The whole [d, k] matrix when it fits the cache (or is fitted), else None (apply block by block)."""
        key = (site.name, side, str(device))
        m = self._cache.get(key)
        if m is not None:
            return m
        if self.kind == "data-aware":
            if self.basis is None:
                raise RuntimeError("data-aware projector used before its basis was fitted or loaded "
                                   "(gradian.indexing.ensure_basis does both)")
            return self._remember(key, self.basis.mats[(site.name, side)].to(device), 0)
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

    def matrix(self, i: int, side: str, device=None) -> Tensor:
        """The [d, k] matrix of site i's side "A" or "B" (materialised; for tests and inspection)."""
        site = self.sites[i]
        d = site.d_in if side == "A" else site.d_out
        if not self._projects(site, side):
            return torch.eye(d, device=device)
        if self.kind == "data-aware":
            return self._dense(site, side, d, device or "cpu")
        return random_matrix(d, self.k, kind=self.kind, seed=self.seed, name=site.name, side=side, device=device)

    def _apply(self, site: SiteShape, side: str, x: Tensor) -> Tensor:
        """x [..., d] @ P [d, k]."""
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

    # ---------------------------------------------------------------------------------------- project

    def project(self, i: int, dA: Tensor, dB: Tensor) -> Tensor:
        """dA [B, r, d_in], dB [B, d_out, r] (float32) -> [B, site_dim]."""
        site = self.sites[i]
        pa = self._apply(site, "A", dA) if self._projects(site, "A") else dA  # [B, r, k]
        if self._projects(site, "B"):
            pb = self._apply(site, "B", dB.transpose(1, 2)).transpose(1, 2)  # P^T dB: [B, k, r]
        else:
            pb = dB
        return torch.cat([pa.flatten(1), pb.flatten(1)], dim=1)

    def project_inputs(self, i: int, x: Tensor, gh: Tensor, h: Tensor, gz: Tensor) -> Tensor:
        """The same vector as `project(i, dA, dB)` with dA = sum_t gh_t x_t^T and dB = sum_t gz_t h_t^T, computed
        by projecting the wide inputs first: (sum_t gh_t x_t^T) P = sum_t gh_t (P^T x_t)^T. x [B, T, d_in],
        gh [B, T, r], h [B, T, r], gz [B, T, d_out]. Cheaper than the outer product when k < r or T is short."""
        site = self.sites[i]
        x, gh, h, gz = x.float(), gh.float(), h.float(), gz.float()
        xa = self._apply(site, "A", x) if self._projects(site, "A") else x
        zb = self._apply(site, "B", gz) if self._projects(site, "B") else gz
        pa = torch.einsum("btr,btk->brk", gh, xa)
        pb = torch.einsum("btk,btr->bkr", zb, h)
        return torch.cat([pa.flatten(1), pb.flatten(1)], dim=1)

    # ------------------------------------------------------------------------------------- data-aware

    def fitter(self) -> BasisFitter:
        return BasisFitter(self)

    def set_basis(self, basis: Basis) -> None:
        for s in self.sites:
            for side, d in (("A", s.d_in), ("B", s.d_out)):
                if not self._projects(s, side):
                    continue
                m = basis.mats.get((s.name, side))
                if m is None or tuple(m.shape) != (d, self.k):
                    raise ValueError(f"basis for {s.name}/{side} is {None if m is None else tuple(m.shape)}, "
                                     f"expected {(d, self.k)}")
        self.basis = basis
        self._cache, self._cache_bytes = {}, 0

    def basis_spec(self) -> dict:
        """What a stored basis must have been fitted for."""
        return {"kind": self.kind, "k": self.k, "seed": self.seed, "fit_rows": self.fit_rows,
                "version": PROJECTION_VERSION,
                "sites": [[s.name, s.r, s.d_in, s.d_out] for s in self.sites]}

    def save_basis(self, path: str | Path) -> str:
        """Write the fitted basis as safetensors (atomically: temp name, fsync, rename); returns its sha256."""
        from safetensors.torch import save

        if self.basis is None:
            raise RuntimeError("no basis to save: fit it first")
        tensors = {}
        for (name, side), m in self.basis.mats.items():
            tensors[f"{name}|{side}"] = m.detach().cpu().float().contiguous()
            tensors[f"{name}|{side}|energy"] = self.basis.energy[(name, side)].detach().cpu().float().contiguous()
        meta = {"schema": BASIS_SCHEMA, "spec": json.dumps(self.basis_spec(), sort_keys=True),
                "examples": str(self.basis.examples)}
        data = save(tensors, metadata=meta)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".basis-tmp-{path.name}.{os.getpid()}")  # not ".tmp-": the index removes those
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
        mats, energy = {}, {}
        for key, t in tensors.items():
            parts = key.split("|")
            if len(parts) == 2:
                mats[(parts[0], parts[1])] = t
            elif len(parts) == 3 and parts[2] == "energy":
                energy[(parts[0], parts[1])] = t
        self.set_basis(Basis(mats, energy, int(meta.get("examples", "0"))))
        self.basis_sha256 = digest
        return digest

    # ---------------------------------------------------------------------------------------- describe

    def spec(self) -> Optional[dict]:
        """Settings that determine the projection (the cache key's part); None when exact."""
        if self.k is None:
            return None
        d = {"kind": self.kind, "dim": self.dim, "per_site_k": self.k, "seed": self.seed, "scheme": "lora-wide-side",
             "version": PROJECTION_VERSION}
        if self.kind == "sjlt":
            d["sjlt_nnz"] = SJLT_NNZ
        if self.kind == "data-aware":
            d["fit_rows"] = self.fit_rows
        return d

    def describe(self) -> Optional[dict]:
        d = self.spec()
        if d is not None and self.kind == "data-aware" and self.basis_sha256:
            d = {**d, "basis_file": BASIS_FILE, "basis_sha256": self.basis_sha256, "fit_examples": self.basis.examples}
        return d


def fit_basis(projector: Projector, batches: Iterable[Sequence[tuple[Tensor, Tensor]]]) -> Basis:
    """Fit (and set) a data-aware projector's basis from per-site exact gradients, one list per batch."""
    f = projector.fitter()
    for per_site in batches:
        f.update_all(per_site)
    basis = f.finish()
    projector.set_basis(basis)
    return basis
