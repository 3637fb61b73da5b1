"""Files that are never half written, and the hashes that name or check them.

Every output Gradian writes goes through `atomic_write` (a temporary name in the same directory, fsync, then
`os.replace`) or `atomic_dir` (a temporary directory renamed into place): a crash or a kill leaves the old file or
the new one, never a torn one. `sha256_*` and the fingerprints are the one way files, directories and JSON values
are hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional


class _HashingWriter:
    """File-like sink that hashes what it writes, so a file written once need not be read back to be checked."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.nbytes += len(b)
        return self._f.write(b)


def fsync_dir(path: Path) -> None:
    # Makes a rename durable across power loss; some filesystems refuse, which only weakens that.
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


def atomic_write(path: Path | str, write: Callable[[Any], None], *, tmp_name: Optional[str] = None,
                 durable: bool = True) -> tuple[str, int]:
    """Write `path` through `write(f)` (a binary sink) so that it either does not change or is complete.

    `tmp_name` names the temporary file in the same directory (default `.NAME.PID.tmp`). Returns the sha256 (hex)
    and the size of what was written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (tmp_name or f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            sink = _HashingWriter(f)
            write(sink)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return sink.sha.hexdigest(), sink.nbytes


def atomic_write_bytes(path: Path | str, data: bytes, **kw) -> tuple[str, int]:
    return atomic_write(path, lambda f: f.write(data), **kw)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_npy(path: Path | str, arr) -> None:
    import numpy as np

    atomic_write(path, lambda f: np.save(f, arr))


@contextmanager
def atomic_dir(final: Path | str) -> Iterator[Path]:
    """A temporary directory beside `final`, renamed to `final` (replacing it) when the block ends without error
    and removed otherwise."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- hashes


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any, **dumps_kw) -> str:
    """sha256 of `json.dumps(obj, sort_keys=True, **dumps_kw)`: the same value, the same hash on every machine."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, **dumps_kw).encode("utf-8")).hexdigest()


def content_hash(obj: Any, n: int = 8) -> str:
    """Short hash of a JSON value (records, eval items): what an example id embeds."""
    return sha256_json(obj, ensure_ascii=False, separators=(",", ":"))[:n]


def file_fingerprint(path: Path | str) -> str:
    return sha256_file(path)[:16]


FINGERPRINT_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".jinja")


def dir_fingerprint(path: str | Path) -> str:
    """Content hash of a model/adapter directory's config and weight files (its top level only); a hub id hashes as
    its name."""
    p = Path(path)
    if not p.is_dir():
        return hashlib.sha256(str(path).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and (f.suffix in FINGERPRINT_SUFFIXES):
            h.update(f.name.encode())
            h.update(file_fingerprint(f).encode())
    return h.hexdigest()[:16]


def dir_digest(path: Path | str, exclude: Iterable[str] = ()) -> str:
    """sha256 over every file of a directory's top level (name and bytes), but `exclude`: a seal of its content."""
    p = Path(path)
    skip = set(exclude)
    h = hashlib.sha256()
    for name in sorted(x.name for x in p.iterdir() if x.is_file() and x.name not in skip):
        h.update(name.encode() + b"\0" + (p / name).read_bytes())
    return h.hexdigest()


def human(n: float) -> str:
    """A byte count as people read it: 512 B, 3.1 MiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
