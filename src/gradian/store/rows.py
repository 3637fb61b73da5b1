"""Training gradients read back in row chunks, from an open `GradientIndex` or an in-memory array.

What every statistic over the index streams from (preconditioners, clusters, baselines, scoring): at most
`chunk_rows` rows are held at a time, so memory does not grow with rows x width.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

DEFAULT_MEMORY_BYTES = 1 << 28


class RowSource:
    """Training gradients in row chunks (float64): from an in-memory array or from a `GradientIndex` and the
    row keys of the training set (a key listed twice, a duplicated row, counts twice, as it did in training)."""

    def __init__(self, array: Optional[np.ndarray] = None, *, index=None, row_keys: Optional[Sequence[str]] = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES):
        if (array is None) == (index is None):
            raise ValueError("RowSource needs an array or an index with row keys")
        self.array = None if array is None else np.asarray(array)
        self.index = index
        self.row_keys = list(row_keys) if row_keys is not None else None
        self.n = self.array.shape[0] if self.array is not None else len(self.row_keys)
        self.dim = self.array.shape[1] if self.array is not None else int(index.dim)
        self.chunk_rows = max(1, int(memory_bytes // max(8 * self.dim, 1)))
        self.reads = 0  # chunks read, for tests and logs

    def bounds(self) -> list[tuple[int, int]]:
        return [(a, min(self.n, a + self.chunk_rows)) for a in range(0, self.n, self.chunk_rows)]

    def read(self, a: int, b: int) -> np.ndarray:
        self.reads += 1
        if self.array is not None:
            return np.asarray(self.array[a:b], dtype=np.float64)
        return self.index.rows(self.row_keys[a:b]).astype(np.float64)

    def chunks(self) -> Iterator[tuple[int, int, np.ndarray]]:
        for a, b in self.bounds():
            yield a, b, self.read(a, b)

    def inner(self, dirs: np.ndarray) -> np.ndarray:
        """float32 [Q, n] = dirs @ rows.T: `GradientIndex.score` over the row keys, or one matmul of the array."""
        if self.index is not None:
            return self.index.score(dirs, self.row_keys)
        return np.asarray(dirs, dtype=np.float32) @ np.asarray(self.array, dtype=np.float32).T

    def subset(self, positions: Sequence[int]) -> "RowSource":
        """The rows at `positions` (in that order) as a source of their own."""
        pos = [int(p) for p in positions]
        if self.index is not None:
            return RowSource(index=self.index, row_keys=[self.row_keys[p] for p in pos])
        return RowSource(self.array[pos])
