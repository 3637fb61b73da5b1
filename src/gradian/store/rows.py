"""Training gradients read back in row chunks, from an open `GradientIndex` or an in-memory array.

What every statistic over the index streams from (preconditioners, clusters, baselines, scoring): at most
`chunk_rows` rows are held at a time, so memory does not grow with rows x width.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

from ..distributed import current, ordered_sum, run_owned

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
        """float32 [Q, n] = dirs @ rows.T: `GradientIndex.score` over the row keys, or one matmul of the array.

        Under torchrun the index's score blocks are dealt out (block j to rank j % N) and gathered: each block is
        the matmul one process does, so every rank gets one process's bits, having read 1/N of the index."""
        if self.index is not None:
            if not current().active or self.n == 0:
                return self.index.score(dirs, self.row_keys)
            br = self.index.score_block_rows()
            spans = [(a, min(self.n, a + br)) for a in range(0, self.n, br)]
            got = run_owned(len(spans), lambda j: self.index.score(dirs, self.row_keys[spans[j][0]:spans[j][1]]))
            return np.concatenate([got[j] for j in range(len(spans))], axis=-1)
        return np.asarray(dirs, dtype=np.float32) @ np.asarray(self.array, dtype=np.float32).T

    def sum_chunks(self, fn, start: np.ndarray) -> np.ndarray:
        """start + fn(chunk 0) + fn(chunk 1) + ..., added in chunk order (a statistic over the rows, such as the
        diagonal preconditioner's second moment). Under torchrun chunk c is rank c % N's and the partial results
        are added in chunk order on every rank (`distributed.ordered_sum`): one process's bits."""
        ranks = current()
        if not ranks.active:
            acc = start
            for _, _, rows in self.chunks():
                acc = acc + fn(rows)
            return acc
        spans = self.bounds()
        return ordered_sum({c: fn(self.read(a, b)) for c, (a, b) in enumerate(spans) if ranks.owns(c)},
                           len(spans), start=start)

    def row_norms(self, weights: Optional[np.ndarray] = None) -> np.ndarray:
        """float64 [n]: sqrt(sum_j w_j g_ij^2) of every row (w = 1: the Euclidean norm), streamed in chunks. Under
        torchrun chunk c is rank c % N's and the chunks are gathered in order (one process's bits)."""
        w = None if weights is None else np.asarray(weights, dtype=np.float64)

        def norms(rows: np.ndarray) -> np.ndarray:
            sq = np.square(rows)
            return np.sqrt((sq @ w) if w is not None else sq.sum(1))

        spans = self.bounds()
        got = run_owned(len(spans), lambda c: norms(self.read(*spans[c])))
        parts = [got[c] for c in range(len(spans))]
        return np.concatenate(parts) if parts else np.zeros(0)

    def subset(self, positions: Sequence[int]) -> "RowSource":
        """The rows at `positions` (in that order) as a source of their own."""
        pos = [int(p) for p in positions]
        if self.index is not None:
            return RowSource(index=self.index, row_keys=[self.row_keys[p] for p in pos])
        return RowSource(self.array[pos])


class FileRows(RowSource):
    """Rows of a raw float32 file ([rows, dim], row-major), read chunk by chunk (`os.pread`: nothing is mapped, so
    nothing read stays in the process's memory): the one pass's held rows, which are the size of its budget and
    must not be held in memory. `slots` picks and orders rows of the file (default: all, in file order).

    Chunks and statistics are exactly those of a `RowSource` over the same rows in memory (the same chunk bounds),
    so a preconditioner fitted on either has the same bits; `inner` multiplies float32 blocks of at most
    `inner_bytes` (one block, the plain matmul, when the rows fit)."""

    def __init__(self, path, dim: int, slots: Optional[Sequence[int]] = None, *, n_file: Optional[int] = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, inner_bytes: int = DEFAULT_MEMORY_BYTES):
        import os

        self.path = str(path)
        self.array, self.index, self.row_keys = None, None, None
        self.dim = int(dim)
        if n_file is None:
            n_file = os.path.getsize(self.path) // max(4 * self.dim, 1)
        self.slots = list(range(n_file)) if slots is None else [int(s) for s in slots]
        self.n = len(self.slots)
        self.chunk_rows = max(1, int(memory_bytes // max(8 * self.dim, 1)))
        self.inner_rows = max(1, int(inner_bytes // max(4 * self.dim, 1)))
        self.reads = 0

    def read32(self, a: int, b: int) -> np.ndarray:
        """float32 rows a..b (in `slots` order)."""
        import os

        out = np.empty((b - a, self.dim), dtype=np.float32)
        row_bytes = 4 * self.dim
        fd = os.open(self.path, os.O_RDONLY)
        try:
            j = a
            while j < b:  # runs of consecutive slots are one read
                k = j + 1
                while k < b and self.slots[k] == self.slots[k - 1] + 1:
                    k += 1
                buf = os.pread(fd, row_bytes * (k - j), self.slots[j] * row_bytes)
                if len(buf) != row_bytes * (k - j):
                    raise OSError(f"{self.path}: short read (rows {self.slots[j]}..{self.slots[k - 1]})")
                out[j - a : k - a] = np.frombuffer(buf, dtype="<f4").reshape(k - j, self.dim)
                j = k
        finally:
            os.close(fd)
        return out

    def read(self, a: int, b: int) -> np.ndarray:
        self.reads += 1
        return self.read32(a, b).astype(np.float64)

    def inner(self, dirs: np.ndarray) -> np.ndarray:
        d = np.asarray(dirs, dtype=np.float32)
        out = np.empty((d.shape[0], self.n), dtype=np.float32)
        for a in range(0, self.n, self.inner_rows):
            b = min(self.n, a + self.inner_rows)
            out[:, a:b] = d @ self.read32(a, b).T
        return out

    def subset(self, positions: Sequence[int]) -> "FileRows":
        return FileRows(self.path, self.dim, [self.slots[int(p)] for p in positions], n_file=0,
                        memory_bytes=self.chunk_rows * 8 * self.dim, inner_bytes=self.inner_rows * 4 * self.dim)
