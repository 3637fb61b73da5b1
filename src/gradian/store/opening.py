"""What `GradientIndex.open` finds on disk, decided before the index object holds any of it: crash debris removed,
the manifest read and checked, and the shards it names kept, or dropped (`rebuild`) or refused (`refuse`) when they
are missing, truncated or fail their sha256. Read-only opening (the ranks of a torchrun job) refuses any problem and
removes nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import IndexError_
from .manifest import MANIFEST, SHARD_RE, Problem, check_shard, move_aside, read_manifest, shard_files

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # a writer's temporary files; any found by the lock holder are a killed writer's debris


class IndexMismatch(IndexError_):
    """An index on disk cannot be used as it is. `reason` is one of: foreign, unreadable, missing, truncated,
    corrupt; `path` is the offending file."""

    def __init__(self, message: str, *, path: Path, reason: str):
        super().__init__(message)
        self.path = Path(path)
        self.reason = reason


@dataclass(frozen=True)
class Found:
    """The usable state of an index directory: its shards' manifest entries (in order), the next shard number, its
    meta, and whether the manifest must be written again (it names what is gone, or it is new)."""

    shards: list[dict] = field(default_factory=list)
    next_shard: int = 0
    meta: dict = field(default_factory=dict)
    rewrite: bool = False


@dataclass(frozen=True)
class Spec:
    """What the caller opens the index for: rows of this key, width and storage dtype."""

    root: Path
    key: str
    dim: int
    storage_dtype: str

    def read_manifest(self) -> tuple[Optional[dict], Optional[Problem], bytes]:
        return read_manifest(self.root, key=self.key, dim=self.dim, storage_dtype=self.storage_dtype)

    def check(self, entry: dict, verify: bool) -> Optional[Problem]:
        return check_shard(self.root, entry, dim=self.dim, storage_dtype=self.storage_dtype, verify=verify)


def remove_debris(root: Path) -> None:
    """Temporary files of writers: the caller holds the lock, so no live writer owns them."""
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            log.info("gradient index %s: removing leftover temporary file %s", root, p.name)
            p.unlink(missing_ok=True)


def remove_unnamed(root: Path, manifest: dict) -> None:
    """Finished shards whose manifest update never landed (killed in between): their rows are redone."""
    referenced = {s["file"] for s in manifest["shards"]}
    referenced |= {s["norms"]["file"] for s in manifest["shards"] if s["norms"] is not None}
    for p in shard_files(root):
        if p.name not in referenced:
            log.info("gradient index %s: removing %s, which the manifest does not name", root, p.name)
            p.unlink(missing_ok=True)


def bad_shards(spec: Spec, manifest: dict, verify: bool, on_mismatch: str) -> tuple[list[dict], list[tuple]]:
    """(the entries that check out, [(problem, entry)] of the others); `refuse`: IndexMismatch listing the bad."""
    problems: list[tuple[Problem, dict]] = []
    keep: list[dict] = []
    for entry in manifest["shards"]:
        pr = spec.check(entry, verify)
        if pr is None:
            keep.append(entry)
        else:
            problems.append((pr, entry))
    if problems and on_mismatch == "refuse":
        listed = "; ".join(str(p) for p, _ in problems[:5])
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        first = problems[0][0]
        raise IndexMismatch(
            f"gradient index {spec.root} has {len(problems)} bad shard(s): {listed}{more}. Delete {spec.root}, or "
            "let it rebuild the bad shards (on_mismatch='rebuild').",
            path=first.path,
            reason=first.reason,
        )
    return keep, problems


def find_for_writing(spec: Spec, on_mismatch: str, verify: bool, meta: Optional[dict]) -> Found:
    """The index at `spec.root` as the one writer finds it (debris and bad shards removed, a foreign manifest moved
    aside or refused). `meta`, when given, replaces the stored meta."""
    root = spec.root
    remove_debris(root)
    manifest, problem, raw = spec.read_manifest()
    if problem is not None:
        if on_mismatch == "refuse":
            raise IndexMismatch(
                f"gradient index {problem}. Delete {root}, or let it rebuild (on_mismatch='rebuild').",
                path=problem.path,
                reason=problem.reason,
            )
        dest = move_aside(root, problem, raw)
        log.warning("gradient index %s; moved it to %s and starting an empty index", problem, dest)
        manifest = None
    if manifest is None:
        return Found(meta=meta if meta is not None else {}, rewrite=True)

    remove_unnamed(root, manifest)
    keep, problems = bad_shards(spec, manifest, verify, on_mismatch)
    for pr, entry in problems:
        for name in (entry["file"], entry["norms"]["file"] if entry["norms"] else None):
            if name:
                (root / name).unlink(missing_ok=True)
        log.warning("gradient index %s; removed the shard, its %d rows will be recomputed", pr, entry["rows"])
    numbers = [int(SHARD_RE.fullmatch(s["file"]).group(1)) for s in manifest["shards"]]
    stored_meta = manifest["meta"]
    use_meta = stored_meta if meta is None else meta
    return Found(shards=keep, next_shard=max(numbers, default=-1) + 1,  # never reuse a number the manifest names
                 meta=use_meta, rewrite=bool(problems) or use_meta != stored_meta)


def find_read_only(spec: Spec, verify: bool) -> Found:
    """The index at `spec.root` as a reader finds it: any problem (no manifest, a foreign one, a bad shard) is an
    `IndexMismatch`, and nothing is removed."""
    manifest, problem, _ = spec.read_manifest()
    if problem is None and manifest is None:
        raise IndexMismatch(f"gradient index {spec.root} has no manifest: build it first",
                            path=spec.root / MANIFEST, reason="missing")
    if problem is not None:
        raise IndexMismatch(f"gradient index {problem}", path=problem.path, reason=problem.reason)
    for entry in manifest["shards"]:
        pr = spec.check(entry, verify)
        if pr is not None:
            raise IndexMismatch(f"gradient index {pr}", path=pr.path, reason=pr.reason)
    return Found(shards=list(manifest["shards"]), meta=manifest["meta"])
