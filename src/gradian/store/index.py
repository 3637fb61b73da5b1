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

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from .errors import IndexError_

log = logging.getLogger(__name__)

SCHEMA = "gradian.index/1"
MANIFEST = "manifest.json"
LOCK_FILE = ".lock"
TMP_PREFIX = ".tmp-"
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
ON_MISMATCH = ("rebuild", "refuse")

_SHARD_RE = re.compile(r"shard-(\d{5,})\.npy")
_NORMS_RE = re.compile(r"shard-(\d{5,})\.norms\.npy")
# Explicit little-endian so an index written on one machine reads the same on any other.
_DISK_DTYPE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
_NORMS_DTYPE = np.dtype("<f4")


class IndexMismatch(IndexError_):
    """An index on disk cannot be used as it is. `reason` is one of: foreign, unreadable, missing, truncated,
    corrupt; `path` is the offending file."""

    def __init__(self, message: str, *, path: Path, reason: str):
        super().__init__(message)
        self.path = Path(path)
        self.reason = reason


class IndexLocked(IndexError_):
    """Another process kept the index open for longer than the lock timeout."""

    def __init__(self, message: str, *, lock_path: Path, holder_pid: Optional[int]):
        super().__init__(message)
        self.lock_path = Path(lock_path)
        self.holder_pid = holder_pid


class _Problem:
    __slots__ = ("path", "reason", "detail")

    def __init__(self, path: Path, reason: str, detail: str):
        self.path, self.reason, self.detail = path, reason, detail

    def __str__(self) -> str:
        return f"{self.path}: {self.reason} ({self.detail})"


# ----------------------------------------------------------------------------------------------- encoding


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, the same rounding `torch.Tensor.to(torch.bfloat16)` does
    (a test checks bit equality). Done in numpy so writing an index never needs to import torch. Inputs are
    finite (checked in `add`), so the NaN branch torch has is not needed."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(_DISK_DTYPE["bfloat16"])


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32, so widening is exact.
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _encode(vectors: np.ndarray, storage_dtype: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """float32 rows -> (data, norms). Half types store unit vectors plus an fp32 norm: LoRA gradients of ~1e-6
    are float16 subnormals (4 bits of mantissa or none), while unit entries sit well inside its normal range."""
    if storage_dtype == "float32":
        return np.ascontiguousarray(vectors, dtype=_DISK_DTYPE["float32"]), None
    v = vectors.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", v, v))
    unit = (v / np.where(norms > 0, norms, 1.0)[:, None]).astype(np.float32)
    if storage_dtype == "float16":
        data = unit.astype(_DISK_DTYPE["float16"])
    else:
        data = _f32_to_bf16_bits(unit)
    return np.ascontiguousarray(data), norms.astype(_NORMS_DTYPE)


def _decode(data: np.ndarray, norms: Optional[np.ndarray], storage_dtype: str) -> np.ndarray:
    if storage_dtype == "float32":
        return np.asarray(data, dtype=np.float32)  # a memory-mapped slice stays a view: no copy
    unit = data.astype(np.float32) if storage_dtype == "float16" else _bf16_bits_to_f32(data)
    unit *= np.asarray(norms, dtype=np.float32)[:, None]
    return unit


# ------------------------------------------------------------------------------------------ file helpers


class _HashingWriter:
    """File-like sink for `np.lib.format.write_array` that hashes what it writes, so a shard is read once."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.nbytes += len(b)
        return self._f.write(b)


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable across power loss; some filesystems refuse, which only weakens that.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(directory: Path, name: str, write: Callable[[Any], None]) -> tuple[str, int]:
    """Write `directory/name` so that it either does not change or is complete; returns (sha256, bytes)."""
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            sink = _HashingWriter(f)
            write(sink)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return sink.sha.hexdigest(), sink.nbytes


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _short(s: str, n: int = 80) -> str:
    return repr(s) if len(s) <= n else repr(s[: n - 3] + "...")


# ------------------------------------------------------------------------------------------------ locking


class _Lock:
    """Exclusive `flock` on root/.lock. The kernel drops it when the holder dies, so a killed build never leaves
    a stale lock behind; the pid inside the file is only there to name the holder in the timeout message."""

    def __init__(self, path: Path, timeout: float):
        self.path = path
        self._fd: Optional[int] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + max(0.0, timeout)
        delay = 0.01
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(self._fd)
                    self._fd = None
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holder = self._holder()
                os.close(self._fd)
                self._fd = None
                who = f"pid {holder[0]} on {holder[1]}" if holder else "a process whose pid was not recorded"
                raise IndexLocked(
                    f"gradient index lock {path} is held by {who}; gave up after waiting {timeout:g} s. Another "
                    "build of this index is running: wait for it to finish, or point this run at another "
                    "index directory.",
                    lock_path=path,
                    holder_pid=holder[0] if holder else None,
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

    def _holder(self) -> Optional[tuple[int, str]]:
        try:
            parts = self.path.read_text().split()
            return int(parts[0]), (parts[1] if len(parts) > 1 else "?")
        except (OSError, ValueError, IndexError):
            return None

    def __del__(self) -> None:
        # An index dropped without close() must not hold the lock for the rest of the process.
        try:
            self.release()
        except Exception:
            pass

    def release(self) -> None:
        if getattr(self, "_fd", None) is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None


# ----------------------------------------------------------------------------------------------- manifest


def _validate_manifest(m: dict) -> None:
    """Structural check of a manifest whose schema matched; raises ValueError saying what is wrong. File names
    must match the shard patterns exactly, so a hostile manifest cannot make `open` touch files elsewhere."""

    def need(obj: dict, field: str, kind, where: str):
        v = obj.get(field)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{where}{field} is missing or not a {getattr(kind, '__name__', kind)}")
        return v

    need(m, "key", str, "")
    if need(m, "dim", int, "") <= 0:
        raise ValueError("dim must be positive")
    dtype = need(m, "storage_dtype", str, "")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype {dtype!r} is not one of {STORAGE_DTYPES}")
    need(m, "meta", dict, "")
    seen: set[str] = set()
    for i, s in enumerate(need(m, "shards", list, "")):
        w = f"shards[{i}]."
        if not isinstance(s, dict):
            raise ValueError(f"shards[{i}] is not an object")
        name = need(s, "file", str, w)
        match = _SHARD_RE.fullmatch(name)
        if not match or name in seen:
            raise ValueError(f"{w}file {name!r} is not a shard file name or is listed twice")
        seen.add(name)
        rows = need(s, "rows", int, w)
        need(s, "bytes", int, w)
        if rows <= 0 or not re.fullmatch(r"[0-9a-f]{64}", need(s, "sha256", str, w)):
            raise ValueError(f"{w}rows or sha256 is invalid")
        keys = need(s, "keys", list, w)
        if len(keys) != rows or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{w}keys must be {rows} strings")
        norms = s.get("norms")
        if (norms is None) != (dtype == "float32"):
            raise ValueError(f"{w}norms must be present exactly when storage_dtype is a half type")
        if norms is not None:
            if not isinstance(norms, dict):
                raise ValueError(f"{w}norms is not an object")
            nmatch = _NORMS_RE.fullmatch(need(norms, "file", str, w + "norms."))
            if not nmatch or nmatch.group(1) != match.group(1):
                raise ValueError(f"{w}norms.file does not belong to {name}")
            need(norms, "bytes", int, w + "norms.")
            if not re.fullmatch(r"[0-9a-f]{64}", need(norms, "sha256", str, w + "norms.")):
                raise ValueError(f"{w}norms.sha256 is invalid")


# ---------------------------------------------------------------------------------------------- the index


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
    ) -> "GradientIndex":
        """Open or create the index at `root`, holding its lock until `close()`.

        An existing index built for another key, dim or storage dtype, or whose manifest is unreadable, is
        moved aside to a sibling directory (`on_mismatch="rebuild"`, with a warning naming it) or rejected with
        `IndexMismatch` (`"refuse"`). Shards that are missing, truncated or fail their sha256 are deleted and
        their rows become `missing()` again ("rebuild"), or rejected ("refuse"). Crash debris (temp files,
        shards the manifest does not name) is removed in both modes. `verify=False` skips the sha256 pass
        (sizes and headers are still checked) for callers that verified the same files moments ago.
        `meta`, when given, replaces the stored meta; the key alone decides whether rows are reusable.
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
        self._lock: Optional[_Lock] = _Lock(root / LOCK_FILE, lock_timeout)
        try:
            self._load(on_mismatch, verify, meta)
        except BaseException:
            self._lock.release()
            self._lock = None
            raise
        return self

    def _our_files(self) -> list[Path]:
        return sorted(
            p for p in self._root.iterdir() if _SHARD_RE.fullmatch(p.name) or _NORMS_RE.fullmatch(p.name)
        )

    def _read_manifest(self) -> tuple[Optional[dict], Optional[_Problem], bytes]:
        path = self._root / MANIFEST
        if not path.exists():
            strays = self._our_files()
            if strays:
                return None, _Problem(path, "unreadable", f"no manifest, but {len(strays)} shard files"), b""
            return None, None, b""
        try:
            raw = path.read_bytes()
            m = json.loads(raw)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            return None, _Problem(path, "unreadable", f"not valid JSON: {e}"), b""
        if not isinstance(m, dict) or m.get("schema") != SCHEMA:
            schema = m.get("schema") if isinstance(m, dict) else None
            return None, _Problem(path, "foreign", f"schema is {schema!r}, expected {SCHEMA!r}"), raw
        try:
            _validate_manifest(m)
        except ValueError as e:
            return None, _Problem(path, "unreadable", str(e)), raw
        diffs = [
            f"{name} {_short(str(m[name]))} (this run needs {_short(str(want))})"
            for name, want in (("key", self._key), ("dim", self._dim), ("storage_dtype", self._dtype))
            if m[name] != want
        ]
        if diffs:
            return None, _Problem(path, "foreign", "built for " + ", ".join(diffs)), raw
        return m, None, raw

    def _move_aside(self, problem: _Problem, raw: bytes) -> Path:
        # Moved, not deleted: a foreign index may be another run's expensive cache, and a manifest we cannot
        # read may not even be ours. The lock file stays, since we hold it.
        tag = hashlib.sha256(raw).hexdigest()[:12]
        dest = self._root.with_name(f"{self._root.name}.{problem.reason}-{tag}")
        n = 1
        while dest.exists():
            dest = self._root.with_name(f"{self._root.name}.{problem.reason}-{tag}-{n}")
            n += 1
        dest.mkdir()
        for p in [self._root / MANIFEST, *self._our_files()]:
            if p.exists():
                os.replace(p, dest / p.name)
        _fsync_dir(self._root)
        return dest

    def _check_shard(self, entry: dict, verify: bool) -> Optional[_Problem]:
        files = [(entry["file"], entry["bytes"], entry["sha256"], (entry["rows"], self._dim), _DISK_DTYPE[self._dtype])]
        if entry["norms"] is not None:
            n = entry["norms"]
            files.append((n["file"], n["bytes"], n["sha256"], (entry["rows"],), _NORMS_DTYPE))
        for name, nbytes, sha, shape, dtype in files:
            path = self._root / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return _Problem(path, "missing", "file not found")
            if size < nbytes:
                return _Problem(path, "truncated", f"{size} bytes, the manifest says {nbytes}")
            if size > nbytes:
                return _Problem(path, "corrupt", f"{size} bytes, the manifest says {nbytes}")
            if verify:
                actual = _sha256_file(path)
                if actual != sha:
                    detail = f"sha256 {actual[:16]}... does not match the manifest's {sha[:16]}..."
                    return _Problem(path, "corrupt", detail)
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
                ok = arr.shape == shape and arr.dtype == dtype and arr.flags.c_contiguous
            except (ValueError, OSError) as e:
                return _Problem(path, "corrupt", f"not a readable .npy file: {e}")
            if not ok:
                return _Problem(path, "corrupt", f"holds {arr.dtype}{arr.shape}, expected {dtype}{shape}")
        return None

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

        problems: list[tuple[_Problem, dict]] = []
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
        numbers = [int(_SHARD_RE.fullmatch(s["file"]).group(1)) for s in manifest["shards"]]
        self._next_shard = max(numbers, default=-1) + 1  # never reuse a number the manifest still names
        stored_meta = manifest["meta"]
        if meta is None:
            self._meta = stored_meta
        if problems or self._meta != stored_meta:
            self._write_manifest()

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
        arr = _as_float32(vectors)
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
            raise ValueError(f"add: row {_short(bad)} has NaN or inf entries; refusing to store it")
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
        data, norms = _encode(vecs, self._dtype)
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
                    f"row {_short(k)} is not in the gradient index {self._root} "
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
            out[order[a:b]] = _decode(data[sel], norms[sel] if norms is not None else None, self._dtype)
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
            yield list(entry["keys"]), _decode(data, norms, self._dtype)

    def score(self, queries, row_keys: Sequence[str], *, block_rows: int = 4096) -> np.ndarray:
        """float32 (Q, len(row_keys)) = queries @ rows(row_keys).T, holding at most `block_rows` rows at a time.
        Bit-identical to that plain matmul when len(row_keys) <= block_rows, and to the plain matmul of each
        block otherwise (BLAS sums in an order that depends on the matrix shape, so no blocked product can
        promise more). A 1-D query gives a 1-D result."""
        q, squeeze = self._queries(queries)
        out = np.empty((q.shape[0], len(row_keys)), dtype=np.float32)
        for a, b, block in self._blocks(row_keys, block_rows):
            out[:, a:b] = q @ block.T
        return out[0] if squeeze else out

    def topk(
        self, queries, row_keys: Sequence[str], k: int, *, block_rows: int = 4096
    ) -> tuple[np.ndarray, np.ndarray]:
        """(indices into row_keys, scores), each (Q, min(k, n)), best first; the scores are `score()`'s and ties
        go to the lower index, exactly as `argsort(-scores, kind="stable")[:, :k]`. Streams like `score`,
        keeping only the running top k per query."""
        q, squeeze = self._queries(queries)
        nq = q.shape[0]
        k = max(0, min(int(k), len(row_keys)))
        best_s = np.empty((nq, 0), dtype=np.float32)
        best_i = np.empty((nq, 0), dtype=np.int64)
        if k:
            for a, b, block in self._blocks(row_keys, block_rows):
                cand_s = np.concatenate([best_s, q @ block.T], axis=1)
                cand_i = np.concatenate([best_i, np.broadcast_to(np.arange(a, b), (nq, b - a))], axis=1)
                best_s, best_i = _keep_top(cand_s, cand_i, k)
        order = np.lexsort((best_i, -best_s), axis=-1)
        best_i = np.take_along_axis(best_i, order, axis=1)
        best_s = np.take_along_axis(best_s, order, axis=1)
        return (best_i[0], best_s[0]) if squeeze else (best_i, best_s)

    def _queries(self, queries) -> tuple[np.ndarray, bool]:
        q = _as_float32(queries)
        squeeze = q.ndim == 1
        if squeeze:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self._dim:
            raise ValueError(f"queries must have shape (Q, {self._dim}) or ({self._dim},), got {q.shape}")
        return np.ascontiguousarray(q), squeeze


def _keep_top(scores: np.ndarray, idx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k best (score desc, index asc) candidates, unordered. Exact under ties, which are common:
    rows with no supervised tokens all score 0."""
    m = scores.shape[1]
    if m <= k:
        return scores, idx
    kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1 : k]
    # Everything above the k-th value is in (fewer than k of them); among those equal to it, the lowest indices.
    rank = np.where(scores > kth, -1, np.where(scores == kth, idx, np.iinfo(np.int64).max))
    pick = np.argpartition(rank, k - 1, axis=1)[:, :k]
    return np.take_along_axis(scores, pick, axis=1), np.take_along_axis(idx, pick, axis=1)


def _as_float32(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; checked by duck type so this module never imports torch
        x = x.detach().cpu().float().numpy()
    return np.asarray(x, dtype=np.float32)
