"""Random projections of a LoRA gradient's wide side: dense Rademacher / Gaussian blocks and the sparse JL transform.

Each kind is a pure function of (kind, seed, site name, side, shapes): reproducible from the manifest, never stored.
Dense matrices are generated in fixed blocks of `BLOCK_ROWS` rows, each from its own seed derived from (seed, site,
side, block): any block can be regenerated alone, so a large d never needs one huge draw. The SJLT (Kane-Nelson
block construction) splits the k outputs into s blocks; every input coordinate hashes to one bucket per block with a
random sign, scaled by 1/sqrt(s), and is applied as a CSR product once k is large enough for that to win.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Optional

import torch
from torch import Tensor

BLOCK_ROWS = 2048  # rows of a dense random matrix generated from one seed
SJLT_NNZ = 4  # nonzeros per input coordinate
SJLT_SPARSE_FROM_K = 128  # from this k on the CSR product beats a dense copy of the SJLT (CPU, measured)
RANDOM_KINDS = ("rademacher", "gaussian", "sjlt")


def _seed_for(seed: int, name: str, side: str, block: Optional[int] = None) -> int:
    tag = f"{seed}:{name}:{side}" + ("" if block is None else f":{block}")
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little") & ((1 << 63) - 1)


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
