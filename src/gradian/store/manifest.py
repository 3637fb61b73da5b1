"""The index manifest: schema, cache key, caller meta, dim, storage dtype and every shard with its checksum."""

from __future__ import annotations

import re

from .encoding import STORAGE_DTYPES

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
