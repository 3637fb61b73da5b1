"""LoRA-aware random projection: keep the rank-r side of each LoRA gradient exact, project only the wide side.

A LoRA site's gradient is dA (r x d_in) and dB (d_out x r). Projecting d_in and d_out down to k keeps the
r x k and k x r blocks, a per-site width of 2 r k. Each matrix is generated from (seed, site, side), so it is
reproducible from the manifest and never stored.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class SiteShape:
    name: str
    r: int
    d_in: int
    d_out: int


def _seed_for(seed: int, name: str, side: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}:{side}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_matrix(rows: int, cols: int, *, kind: str, seed: int, device=None) -> Tensor:
    """rows x cols with E[P P^T] = I (entries scaled by 1/sqrt(cols))."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        m = torch.randn(rows, cols, generator=g)
    elif kind == "rademacher":
        m = torch.randint(0, 2, (rows, cols), generator=g).float().mul_(2).sub_(1)
    elif kind == "sjlt":
        # Sparse JL: one +-1 per input coordinate per column block of size cols/s (s = 4 nonzeros per row).
        s = min(4, cols)
        m = torch.zeros(rows, cols)
        buckets = torch.randint(0, cols // s if cols >= s else 1, (rows, s), generator=g)
        signs = torch.randint(0, 2, (rows, s), generator=g).float().mul_(2).sub_(1)
        block = max(cols // s, 1)
        for j in range(s):
            m[torch.arange(rows), (j * block + buckets[:, j]).clamp_max(cols - 1)] += signs[:, j]
        m.mul_((cols / s) ** 0.5)
    else:
        raise ValueError(f"unknown projection kind {kind!r}")
    return (m / cols**0.5).to(device) if device is not None else m / cols**0.5


class Projector:
    """Maps per-site (dA, dB) per-example gradients to one flat vector; exact (identity) when dim is None."""

    def __init__(self, sites: Sequence[SiteShape], dim: Optional[int] = None, kind: str = "rademacher", seed: int = 0):
        self.sites = list(sites)
        self.kind, self.seed = kind, seed
        total_r = sum(2 * s.r for s in self.sites)
        if dim is None:
            self.k = None
        else:
            self.k = max(1, dim // total_r)
        self._cache: dict[tuple[str, str], Tensor] = {}

    @property
    def exact(self) -> bool:
        return self.k is None

    def site_dims(self) -> list[int]:
        return [
            s.r * (s.d_in + s.d_out) if self.k is None or self.k >= max(s.d_in, s.d_out) else 2 * s.r * self.k
            for s in self.sites
        ]

    @property
    def dim(self) -> int:
        return sum(self.site_dims())

    def _matrix(self, site: SiteShape, side: str, d: int, device) -> Tensor:
        key = (site.name, side)
        m = self._cache.get(key)
        if m is None or m.device != device:
            m = random_matrix(d, self.k, kind=self.kind, seed=_seed_for(self.seed, site.name, side), device=device)
            self._cache[key] = m
        return m

    def project(self, i: int, dA: Tensor, dB: Tensor) -> Tensor:
        """dA [B, r, d_in], dB [B, d_out, r] (float32) -> [B, site_dim]."""
        site = self.sites[i]
        if self.k is None or self.k >= max(site.d_in, site.d_out):
            return torch.cat([dA.flatten(1), dB.flatten(1)], dim=1)
        pa = dA @ self._matrix(site, "A", site.d_in, dA.device)  # [B, r, k]
        pb = self._matrix(site, "B", site.d_out, dB.device).T @ dB  # [B, k, r]
        return torch.cat([pa.flatten(1), pb.flatten(1)], dim=1)

    def describe(self) -> Optional[dict]:
        if self.k is None:
            return None
        return {"kind": self.kind, "dim": self.dim, "per_site_k": self.k, "seed": self.seed, "scheme": "lora-wide-side"}
