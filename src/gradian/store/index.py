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
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ..errors import IndexError_
from ..io import atomic_write
from .encoding import STORAGE_DTYPES, as_float32, decode, encode
from .lock import LOCK_FILE, IndexLocked, Lock
from .manifest import (
    MANIFEST, SCHEMA, SHARD_RE, Problem, check_shard, move_aside, read_manifest, shard_files, short,
)

log = logging.getLogger(__name__)

__all__ = ["GradientIndex", "IndexLocked", "IndexMismatch", "SCHEMA", "STORAGE_DTYPES"]

TMP_PREFIX = ".tmp-"
SCORE_BLOCK_BYTES = 256 << 20  # float32 rows `score` decodes at once, at most (4096 exact rows at 4.9M dims: 80 GB)
ON_MISMATCH = ("rebuild", "refuse")


class IndexMismatch(IndexError_):
    """An index on disk cannot be used as it is. `reason` is one of: foreign, unreadable, missing, truncated,
    corrupt; `path` is the offending file."""

    def __init__(self, message: str, *, path: Path, reason: str):
        super().__init__(message)
        self.path = Path(path)
        self.reason = reason


def _atomic_write(directory: Path, name: str, write) -> tuple[str, int]:
    """Write `directory/name` under a `TMP_PREFIX` temporary name (what `open` removes as a killed writer's debris)."""
    return atomic_write(directory / name, write, tmp_name=f"{TMP_PREFIX}{name}.{os.getpid()}")


class GradientIndex:
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
            if self._read_only:
                self._load_read_only(verify)
            else:
                self._load(on_mismatch, verify, meta)
        except BaseException:
            self._lock.release()
            self._lock = None
            raise
        return self

    def _our_files(self) -> list[Path]:
        return shard_files(self._root)

    def _read_manifest(self) -> tuple[Optional[dict], Optional[Problem], bytes]:
        return read_manifest(self._root, key=self._key, dim=self._dim, storage_dtype=self._dtype)

    def _move_aside(self, problem: Problem, raw: bytes) -> Path:
        return move_aside(self._root, problem, raw)

    def _check_shard(self, entry: dict, verify: bool) -> Optional[Problem]:
        return check_shard(self._root, entry, dim=self._dim, storage_dtype=self._dtype, verify=verify)

    def _load(self, on_mismatch: str, verify: bool, meta: Optional[dict]) -> None:
        root = self._root
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                # We hold the lock, so no live writer owns these: they are what a killed build left.
                log.info("gradient index %s: removing leftover temporary file %s", root, p.name)
                p.unlink(missing_ok=True)

        manifest, problem, raw = self._read_manifest()
        if problem is not None:
            if on_mismatch == "refuse":
                raise IndexMismatch(
                    f"gradient index {problem}. Delete {root}, or let it rebuild (on_mismatch='rebuild').",
                    path=problem.path,
                    reason=problem.reason,
                )
            dest = self._move_aside(problem, raw)
            log.warning("gradient index %s; moved it to %s and starting an empty index", problem, dest)
            manifest = None

        if manifest is None:
            self._write_manifest()
            return

        referenced = {s["file"] for s in manifest["shards"]}
        referenced |= {s["norms"]["file"] for s in manifest["shards"] if s["norms"] is not None}
        for p in self._our_files():
            if p.name not in referenced:
                # Finished shard whose manifest update never landed (killed in between): its rows are redone.
                log.info("gradient index %s: removing %s, which the manifest does not name", root, p.name)
                p.unlink(missing_ok=True)

        problems: list[tuple[Problem, dict]] = []
        keep: list[dict] = []
        for entry in manifest["shards"]:
            pr = self._check_shard(entry, verify)
            if pr is None:
                keep.append(entry)
            else:
                problems.append((pr, entry))
        if problems and on_mismatch == "refuse":
            listed = "; ".join(str(p) for p, _ in problems[:5])
            more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
            first = problems[0][0]
            raise IndexMismatch(
                f"gradient index {root} has {len(problems)} bad shard(s): {listed}{more}. Delete {root}, or let it "
                "rebuild the bad shards (on_mismatch='rebuild').",
                path=first.path,
                reason=first.reason,
            )
        for pr, entry in problems:
            for name in (entry["file"], entry["norms"]["file"] if entry["norms"] else None):
                if name:
                    (root / name).unlink(missing_ok=True)
            log.warning("gradient index %s; removed the shard, its %d rows will be recomputed", pr, entry["rows"])

        self._shards = []
        for entry in keep:
            self._append_shard(entry)
        numbers = [int(SHARD_RE.fullmatch(s["file"]).group(1)) for s in manifest["shards"]]
        self._next_shard = max(numbers, default=-1) + 1  # never reuse a number the manifest still names
        stored_meta = manifest["meta"]
        if meta is None:
            self._meta = stored_meta
        if problems or self._meta != stored_meta:
            self._write_manifest()

    def _load_read_only(self, verify: bool) -> None:
        manifest, problem, _ = self._read_manifest()
        if problem is None and manifest is None:
            raise IndexMismatch(f"gradient index {self._root} has no manifest: build it first",
                                path=self._root / MANIFEST, reason="missing")
        if problem is not None:
            raise IndexMismatch(f"gradient index {problem}", path=problem.path, reason=problem.reason)
        for entry in manifest["shards"]:
            pr = self._check_shard(entry, verify)
            if pr is not None:
                raise IndexMismatch(f"gradient index {pr}", path=pr.path, reason=pr.reason)
            self._append_shard(entry)
        self._meta = manifest["meta"]

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

    def _open_shard(self, s: int, cache: dict) -> tuple[np.ndarray, Optional[np.ndarray]]:
        if s not in cache:
            entry = self._shards[s]
            data = np.load(self._root / entry["file"], mmap_mode="r", allow_pickle=False)
            norms = None
            if entry["norms"] is not None:
                norms = np.load(self._root / entry["norms"]["file"], mmap_mode="r", allow_pickle=False)
            cache[s] = (data, norms)
        return cache[s]

    def _locate(self, row_keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row within shard) per requested key; KeyError names the first absent one."""
        self._check_open()
        if self._pend_keys:
            self.flush()  # reads go through the files; flushing changes shard boundaries, never values
        n = len(row_keys)
        shard = np.empty(n, dtype=np.int64)
        local = np.empty(n, dtype=np.int64)
        where = self._where
        for i, k in enumerate(row_keys):
            loc = where.get(k)
            if loc is None:
                absent = sum(1 for kk in row_keys if kk not in where)
                raise KeyError(
                    f"row {short(k)} is not in the gradient index {self._root} "
                    f"({absent} of {n} requested rows are absent)"
                )
            shard[i], local[i] = loc
        return shard, local

    def _gather(self, shard: np.ndarray, local: np.ndarray, cache: dict) -> np.ndarray:
        """Decoded float32 rows in the order given, read shard by shard in ascending row order."""
        out = np.empty((len(shard), self._dim), dtype=np.float32)
        order = np.lexsort((local, shard))
        s_sorted, l_sorted = shard[order], local[order]
        bounds = np.r_[0, np.flatnonzero(np.diff(s_sorted)) + 1, len(order)].astype(np.int64)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            data, norms = self._open_shard(int(s_sorted[a]), cache)
            sel = l_sorted[a:b]
            if sel[-1] - sel[0] == len(sel) - 1:  # sorted, so this is a contiguous run (or has repeats: no)
                sel = slice(int(sel[0]), int(sel[-1]) + 1)
            out[order[a:b]] = decode(data[sel], norms[sel] if norms is not None else None, self._dtype)
            # Unmap the shard once its rows are copied: mapped pages count in the process's RSS (the kernel maps
            # neighbouring cached pages on each fault), so keeping every shard mapped made a read of scattered rows
            # cost about the index's size in RSS (1.8 GB for 4096 rows of a 2.7 GB index).
            del data, norms
            cache.pop(int(s_sorted[a]), None)
        return out

    def _blocks(self, row_keys: Sequence[str], block_rows: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, stop, rows[start:stop]) over fixed blocks of the request. Blocks follow the request, not the
        shards, so scores do not depend on how the rows happen to be sharded (a resumed build has other shard
        boundaries than an uninterrupted one) and a request of at most `block_rows` rows is one plain matmul."""
        if block_rows < 1:
            raise ValueError("block_rows must be >= 1")
        shard, local = self._locate(row_keys)
        cache: dict = {}
        for a in range(0, len(shard), block_rows):
            b = min(len(shard), a + block_rows)
            yield a, b, self._gather(shard[a:b], local[a:b], cache)

    def rows(self, row_keys: Sequence[str]) -> np.ndarray:
        """float32 (len(row_keys), dim) in the order asked; KeyError names the first absent key."""
        shard, local = self._locate(row_keys)
        return self._gather(shard, local, {})

    def iter_shards(self) -> Iterator[tuple[list[str], np.ndarray]]:
        """(keys, float32 rows) per shard in storage order, one shard in memory at a time. With float32
        storage the block is a read-only memory map."""
        self._check_open()
        if self._pend_keys:
            self.flush()
        for s, entry in enumerate(list(self._shards)):
            data, norms = self._open_shard(s, {})
            yield list(entry["keys"]), decode(data, norms, self._dtype)

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
