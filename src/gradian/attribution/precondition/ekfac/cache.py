"""The fitted factors on disk, beside the index: one safetensors file per site group (written as the group is fitted,
so memory holds one group's factors at a time), their sha256 and what they were fitted for in `MANIFEST_FILE`,
written last. Factors fitted for other sites or rows, or whose bytes no longer match the sha256, are refitted
(`load_or_fit_factors`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ....grads.layout import SiteShape, exact_widths, site_shapes
from ....io import atomic_write_text, sha256_file
from .factors import DEFAULT_MEMORY_BYTES, SIDES, FactorStore
from .statistics import fit_factors

log = logging.getLogger(__name__)

SCHEMA = "gradian.ekfac/1"
EKFAC_VERSION = 1  # bump when the statistics change for the same settings: cached factors become foreign
FACTORS_PREFIX = "ekfac_factors-"  # one safetensors file per site group: ekfac_factors-0000.safetensors, ...
MANIFEST_FILE = "ekfac_factors.json"


def factor_spec(sites: Sequence[SiteShape], row_keys: Sequence[str], *, batch_size: int, correction: str) -> dict:
    """What stored factors must have been fitted for: the sites, the training rows in order, the batching and the
    correction source (both change the float sums' bits, not their meaning)."""
    h = hashlib.sha256("\n".join(row_keys).encode()).hexdigest()
    return {"schema": SCHEMA, "version": EKFAC_VERSION, "sites": [[s.name, s.r, s.d_in, s.d_out] for s in sites],
            "rows": len(row_keys), "rows_sha256": h, "batch_size": int(batch_size), "correction": correction}


def group_file(g: int) -> str:
    return f"{FACTORS_PREFIX}{g:04d}.safetensors"


def write_group(root: Path, g: int, group: Sequence[int], factors: dict, spec: dict) -> tuple[str, str]:
    """One group's factors as safetensors (temporary name, then renamed); (file name, sha256)."""
    from safetensors.numpy import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (i, sd), f in factors.items():
        tensors[f"{i}|{sd}|left"] = np.ascontiguousarray(f.left, dtype=np.float32)
        tensors[f"{i}|{sd}|right"] = np.ascontiguousarray(f.right, dtype=np.float32)
        tensors[f"{i}|{sd}|lam"] = np.ascontiguousarray(f.lam, dtype=np.float64)
    name = group_file(g)
    # Not the index's ".tmp-" prefix: `GradientIndex.open` deletes those as a killed writer's debris.
    tmp = root / f".ekfac-tmp-{name}.{os.getpid()}"
    try:
        save_file(tensors, str(tmp), metadata={"schema": SCHEMA, "spec": json.dumps(spec, sort_keys=True),
                                               "group": str(g), "sites": json.dumps(list(map(int, group)))})
        sha = sha256_file(tmp)
        os.replace(tmp, root / name)
    finally:
        tmp.unlink(missing_ok=True)
    return name, sha


def write_manifest(root: Path, spec: dict, files: list[dict], info: dict) -> None:
    """The manifest last, so a killed fit leaves no manifest naming half-written groups; stale group files of an
    earlier fit go."""
    root = Path(root)
    atomic_write_text(root / MANIFEST_FILE, json.dumps({"schema": SCHEMA, "files": files, "spec": spec, "fit": info},
                                                       indent=1, sort_keys=True))
    keep = {f["file"] for f in files}
    for p in root.glob(f"{FACTORS_PREFIX}*.safetensors"):
        if p.name not in keep:
            p.unlink(missing_ok=True)


def clear_factors(root: Path) -> None:
    """Remove the stored factors (a fresh fit follows)."""
    root = Path(root)
    (root / MANIFEST_FILE).unlink(missing_ok=True)
    for p in root.glob(f"{FACTORS_PREFIX}*.safetensors"):
        p.unlink(missing_ok=True)


def load_factors(root: Path, spec: dict, sites: Sequence[SiteShape]) -> tuple[FactorStore, dict]:
    """The stored factors when they were fitted for `spec` and every group file's bytes match the manifest's
    sha256; else ValueError saying why (the caller refits)."""
    from safetensors import safe_open

    root = Path(root)
    mf = root / MANIFEST_FILE
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{mf}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{mf}: not a {SCHEMA} manifest")
    if manifest.get("spec") != spec:
        raise ValueError(f"{mf}: the factors were fitted for other sites, rows or settings")
    files: dict[int, Path] = {}
    for entry in manifest["files"]:
        path = root / str(entry.get("file"))
        try:
            sha = sha256_file(path)
        except OSError as e:
            raise ValueError(f"{path}: unreadable ({e})") from None
        if sha != entry.get("sha256"):
            raise ValueError(f"{path}: sha256 {sha[:16]}... does not match the manifest's "
                             f"{str(entry.get('sha256'))[:16]}...")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
        except Exception as e:  # safetensors raises its own error types for a malformed file
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        if json.loads(meta.get("spec", "null")) != spec:
            raise ValueError(f"{path}: its header names other settings than the manifest")
        for i in entry.get("sites") or []:
            need = {f"{i}|{sd}|{k}" for sd in SIDES for k in ("left", "right", "lam")}
            if not need <= names:
                raise ValueError(f"{path}: the factors of site {i} are missing")
            files[int(i)] = path
    if sorted(files) != list(range(len(sites))):
        raise ValueError(f"{mf}: names the factors of {len(files)} of {len(sites)} sites")
    return FactorStore(sites, files=files), {**(manifest.get("fit") or {}), "files": len(manifest["files"])}



def _float32(rows) -> bool:
    if rows.index is not None:
        return getattr(rows.index, "storage_dtype", "float32") == "float32"
    return rows.array is not None and rows.array.dtype in (np.float32, np.float64)


def load_or_fit_factors(grads, rows, *, root: Optional[Path] = None,
                        memory_bytes: int = DEFAULT_MEMORY_BYTES) -> tuple[FactorStore, dict]:
    """The EK-FAC factors of `grads`' adapter (an `engine.ModelGradients`) over its training rows, and how they were
    obtained: loaded from `root` (the index directory) when the stored factors were fitted for these sites and
    rows, else fitted and stored there, group by group (in memory when `root` is None). `rows` (a `RowSource`)
    serves the correction when it holds exact float32 gradients."""
    shapes = site_shapes(grads.sites)
    exact_rows = rows is not None and rows.dim == sum(exact_widths(shapes)) and _float32(rows)
    correction = "index rows" if exact_rows else "model pass"
    row_keys = [t.row_key() for t in grads.toks]
    spec = factor_spec(shapes, row_keys, batch_size=grads.batch_size, correction=correction)
    why = None
    if root is not None and (Path(root) / MANIFEST_FILE).exists():
        try:
            store, info = load_factors(root, spec, shapes)
            return store, {**info, "cache": "reused", "dir": str(root)}
        except ValueError as e:
            why = str(e)
            log.warning("EK-FAC factors cannot be used (%s); fitting them again", e)
    kw = dict(batch_size=grads.batch_size, pad_id=grads.pad_id, chunk=grads.chunk, rows=rows if exact_rows else None,
              memory_bytes=memory_bytes)
    if root is None:
        factors, info = fit_factors(grads.model, grads.sites, grads.toks, **kw)
        return FactorStore(shapes, memory=factors), {**info, "cache": "fitted" if why is None else f"refitted: {why}"}
    (Path(root) / MANIFEST_FILE).unlink(missing_ok=True)  # what follows replaces it
    files: list[dict] = []
    paths: dict[int, Path] = {}

    def sink(g, group, got):
        name, sha = write_group(root, g, group, got, spec)
        files.append({"file": name, "sha256": sha, "sites": list(map(int, group))})
        paths.update({int(i): Path(root) / name for i in group})

    _, info = fit_factors(grads.model, grads.sites, grads.toks, sink=sink, **kw)
    write_manifest(root, spec, files, info)
    info = {**info, "cache": "fitted" if why is None else f"refitted: {why}", "files": len(files), "dir": str(root)}
    return FactorStore(shapes, files=paths), info
