"""The per-row store a first pass over the training rows leaves behind (`attribution.one_pass`): a killed pass
resumes where it stopped, a rerun of the same question reads its scores back, and a later question about the same
fine-tune shortlists rows by the store and scores only the shortlist exactly (`attribution.shortlist`).

Layout of ``root/`` (one adapter state, one dataset, one set of scoring settings: the directory's name is its key)::

    manifest.json     schema, key, meta; the preconditioner's file; the held rows' batches; the parts; the question
                      the parts' inner products belong to; `sealed` once every row is in a part
    precond.npz       the fitted preconditioner's state (`RowPreconditioner.state`)
    held.f32          the held rows' exact gradients (float32, rows in position order): what the preconditioner is
                      fitted on, written batch by batch; removed when the pass is sealed (kept when it holds every
                      row: clusters then group on the exact rows, and a later question reads every row from it)
    ref.f32           when not every row is held: the exact gradients of the rows each item's median and scale are
                      measured on (`attribution.scoring.reference_rows`, their exchanges after them), written as the
                      pass computes them: a later question scores them from here, without a backward
    part-00000.npz    per group of rows: their positions, norms in the preconditioner's metric, a sketch of each unit
                      row in that metric (what a later question shortlists by), a unit CountSketch of each row (what
                      clusters group on) and the question's inner products; a conversation's exchanges alike
    .lock             flock held by the one process that has the store open (`store.lock`)

Crash safety is the index's (`store.index`): a part is written under a temporary name, fsynced and renamed, and
counts only once a manifest naming it with its sha256 has been renamed into place; a held batch counts once the
manifest names it with the sha256 of its rows. `open` removes debris and drops whatever does not match its
checksum, so a pass killed at any point recomputes exactly what is missing, in the same batches, and ends with the
bits of an uninterrupted pass. A manifest of another schema or key, or one that cannot be read, empties the store.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from ..io import atomic_write, sha256_file
from .lock import LOCK_FILE, Lock
from .rows import FileRows

log = logging.getLogger(__name__)

SCHEMA = "gradian.rowstore/1"
MANIFEST = "manifest.json"
PRECOND = "precond.npz"
HELD = "held.f32"
REF = "ref.f32"
FILES = {"held": HELD, "ref": REF}  # the files of exact rows, by the manifest entry that names their batches
TMP_PREFIX = ".tmp-"


def _fresh(key: str, meta: dict) -> dict:
    return {"schema": SCHEMA, "key": key, "meta": meta, "precond": None, "question": None, "held": {}, "ref": {},
            "parts": [], "sealed": False}


class RowStore:
    """One adapter state's per-row store (module docstring); `RowStore.open(root, key=..., meta=...)`."""

    def __init__(self, root: Path, key: str, meta: dict, lock: Lock, m: dict):
        self.root, self.key, self.meta, self._lock, self.m = root, key, meta, lock, m

    @classmethod
    def open(cls, root: Path | str, *, key: str, meta: dict, lock_timeout: float = 600.0) -> "RowStore":
        """Open (or create) the store at `root` for `key`, holding its lock until `close()`; whatever on disk does
        not match the key or its checksums is dropped (with a warning naming it)."""
        root = Path(root).absolute()
        root.mkdir(parents=True, exist_ok=True)
        lock = Lock(root / LOCK_FILE, lock_timeout)
        try:
            return cls(root, key, meta, lock, _checked(root, key, json.loads(json.dumps(meta))))
        except BaseException:
            lock.release()
            raise

    # ------------------------------------------------------------------------------------------- manifest

    def _write_manifest(self) -> None:
        data = json.dumps(self.m, indent=1).encode()
        atomic_write(self.root / MANIFEST, lambda f: f.write(data), tmp_name=f"{TMP_PREFIX}{MANIFEST}.{os.getpid()}")

    @property
    def sealed(self) -> bool:
        return bool(self.m["sealed"])

    @property
    def question(self) -> Optional[str]:
        return self.m["question"]

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "RowStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------- the held and reference rows

    def held_rows(self, n: int, width: int) -> FileRows:
        """The held rows' file, [n, width] float32 (created, or kept when it has that shape)."""
        return self.exact_file("held", n, width)

    def held_done(self) -> set[int]:
        return {int(j) for j in self.exact_done("held")}

    def put_held(self, j: int, slots: Sequence[int], rows: np.ndarray) -> None:
        """Rows of held batch `j` into their slots of the held file, then the manifest names the batch with the sha256
        of its rows (in batch order)."""
        self.put_exact("held", str(int(j)), slots, rows)

    def exact_file(self, kind: str, n: int, width: int) -> FileRows:
        """The file of exact rows `kind` ("held" or "ref"), [n, width] float32 (created, or kept when it has that
        shape)."""
        path = self.root / FILES[kind]
        size = 4 * int(n) * int(width)
        h = self.m[kind]
        if not path.exists() or path.stat().st_size != size or h.get("shape") != [int(n), int(width)]:
            with open(path, "wb") as f:
                f.truncate(size)
            self.m[kind] = {"shape": [int(n), int(width)], "batches": {}}
            self._write_manifest()
        return FileRows(path, width, n_file=n)

    def exact_done(self, kind: str) -> set[str]:
        """The names of the batches written into the file of exact rows `kind`."""
        return set(self.m[kind].get("batches", {}))

    def exact_slots(self, kind: str) -> set[int]:
        """The slots of the file of exact rows `kind` that hold a checked row."""
        return {int(s) for b in self.m[kind].get("batches", {}).values() for s in b["slots"]}

    def put_exact(self, kind: str, name: str, slots: Sequence[int], rows: np.ndarray) -> None:
        """`rows` into their slots of the file of exact rows `kind`, then the manifest names the batch `name` with
        the sha256 of its rows (in the order given)."""
        rows = np.ascontiguousarray(rows, dtype="<f4")
        width = rows.shape[1]
        fd = os.open(self.root / FILES[kind], os.O_WRONLY)
        try:
            for s, r in zip(slots, rows):
                os.pwrite(fd, r.tobytes(), int(s) * 4 * width)
        finally:
            os.close(fd)
        self.m[kind]["batches"][name] = {"slots": [int(s) for s in slots],
                                         "sha256": hashlib.sha256(rows.tobytes()).hexdigest()}
        self._write_manifest()

    def drop_held(self) -> None:
        (self.root / HELD).unlink(missing_ok=True)
        self.m["held"] = {}
        self._write_manifest()

    # ------------------------------------------------------------------------------ the preconditioner

    def save_preconditioner(self, state: dict, question: str) -> None:
        """The fitted preconditioner's state, and the question the parts written from now on answer (parts of
        another question are dropped: their inner products are another question's)."""
        data = _npz({k: np.asarray(v) for k, v in state.items()})
        sha, nbytes = atomic_write(self.root / PRECOND, lambda f: f.write(data),
                                   tmp_name=f"{TMP_PREFIX}{PRECOND}.{os.getpid()}")
        if self.m["question"] != question:
            for p in self.m["parts"]:
                (self.root / p["file"]).unlink(missing_ok=True)
            self.m["parts"] = []
            self.m["sealed"] = False
        self.m.update(precond={"file": PRECOND, "sha256": sha, "bytes": nbytes}, question=question)
        self._write_manifest()

    def preconditioner_state(self) -> Optional[dict]:
        if self.m["precond"] is None:
            return None
        with np.load(self.root / PRECOND, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    # ---------------------------------------------------------------------------------------- the parts

    def done(self) -> set[str]:
        """The names of the parts written (`put_part`)."""
        return {p["name"] for p in self.m["parts"]}

    def put_part(self, name: str, arrays: dict) -> None:
        """One part (arrays of its rows, `positions` among them) under the next file name, then the manifest."""
        file = f"part-{len(self.m['parts']):05d}.npz"
        while (self.root / file).exists():
            file = f"part-{len(self.m['parts'])}-{os.urandom(3).hex()}.npz"
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        data = _npz(arrays)
        sha, nbytes = atomic_write(self.root / file, lambda f: f.write(data),
                                   tmp_name=f"{TMP_PREFIX}{file}.{os.getpid()}")
        self.m["parts"].append({"name": name, "file": file, "sha256": sha, "bytes": nbytes,
                                "rows": int(len(arrays["positions"]))})
        self._write_manifest()

    def parts(self) -> Iterator[dict]:
        """Each part's arrays, in the order written."""
        for p in self.m["parts"]:
            with np.load(self.root / p["file"], allow_pickle=False) as z:
                yield {k: z[k] for k in z.files}

    def seal(self, keep_held: bool) -> None:
        """Every row is in a part: a later question reads them (`attribution.shortlist`)."""
        if not keep_held:
            (self.root / HELD).unlink(missing_ok=True)
            self.m["held"] = {}
        self.m["sealed"] = True
        self._write_manifest()

    @property
    def held_file(self) -> Optional[Path]:
        return self.exact_path("held")

    def exact_path(self, kind: str) -> Optional[Path]:
        p = self.root / FILES[kind]
        return p if p.exists() and self.m[kind] else None


def _npz(arrays: dict) -> bytes:
    """An uncompressed .npz of `arrays` (no pickles: every array is numeric or a fixed-width string)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _checked(root: Path, key: str, meta: dict) -> dict:
    """The manifest at `root` with everything it names that is missing or fails its checksum dropped (and the files
    it does not name removed); a fresh one when there is none, or it is foreign or unreadable."""
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            p.unlink(missing_ok=True)
    path = root / MANIFEST
    m = None
    if path.exists():
        try:
            m = json.loads(path.read_text())
            problem = None if isinstance(m, dict) and m.get("schema") == SCHEMA else f"schema is not {SCHEMA}"
            problem = problem or (None if m.get("key") == key else f"built for key {m.get('key')!r}, not {key!r}")
        except (OSError, ValueError) as e:
            problem = f"not valid JSON ({e})"
        if problem:
            log.warning("per-row store %s: %s; starting an empty store", root, problem)
            m = None
    if m is None:
        _clear(root)
        m = _fresh(key, meta)
    else:
        m = _verified(root, m)
    names = {MANIFEST, LOCK_FILE, PRECOND, HELD, REF} | {p["file"] for p in m["parts"]}
    for p in root.iterdir():
        if p.is_file() and p.name not in names:
            p.unlink(missing_ok=True)
    atomic_write(path, lambda f: f.write(json.dumps(m, indent=1).encode()), tmp_name=f"{TMP_PREFIX}{MANIFEST}")
    return m


def _clear(root: Path) -> None:
    for p in root.iterdir():
        if p.name == LOCK_FILE:
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _verified(root: Path, m: dict) -> dict:
    """`m` without the parts, held batches or preconditioner whose bytes do not match their sha256."""
    pre = m.get("precond")
    if pre is not None and not _matches(root / PRECOND, pre["sha256"]):
        log.warning("per-row store %s: %s does not match its checksum; the pass starts again", root, PRECOND)
        return _fresh(m["key"], m["meta"])
    parts = []
    for p in m.get("parts", []):
        if _matches(root / p["file"], p["sha256"]):
            parts.append(p)
        else:
            log.warning("per-row store %s: %s is missing or corrupt; its rows will be recomputed", root, p["file"])
            m["sealed"] = False
    m["parts"] = parts
    for kind in FILES:
        m[kind] = _verified_rows(root, kind, m.get(kind) or {})
    return m


def _verified_rows(root: Path, kind: str, entry: dict) -> dict:
    """The manifest entry of a file of exact rows without the batches whose rows do not match their sha256."""
    if entry.get("batches"):
        width = entry["shape"][1]
        try:
            rows = FileRows(root / FILES[kind], width, n_file=entry["shape"][0])
            ok = {j: b for j, b in entry["batches"].items()
                  if hashlib.sha256(np.ascontiguousarray(rows.subset(b["slots"]).read32(0, len(b["slots"])),
                                                         dtype="<f4").tobytes()).hexdigest() == b["sha256"]}
        except OSError:
            ok = {}
        if len(ok) != len(entry["batches"]):
            log.warning("per-row store %s: %d batches of %s do not match their checksums; they will be recomputed",
                        root, len(entry["batches"]) - len(ok), FILES[kind])
        entry["batches"] = ok
    return entry


def _matches(path: Path, sha: str) -> bool:
    try:
        return sha256_file(path) == sha
    except OSError:
        return False
