"""Parameter-space directions, one per failing item, produced block by block instead of held as one [Q, D_exact] matrix.

A row's score against item k is <u_k, g_row> for a direction u_k in the exact gradient layout (`grads.layout`):
P^T w_k for a projected index (`BackProjected`), e_k + P^T r_k for an exactly re-ranked candidate (`ExactPart` plus a
`BackProjected`). Exact widths reach 4.9M (SmolLM-135M, r 16 on all 7 projections) and 42M (8B): Q such directions in
float64 would be 313 MB / 2.7 GB per 8 items and 10 GB / 86 GB for the 256 items `attribution.max_items` allows. So
a direction is never materialised for all items at once: consumers ask `rows(ks)` for blocks of at most
`block_size(width)` items (float32, at most `DIRECTION_BYTES` per block) and stream the rows they score per block.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..grads.layout import block_slices

DIRECTION_BYTES = 512 << 20  # float32 directions held at once


def block_size(width: int, budget: Optional[int] = None) -> int:
    """Items per block of float32 directions of `width` within `budget` bytes (default `DIRECTION_BYTES`)."""
    return max(1, int((budget or DIRECTION_BYTES) // max(4 * int(width), 1)))


def blocks(n: int, width: int, budget: Optional[int] = None) -> list[list[int]]:
    """[0, n) in consecutive blocks of `block_size(width)` (fixed boundaries: the same blocks every run)."""
    b = block_size(width, budget)
    return [list(range(a, min(n, a + b))) for a in range(0, n, b)]


class Directions:
    """n directions of `width` floats, produced for any subset of items: `rows(ks)` -> float32 [len(ks), width]."""

    n: int
    width: int

    def rows(self, ks: Sequence[int]) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def __add__(self, other: "Directions") -> "Directions":
        return SumDirections(self, other)

    def mean(self) -> "Directions":
        """The one direction that is the mean of all n (accumulated block by block)."""
        return MeanDirections(self)


class ArrayDirections(Directions):
    """Directions already in memory (small widths, tests)."""

    def __init__(self, array: np.ndarray):
        self.array = np.atleast_2d(np.asarray(array))
        self.n, self.width = self.array.shape

    def rows(self, ks):
        return np.asarray(self.array[list(ks)], dtype=np.float32)


class BackProjected(Directions):
    """P^T w_k of index-space directions w [n, dim] (`projection.back_project`), for the items asked only."""

    def __init__(self, projector, w: np.ndarray):
        self.projector = projector
        self.w = np.atleast_2d(np.asarray(w))
        self.n = self.w.shape[0]
        self.width = int(projector.exact_dim)

    def rows(self, ks):
        from ..projection import back_project

        return back_project(self.projector, self.w[list(ks)])


class HarmDirections(Directions):
    """P^T w_k of a `values.Basis`'s harm-signed directions, w_k produced for the items asked only (`Basis.w_rows`):
    `BackProjected(projector, basis.w)` without the [Q, dim] float64 array."""

    def __init__(self, projector, basis):
        self.projector, self.basis = projector, basis
        self.n = basis.n_items
        self.width = int(projector.exact_dim)

    def rows(self, ks):
        from ..projection import back_project
        from .scoring import harm_factor

        if self.projector.exact:  # +-1 times float32: the float64 round trip of `back_project` changes no bit
            return np.float32(harm_factor(self.basis.direction)) * np.asarray(self.basis.unit[list(ks)],
                                                                             dtype=np.float32)
        return back_project(self.projector, self.basis.w_rows(ks))


class ExactPart(Directions):
    """e_k = coef_k x s_b x q_k of the exact re-rank (`attribution.rerank.exact_directions`): q_k the exact query
    gradient of item k, from `queries(ks)` (the model side; it is recomputed per block, never held for all items),
    s_b the preconditioner's identity scale of each LoRA-site block (None: 1). With `unit`, coef_k is
    `coef_k / ||q_k||` (the identity preconditioner scores against the unit exact query)."""

    def __init__(self, queries: Callable[[Sequence[int]], np.ndarray], coef: np.ndarray, widths: Sequence[int],
                 scale: Optional[np.ndarray] = None, unit: bool = False):
        self.queries, self.coef, self.scale, self.unit = queries, np.asarray(coef, dtype=np.float64), scale, unit
        self.widths = [int(x) for x in widths]
        self.n, self.width = self.coef.size, sum(self.widths)

    def rows(self, ks):
        ks = list(ks)
        q = np.asarray(self.queries(ks), dtype=np.float32)
        c = self.coef[ks]
        if self.unit:
            c = c / np.maximum(np.linalg.norm(q, axis=1), 1e-30)
        out = q * c.astype(np.float32)[:, None]
        if self.scale is not None:
            for b, sl in enumerate(block_slices(self.widths)):
                out[:, sl] *= np.float32(self.scale[b])
        return out


class SumDirections(Directions):
    def __init__(self, a: Directions, b: Directions):
        if (a.n, a.width) != (b.n, b.width):
            raise ValueError(f"cannot add directions of shapes {(a.n, a.width)} and {(b.n, b.width)}")
        self.a, self.b, self.n, self.width = a, b, a.n, a.width

    def rows(self, ks):
        return self.a.rows(ks) + self.b.rows(ks)


class MeanDirections(Directions):
    def __init__(self, src: Directions):
        self.src, self.n, self.width = src, 1, src.width
        self._mean: Optional[np.ndarray] = None

    def rows(self, ks):
        if self._mean is None:
            acc = np.zeros(self.width, dtype=np.float64)
            for blk in blocks(self.src.n, self.width):
                acc += self.src.rows(blk).sum(0, dtype=np.float64)
            self._mean = (acc / max(self.src.n, 1)).astype(np.float32)[None, :]
        return np.repeat(self._mean, len(list(ks)), axis=0)


def as_directions(d) -> Directions:
    return d if isinstance(d, Directions) else ArrayDirections(d)
