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
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..config import ProjectionKind
from ..errors import ConfigError
from ..io import atomic_write_bytes
from ..grads.layout import SiteShape, exact_widths
from .data_aware import BASIS_SCHEMA, STAGE2_WIDTH, Basis, BasisFitter, basis_bytes, stage1_width
from .random import SJLT_NNZ, SJLT_SPARSE_FROM_K, SparseJL, _seed_for, dense_blocks, random_matrix

# Bump when any matrix this module generates changes for the same settings: it is part of spec(), so of the
# index cache key, and an index built with other matrices becomes foreign.
PROJECTION_VERSION = 2
KINDS = tuple(k.value for k in ProjectionKind)
DENSE_CACHE_BYTES = 512 << 20  # dense matrices kept per projector; beyond it blocks are regenerated per call
DEFAULT_FIT_ROWS = 512  # rows the data-aware basis is fitted on (2 capture passes over them)


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
        self.kind, self.seed, self.fit_rows = ProjectionKind(kind), int(seed), int(fit_rows)
        self.requested_dim = dim
        self.exact_dim = sum(exact_widths(self.sites))
        self.k: Optional[int] = None
        self._dim = self.exact_dim
        if dim is not None and dim < self.exact_dim:
            if self.data_aware:
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
    def data_aware(self) -> bool:
        """A data-aware kind: its basis is fitted on training rows (`needs_fit`), not drawn from a seed."""
        return self.kind is ProjectionKind.data_aware

    @property
    def dim(self) -> int:
        return self._dim

    def site(self, name: str) -> SiteShape:
        return self._by_name[name]

    def k1(self, site: SiteShape, side: str = "A") -> int:
        """Data-aware stage-1 width of a side (`data_aware.stage1_width`)."""
        return stage1_width(site, side)

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
        if self.data_aware:
            if self.basis is None:
                raise RuntimeError("data-aware projector: the per-site widths are known once the basis is fitted")
            w = self.basis.stage2
            return tuple(int(w[(site.name, sd)].shape[1]) if (site.name, sd) in w else 0 for sd in ("A", "B"))
        return site.r * self.side_k(site, "A"), site.r * self.side_k(site, "B")

    def site_dims(self) -> list[int]:
        """Width of each site's block; empty for a data-aware projector before its fit (the fit decides them)."""
        if self.data_aware and self.k is not None and self.basis is None:
            return []
        return [sum(self.side_dims(s)) for s in self.sites]

    @property
    def needs_fit(self) -> bool:
        return self.data_aware and self.k is not None and self.basis is None

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
        if self.kind is ProjectionKind.sjlt:
            if self.k >= SJLT_SPARSE_FROM_K:
                return None
            m = self._sjlt(site, side, d).dense()
        else:
            m = random_matrix(d, self.k, kind=self.kind.value, seed=self.seed, name=site.name, side=side)
        return self._remember(key, m.to(device), nbytes)

    def _fitted(self, stage: str, site: SiteShape, side: str, device) -> Optional[Tensor]:
        key = (site.name, side, stage, str(device))
        m = self._cache.get(key)
        if m is None:
            if self.basis is None:
                raise RuntimeError("data-aware projector used before its basis was fitted or loaded "
                                   "(gradian.store.build.ensure_basis does both)")
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
        if not self._projects(site, side) or self.data_aware:
            raise ValueError("matrix() is for the projected sides of random kinds")
        return random_matrix(d, self.k, kind=self.kind.value, seed=self.seed, name=site.name, side=side, device=device)

    def _apply(self, site: SiteShape, side: str, x: Tensor) -> Tensor:
        """Random kinds: x [..., d] @ P [d, k]."""
        d = x.shape[-1]
        m = self._dense(site, side, d, x.device)
        if m is not None:
            return x @ m
        if self.kind is ProjectionKind.sjlt:
            return self._sjlt(site, side, d).apply(x)
        out = None
        for a, b, blk in dense_blocks(self.kind.value, d, self.k, self.seed, site.name, side):
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
        if self.data_aware:
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

    # ------------------------------------------------------------------------------------- data-aware

    def fitter(self) -> BasisFitter:
        """The fitter of this projector's basis (a projecting data-aware projector only)."""
        if not self.data_aware or self.exact:
            raise ValueError("only a projecting data-aware projector is fitted")
        return BasisFitter(self.sites, self._dim)

    def set_basis(self, basis: Basis) -> None:
        """Install a fitted basis after checking every shape against the sites and the budget."""
        if not self.data_aware or self.k is None:
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
        return {"kind": self.kind.value, "dim": self._dim, "seed": self.seed, "fit_rows": self.fit_rows,
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
        data = basis_bytes(tensors, meta)
        # Not the index's ".tmp-" prefix: `GradientIndex.open` deletes those as a killed writer's debris.
        path = Path(path)
        atomic_write_bytes(path, data, tmp_name=f".basis-tmp-{path.name}.{os.getpid()}", durable=False)
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
        d = {"kind": self.kind.value, "dim": self.dim, "seed": self.seed, "version": PROJECTION_VERSION}
        if self.data_aware:
            d.update(scheme="lora-wide-side+site-pca", fit_rows=self.fit_rows, stage2_width=STAGE2_WIDTH)
        else:
            d.update(scheme="lora-wide-side", per_site_k=self.k)
            if self.kind is ProjectionKind.sjlt:
                d["sjlt_nnz"] = SJLT_NNZ
        return d

    def describe(self) -> Optional[dict]:
        d = self.spec()
        if d is not None and self.data_aware and self.basis is not None:
            d = {**d, "basis_sha256": self.basis_sha256, "fit_examples": self.basis.examples,
                 "site_dims": self.site_dims()}
        return d


def back_project(projector: Projector, w) -> np.ndarray:
    """Index-space directions w [K, dim] -> parameter-space directions [K, D_exact] (float32) with
    <w, P(g)> = <P^T w, g>, by differentiating the projector site by site. The identity for an exact projector.

    A data-aware fit may give a site, or one side of a site, no width: nothing of it is in the index, so its part of
    P^T w is zero (`allow_unused`: the side's input never reaches the output)."""
    w = np.atleast_2d(np.asarray(w))
    if projector.exact:
        return w.astype(np.float32)
    out = np.zeros((w.shape[0], projector.exact_dim), dtype=np.float32)
    a = off = 0
    wt = torch.as_tensor(np.ascontiguousarray(w, dtype=np.float32))
    for i, (s, dim) in enumerate(zip(projector.sites, projector.site_dims())):
        na, nb = s.r * s.d_in, s.d_out * s.r
        if dim:
            dA = torch.zeros(w.shape[0], s.r, s.d_in, requires_grad=True)
            dB = torch.zeros(w.shape[0], s.d_out, s.r, requires_grad=True)
            with torch.enable_grad():
                z = projector.project(i, dA, dB)
                ga, gb = torch.autograd.grad((z * wt[:, a : a + dim]).sum(), (dA, dB), allow_unused=True)
            if ga is not None:
                out[:, off : off + na] = ga.reshape(w.shape[0], na).numpy()
            if gb is not None:
                out[:, off + na : off + na + nb] = gb.reshape(w.shape[0], nb).numpy()
        a += dim
        off += na + nb
    return out
