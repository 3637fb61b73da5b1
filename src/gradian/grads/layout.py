"""The flat layout of a LoRA gradient vector: one block per LoRA site, in site order, each the row-major dA
[r, d_in] followed by the row-major dB [d_out, r].

This is the exact layout of an unprojected index row and of every parameter-space direction (preconditioner
blocks, exact re-ranking, forward-mode tangents). A projected index keeps the site blocks (narrower:
`Projector.site_dims`) so its per-site structure is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SiteShape:
    name: str
    r: int
    d_in: int
    d_out: int

    @property
    def numel(self) -> int:
        return self.r * (self.d_in + self.d_out)


def site_shapes(sites) -> list[SiteShape]:
    """The shapes of LoRA sites (anything with name, r, d_in, d_out)."""
    return [SiteShape(s.name, s.r, s.d_in, s.d_out) for s in sites]


def exact_widths(sites) -> list[int]:
    return [s.r * (s.d_in + s.d_out) for s in sites]


def block_slices(block_dims: Sequence[int]) -> list[slice]:
    out, a = [], 0
    for d in block_dims:
        out.append(slice(a, a + int(d)))
        a += int(d)
    return out


def expand(per_block, widths: Sequence[int]) -> np.ndarray:
    """One value per block -> one per coordinate (float64)."""
    return np.repeat(np.asarray(per_block, dtype=np.float64), np.asarray(widths, dtype=np.int64))


def split_directions(sites, vec):
    """[K, D_exact] (this layout) -> per site (U_A [K, r, d_in], U_B [K, d_out, r]) float32 tensors."""
    import torch

    v = torch.as_tensor(np.asarray(vec, dtype=np.float32)) if not isinstance(vec, torch.Tensor) else vec.float()
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
