"""On-disk gradient index: one float vector of width `dim` per training row, keyed by the row's content hash.

Layout of ``root/``::

    manifest.json            schema, cache key, caller meta, dim, storage dtype, and per shard: file, rows,
                             bytes, sha256, norms (half types), row keys
    shard-00000.npy          (rows, dim) float32 | float16 | uint16 (the bits of bfloat16)
    shard-00000.norms.npy    (rows,) float32, half types only: a stored row is `unit * norm`
    .lock                    flock held by the one process that has the index open; holds that process's pid

Rows are keyed by content hash rather than position so that a reordered or extended dataset reuses what is
already stored: callers ask `missing()` and compute only those rows.

Crash safety rests on two rules: a file gets its final name only once it is complete and fsynced (temp name in
the same directory, then `os.replace`), and a shard counts only once a manifest naming it has been replaced the
same way. So whatever a SIGKILL leaves behind is either a finished shard the manifest names, or debris (temp
files, shards the manifest does not name) that `open` removes; a rerun recomputes only the lost rows, and since
encoding is deterministic the result is bit-identical to an uninterrupted build.

Not thread-safe: one `GradientIndex` object per thread, one process per index (the lock enforces the latter).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..io import atomic_write
from .encoding import STORAGE_DTYPES, as_float32, encode
from .lock import LOCK_FILE, IndexLocked, Lock
from .manifest import MANIFEST, SCHEMA, short
from .opening import TMP_PREFIX, IndexMismatch, Spec, find_for_writing, find_read_only
from .reading import ShardReader

log = logging.getLogger(__name__)

__all__ = ["GradientIndex", "IndexLocked", "IndexMismatch", "SCHEMA", "STORAGE_DTYPES"]

SCORE_BLOCK_BYTES = 256 << 20  # float32 rows `score` decodes at once, at most (4096 exact rows at 4.9M dims: 80 GB)
ON_MISMATCH = ("rebuild", "refuse")


def _atomic_write(directory: Path, name: str, write) -> tuple[str, int]:
    """Write `directory/name` under a `TMP_PREFIX` temporary name (what `open` removes as a killed writer's debris)."""
    return atomic_write(directory / name, write, tmp_name=f"{TMP_PREFIX}{name}.{os.getpid()}")


class GradientIndex(ShardReader):
    """A sharded, checksummed, resumable store of float32 rows keyed by content hash. Use `GradientIndex.open`."""

    # ------------------------------------------------------------------------------------------- opening

    def __init__(self) -> None:  # pragma: no cover - guard against direct construction
        raise TypeError("use GradientIndex.open(root, key=..., dim=...)")

    @classmethod
    def open(
        cls,
        root: Path | str,
        *,
        key: str,
        dim: int,
        storage_dtype: str = "float32",
        meta: Optional[dict] = None,
        shard_rows: int = 256,
        on_mismatch: str = "rebuild",
        lock_timeout: float = 600.0,
        verify: bool = True,
        read_only: bool = False,
    ) -> "GradientIndex":
        """Open or create the index at `root`, holding its lock until `close()`.

        An existing index built for another key, dim or storage dtype, or whose manifest is unreadable, is
        moved aside to a sibling directory (`on_mismatch="rebuild"`, with a warning naming it) or rejected with
        `IndexMismatch` (`"refuse"`). Shards that are missing, truncated or fail their sha256 are deleted and
        their rows become `missing()` again ("rebuild"), or rejected ("refuse"). Crash debris (temp files,
        shards the manifest does not name) is removed in both modes. `verify=False` skips the sha256 pass
        (sizes and headers are still checked) for callers that verified the same files moments ago.
        `meta`, when given, replaces the stored meta; the key alone decides whether rows are reusable.
        `read_only` (the ranks of a torchrun job reading the index rank 0 sealed): a shared lock, nothing removed
        or rewritten, and any problem is an `IndexMismatch` (as with "refuse").
        """
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
        if shard_rows < 1:
            raise ValueError("shard_rows must be >= 1")
        if meta is not None:
            if not isinstance(meta, dict):
                raise ValueError("meta must be a dict")
            meta = json.loads(json.dumps(meta))  # fails early on non-JSON values; detaches from the caller

        root = Path(root).absolute()
        root.mkdir(parents=True, exist_ok=True)
        self = cls.__new__(cls)
        self._root = root
        self._key = key
        self._dim = int(dim)
        self._dtype = storage_dtype
        self._meta: dict = meta if meta is not None else {}
        self._shard_rows = int(shard_rows)
        self._shards: list[dict] = []
        self._where: dict[str, tuple[int, int]] = {}
        self._next_shard = 0
        self._pend_keys: list[str] = []
        self._pend_vecs: list[np.ndarray] = []
        self._pend_set: set[str] = set()
        self._read_only = bool(read_only)
        self._lock: Optional[Lock] = Lock(root / LOCK_FILE, lock_timeout, shared=self._read_only)
        try:
            spec = Spec(root, key, self._dim, storage_dtype)
            found = find_read_only(spec, verify) if self._read_only else find_for_writing(spec, on_mismatch, verify, meta)
            self._meta = found.meta
            for entry in found.shards:
                self._append_shard(entry)
            self._next_shard = found.next_shard
            if found.rewrite:
                self._write_manifest()
        except BaseException:
            self._lock.release()
            self._lock = None
            raise
        return self

    # -------------------------------------------------------------------------------- shards of other writers

    def adopt(self, part: Path | str, *, origin: Optional[str] = None) -> int:
        """Take over the sealed shards of another index of the same key (a torchrun rank's part, `root/parts/...`):
        each is renamed into this index under the next shard number, its manifest entry (rows, sha256, keys) kept
        and marked with `origin`, then the part is removed. Rows this index already holds are dropped. Returns the
        rows adopted. Crash-safe like a build: a shard renamed here before the manifest names it is debris the next
        open removes (its rows are recomputed), and the part's own manifest then lacks it too."""
        self._check_open()
        part = Path(part)
        try:
            other = GradientIndex.open(part, key=self._key, dim=self._dim, storage_dtype=self._dtype,
                                       on_mismatch="refuse", lock_timeout=0.0)
        except (IndexMismatch, IndexLocked) as e:
            log.warning("gradient index %s: cannot adopt %s (%s); its rows will be recomputed", self._root, part, e)
            if isinstance(e, IndexMismatch):
                shutil.rmtree(part, ignore_errors=True)
            return 0
        adopted = 0
        try:
            for entry in list(other._shards):
                if all(self.has(k) for k in entry["keys"]):
                    continue
                number = self._next_shard
                new = {**entry, "file": f"shard-{number:05d}.npy"}
                os.replace(part / entry["file"], self._root / new["file"])
                if entry["norms"] is not None:
                    new["norms"] = {**entry["norms"], "file": f"shard-{number:05d}.norms.npy"}
                    os.replace(part / entry["norms"]["file"], self._root / new["norms"]["file"])
                if origin:
                    new["origin"] = origin
                self._next_shard += 1
                self._append_shard(new)
                adopted += sum(1 for k in entry["keys"] if self._where[k][0] == len(self._shards) - 1)
            self._write_manifest()
        finally:
            other._lock.release()
            other._lock = None
        shutil.rmtree(part, ignore_errors=True)
        return adopted

    def _append_shard(self, entry: dict) -> None:
        s = len(self._shards)
        self._shards.append(entry)
        for i, k in enumerate(entry["keys"]):
            # A key twice would mean a broken writer; the first copy wins, as it does in `add`.
            self._where.setdefault(k, (s, i))

    def _write_manifest(self) -> None:
        m = {
            "schema": SCHEMA,
            "key": self._key,
            "dim": self._dim,
            "storage_dtype": self._dtype,
            "meta": self._meta,
            "shards": self._shards,
        }
        data = json.dumps(m, indent=1, ensure_ascii=False).encode()
        _atomic_write(self._root, MANIFEST, lambda f: f.write(data))

    # ------------------------------------------------------------------------------------------ properties

    @property
    def root(self) -> Path:
        return self._root

    @property
    def key(self) -> str:
        return self._key

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def storage_dtype(self) -> str:
        return self._dtype

    @property
    def meta(self) -> dict:
        return json.loads(json.dumps(self._meta))

    @property
    def n_rows(self) -> int:
        """Distinct rows held: stored plus buffered (the buffer is written by `flush`/`close`)."""
        return len(self._where) + len(self._pend_keys)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored shard files (rows and norms), excluding the manifest and the buffer."""
        return sum(s["bytes"] + (s["norms"]["bytes"] if s["norms"] else 0) for s in self._shards)

    @property
    def keys(self) -> list[str]:
        """Stored row keys in storage order (buffered rows are not included until flushed)."""
        return [k for s in self._shards for k in s["keys"]]

    def __len__(self) -> int:
        return self.n_rows

    def __repr__(self) -> str:
        return f"GradientIndex({str(self._root)!r}, rows={self.n_rows}, dim={self._dim}, dtype={self._dtype})"

    # ------------------------------------------------------------------------------------------- writing

    def _check_open(self) -> None:
        if self._lock is None:
            raise RuntimeError(f"gradient index {self._root} is closed")

    def has(self, row_key: str) -> bool:
        return row_key in self._where or row_key in self._pend_set

    def __contains__(self, row_key: str) -> bool:
        return self.has(row_key)

    def missing(self, row_keys: Sequence[str]) -> list[int]:
        """Positions in `row_keys` whose rows are neither stored nor buffered. A key listed several times is
        reported once, at its first position, so each row is computed once."""
        seen: set[str] = set()
        out = []
        for i, k in enumerate(row_keys):
            if k in seen or self.has(k):
                continue
            seen.add(k)
            out.append(i)
        return out

    def add(self, row_keys: Sequence[str], vectors) -> None:
        """Buffer rows (numpy array or torch tensor, shape (len(row_keys), dim)); every `shard_rows` buffered
        rows become a shard. Keys already held are skipped (first write wins): a content hash names one row."""
        self._check_open()
        if self._read_only:
            raise RuntimeError(f"gradient index {self._root} is open read-only")
        arr = as_float32(vectors)
        if arr.shape != (len(row_keys), self._dim):
            raise ValueError(f"add: got vectors of shape {arr.shape} for {len(row_keys)} keys of width {self._dim}")
        take: list[int] = []
        seen: set[str] = set()
        for i, k in enumerate(row_keys):
            if not isinstance(k, str):
                raise TypeError(f"row keys must be strings, got {type(k).__name__} at position {i}")
            if k in seen or self.has(k):
                continue
            seen.add(k)
            take.append(i)
        if not take:
            return
        rows = arr[take]  # fancy indexing copies: later edits to the caller's array cannot reach the buffer
        finite = np.isfinite(rows).all(axis=1)
        if not finite.all():
            bad = row_keys[take[int(np.argmin(finite))]]
            raise ValueError(f"add: row {short(bad)} has NaN or inf entries; refusing to store it")
        self._pend_keys.extend(row_keys[i] for i in take)
        self._pend_set.update(row_keys[i] for i in take)
        self._pend_vecs.append(rows)
        while len(self._pend_keys) >= self._shard_rows:
            self._write_pending(self._shard_rows)

    def _write_pending(self, n: int) -> None:
        vecs = self._pend_vecs[0] if len(self._pend_vecs) == 1 else np.concatenate(self._pend_vecs)
        keys = self._pend_keys[:n]
        self._write_shard(keys, vecs[:n])
        self._pend_keys = self._pend_keys[n:]
        self._pend_vecs = [vecs[n:]] if n < len(vecs) else []
        self._pend_set.difference_update(keys)

    def _write_shard(self, keys: list[str], vecs: np.ndarray) -> None:
        number = self._next_shard
        name = f"shard-{number:05d}.npy"
        data, norms = encode(vecs, self._dtype)
        sha, nbytes = _atomic_write(self._root, name, lambda f: np.lib.format.write_array(f, data, allow_pickle=False))
        entry: dict[str, Any] = {"file": name, "rows": len(keys), "bytes": nbytes, "sha256": sha, "norms": None}
        if norms is not None:
            nname = f"shard-{number:05d}.norms.npy"
            nsha, nnbytes = _atomic_write(
                self._root, nname, lambda f: np.lib.format.write_array(f, norms, allow_pickle=False)
            )
            entry["norms"] = {"file": nname, "bytes": nnbytes, "sha256": nsha}
        entry["keys"] = list(keys)
        self._next_shard += 1
        before = len(self._shards)
        self._append_shard(entry)
        try:
            self._write_manifest()
        except BaseException:
            # Keep memory in line with disk; the unnamed shard files are removed on the next open.
            self._shards.pop()
            for k in entry["keys"]:
                if self._where.get(k, (None,))[0] == before:
                    del self._where[k]
            raise

    def flush(self) -> None:
        """Write the buffered rows as a (possibly short) shard."""
        self._check_open()
        if self._pend_keys:
            self._write_pending(len(self._pend_keys))

    def close(self) -> None:
        """Flush and release the lock. Safe to call twice."""
        if self._lock is None:
            return
        try:
            self.flush()
        finally:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "GradientIndex":
        return self

    def __exit__(self, *exc) -> None:
        # Flushing on an exception too is right: every buffered row is complete, and keeping it saves work.
        self.close()

    # ------------------------------------------------------------------------------------------- reading

    def score(self, queries, row_keys: Sequence[str], *, block_rows: int = 4096) -> np.ndarray:
        """float32 (Q, len(row_keys)) = queries @ rows(row_keys).T, holding at most `block_rows` rows (and at most
        `SCORE_BLOCK_BYTES` of them) at a time.
        Bit-identical to that plain matmul when len(row_keys) <= block_rows, and to the plain matmul of each
        block otherwise (BLAS sums in an order that depends on the matrix shape, so no blocked product can
        promise more). A 1-D query gives a 1-D result."""
        q, squeeze = self._queries(queries)
        out = np.empty((q.shape[0], len(row_keys)), dtype=np.float32)
        block_rows = self.score_block_rows(block_rows)
        for a, b, block in self._blocks(row_keys, block_rows):
            out[:, a:b] = q @ block.T
        return out[0] if squeeze else out

    def score_block_rows(self, block_rows: int = 4096) -> int:
        """The rows `score` multiplies at once: `block_rows`, and at most `SCORE_BLOCK_BYTES` of them."""
        return min(block_rows, max(1, SCORE_BLOCK_BYTES // (4 * max(self._dim, 1))))

    def _queries(self, queries) -> tuple[np.ndarray, bool]:
        q = as_float32(queries)
        squeeze = q.ndim == 1
        if squeeze:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self._dim:
            raise ValueError(f"queries must have shape (Q, {self._dim}) or ({self._dim},), got {q.shape}")
        return np.ascontiguousarray(q), squeeze
