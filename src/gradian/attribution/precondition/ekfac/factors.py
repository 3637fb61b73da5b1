"""The fitted factors: one Linear module's eigenbases and corrected eigenvalues (`ModuleFactors`), the groups of
LoRA sites whose statistics fit memory together, and the store that serves every site's factors, from memory or
from the group files beside the index."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ....grads.layout import SiteShape

SIDES = ("A", "B")  # each LoRA site is two Linear modules: A (d_in -> r) and B (r -> d_out)
DEFAULT_MEMORY_BYTES = 2 << 30  # covariance sums held at a time (float32); more sites than that take more passes


@dataclass
class ModuleFactors:
    """One Linear module's EK-FAC factors: gradient-side and activation-side eigenbases and the corrected
    eigenvalues [d_out, d_in] of its weight."""

    left: np.ndarray  # Q_S [m, m] (output-gradient covariance)
    right: np.ndarray  # Q_C [n, n] (activation covariance)
    lam: np.ndarray  # [m, n] float64


def _site_numel2(s: SiteShape) -> int:
    """Floats of a site's four covariances: A: (r x r) gradient side, (d_in x d_in) activations; B: (d_out x d_out)
    and (r x r)."""
    return s.d_in ** 2 + s.d_out ** 2 + 2 * s.r ** 2


def site_groups(sites: Sequence[SiteShape], memory_bytes: int) -> list[list[int]]:
    """Consecutive sites whose float32 covariance sums fit `memory_bytes` together (a site alone always forms a
    group, however large): one statistics pass per group."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, s in enumerate(sites):
        b = 4 * _site_numel2(s)
        if cur and used + b > memory_bytes:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += b
    if cur:
        groups.append(cur)
    return groups


class FactorStore:
    """The fitted factors of every site, in memory or read site by site from the group files beside the index."""

    def __init__(self, sites: Sequence[SiteShape], memory: Optional[dict] = None,
                 files: Optional[dict[int, Path]] = None):
        self.sites = list(sites)
        self._mem = memory
        self.files = files or {}  # site index -> the safetensors file holding it
        self._lam: dict = {}

    def _read(self, i: int, side: str, what: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.files[i]), framework="numpy") as f:
            return f.get_tensor(f"{i}|{side}|{what}")

    def module(self, i: int, side: str) -> ModuleFactors:
        if self._mem is not None:
            return self._mem[(i, side)]
        return ModuleFactors(self._read(i, side, "left"), self._read(i, side, "right"), self.lam(i, side))

    def lam(self, i: int, side: str) -> np.ndarray:
        if self._mem is not None:
            return self._mem[(i, side)].lam
        if (i, side) not in self._lam:
            self._lam[(i, side)] = self._read(i, side, "lam").astype(np.float64)
        return self._lam[(i, side)]
