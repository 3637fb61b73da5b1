"""The index manifest: schema, cache key, caller meta, dim, storage dtype and every shard with its checksum."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np

from ..io import fsync_dir, sha256_file
from .encoding import DISK_DTYPE, NORMS_DTYPE, STORAGE_DTYPES

SCHEMA = "gradian.index/1"
MANIFEST = "manifest.json"
SHARD_RE = re.compile(r"shard-(\d{5,})\.npy")
NORMS_RE = re.compile(r"shard-(\d{5,})\.norms\.npy")


def validate_manifest(m: dict) -> None:
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
        match = SHARD_RE.fullmatch(name)
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
            nmatch = NORMS_RE.fullmatch(need(norms, "file", str, w + "norms."))
            if not nmatch or nmatch.group(1) != match.group(1):
                raise ValueError(f"{w}norms.file does not belong to {name}")
            need(norms, "bytes", int, w + "norms.")
            if not re.fullmatch(r"[0-9a-f]{64}", need(norms, "sha256", str, w + "norms.")):
                raise ValueError(f"{w}norms.sha256 is invalid")

class Problem:
    """What is wrong with one file of an index: `reason` is foreign, unreadable, missing, truncated or corrupt."""

    __slots__ = ("path", "reason", "detail")

    def __init__(self, path: Path, reason: str, detail: str):
        self.path, self.reason, self.detail = path, reason, detail

    def __str__(self) -> str:
        return f"{self.path}: {self.reason} ({self.detail})"


def short(s: str, n: int = 80) -> str:
    return repr(s) if len(s) <= n else repr(s[: n - 3] + "...")


def shard_files(root: Path) -> list[Path]:
    """The shard and norms files in `root`, whatever the manifest says."""
    return sorted(p for p in root.iterdir() if SHARD_RE.fullmatch(p.name) or NORMS_RE.fullmatch(p.name))

def read_manifest(root: Path, *, key: str, dim: int, storage_dtype: str) -> tuple[Optional[dict], Optional["Problem"], bytes]:
    """(manifest, None, raw bytes) when `root` holds a valid manifest for this key, dim and dtype; (None, problem,
    raw) when it holds another or a broken one; (None, None, b"") when it holds none."""
    path = root / MANIFEST
    if not path.exists():
        strays = shard_files(root)
        if strays:
            return None, Problem(path, "unreadable", f"no manifest, but {len(strays)} shard files"), b""
        return None, None, b""
    try:
        raw = path.read_bytes()
        m = json.loads(raw)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, Problem(path, "unreadable", f"not valid JSON: {e}"), b""
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        schema = m.get("schema") if isinstance(m, dict) else None
        return None, Problem(path, "foreign", f"schema is {schema!r}, expected {SCHEMA!r}"), raw
    try:
        validate_manifest(m)
    except ValueError as e:
        return None, Problem(path, "unreadable", str(e)), raw
    diffs = [
        f"{name} {short(str(m[name]))} (this run needs {short(str(want))})"
        for name, want in (("key", key), ("dim", dim), ("storage_dtype", storage_dtype))
        if m[name] != want
    ]
    if diffs:
        return None, Problem(path, "foreign", "built for " + ", ".join(diffs)), raw
    return m, None, raw

def move_aside(root: Path, problem: "Problem", raw: bytes) -> Path:
    # Moved, not deleted: a foreign index may be another run's expensive cache, and a manifest we cannot
    # read may not even be ours. The lock file stays, since we hold it.
    tag = hashlib.sha256(raw).hexdigest()[:12]
    dest = root.with_name(f"{root.name}.{problem.reason}-{tag}")
    n = 1
    while dest.exists():
        dest = root.with_name(f"{root.name}.{problem.reason}-{tag}-{n}")
        n += 1
    dest.mkdir()
    for p in [root / MANIFEST, *shard_files(root)]:
        if p.exists():
            os.replace(p, dest / p.name)
    fsync_dir(root)
    return dest

def check_shard(root: Path, entry: dict, *, dim: int, storage_dtype: str, verify: bool) -> Optional["Problem"]:
    """The first problem of a shard's files (missing, truncated, corrupt), or None."""
    files = [(entry["file"], entry["bytes"], entry["sha256"], (entry["rows"], dim), DISK_DTYPE[storage_dtype])]
    if entry["norms"] is not None:
        n = entry["norms"]
        files.append((n["file"], n["bytes"], n["sha256"], (entry["rows"],), NORMS_DTYPE))
    for name, nbytes, sha, shape, dtype in files:
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return Problem(path, "missing", "file not found")
        if size < nbytes:
            return Problem(path, "truncated", f"{size} bytes, the manifest says {nbytes}")
        if size > nbytes:
            return Problem(path, "corrupt", f"{size} bytes, the manifest says {nbytes}")
        if verify:
            actual = sha256_file(path)
            if actual != sha:
                detail = f"sha256 {actual[:16]}... does not match the manifest's {sha[:16]}..."
                return Problem(path, "corrupt", detail)
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            ok = arr.shape == shape and arr.dtype == dtype and arr.flags.c_contiguous
        except (ValueError, OSError) as e:
            return Problem(path, "corrupt", f"not a readable .npy file: {e}")
        if not ok:
            return Problem(path, "corrupt", f"holds {arr.dtype}{arr.shape}, expected {dtype}{shape}")
    return None
