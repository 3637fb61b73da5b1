"""Building (or reusing) the gradient index: its cache key, the data-aware basis, the capture loop into shards.

No maths here: the gradients come from `grads.capture`, the storage is `store.index`; this module decides which
rows are missing, in which batches they are captured (by length, then position: the same bits every run), and
seals what it wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np


from ..config import Config
from ..grads.capture import GradientCapture
from ..grads.layout import exact_widths, site_shapes
from ..io import dir_fingerprint, sha256_file
from ..progress import progress_bar
from ..projection import BASIS_FILE, ProjectionChoice, Projector, choose_projection
from .. import distributed as dist_
from ..setup.batches import batches, length_order, owned_batches
from ..setup.model import LoraSite
from ..setup.tokenize import Tokenized
from .index import SCORE_BLOCK_BYTES, GradientIndex

log = logging.getLogger(__name__)

PARTS_DIR = "parts"  # under torchrun each rank writes its shards to root/parts/rank-R; rank 0 adopts them
SHARD_BYTES = 256 << 20  # float32 bytes of one shard (and of the build's write buffer), at most about

# Bump when the gradient definition changes (loss, masks, projection scheme): old caches become foreign.
GRADIENT_VERSION = 1


@dataclass
class IndexInfo:
    key: str
    root: Path
    dim: int
    storage_dtype: str
    examples: int
    reused: int
    built: int
    bytes: int
    projection: dict | None
    seconds: float
    choice: ProjectionChoice | None = None

    def summary(self) -> dict:
        proj = self.projection
        if proj is not None and self.choice is not None:
            proj = {**proj, "setting": self.choice.setting, "reason": self.choice.reason}
        out = {
            "key": self.key, "examples": self.examples, "dim": self.dim, "dtype": self.storage_dtype, "bytes": self.bytes,
            "projection": proj, "reused_rows": self.reused, "built_rows": self.built, "path": str(self.root),
        }
        if self.choice is not None:
            out["projection_choice"] = self.choice.describe()
        return out


def projection_choice(cfg: Config, sites: Sequence[LoraSite], rows: int) -> ProjectionChoice:
    """`grads.projection_dim` resolved for `rows` rows on these sites (`projection.auto`)."""
    g = cfg.grads
    return choose_projection(g.projection_dim, sum(exact_widths(sites)), rows, g.storage_dtype)


def make_projector(cfg: Config, sites: Sequence[LoraSite], rows: int = 0) -> Projector:
    g = cfg.grads
    return Projector(site_shapes(sites), projection_choice(cfg, sites, rows).dim, g.projection_kind,
                     g.projection_seed, fit_rows=g.projection_fit_rows)


def model_fingerprints(cfg: Config, adapter_path: str) -> tuple[str, str]:
    """(base, adapter): the content fingerprints of the model's directories, read once per index opened (its key and
    its manifest both name them)."""
    base = cfg.local_or_hub(cfg.model.base)
    return dir_fingerprint(base), dir_fingerprint(adapter_path)


def cache_key(cfg: Config, sites: Sequence[LoraSite], projector: Projector, adapter_path: str,
              fingerprints: Optional[tuple[str, str]] = None) -> str:
    """Model, adapter and every setting the vectors depend on. Data is not in it: rows are keyed by content.
    `fingerprints`: `model_fingerprints` when the caller has them already."""
    g = cfg.grads
    base_fp, adapter_fp = fingerprints or model_fingerprints(cfg, adapter_path)
    payload = {
        "v": GRADIENT_VERSION,
        "base": base_fp,
        "adapter": adapter_fp,
        "dtype": cfg.model.dtype,
        # gradients through a quantized base differ from the full-precision ones (absent for none: old keys hold)
        **({"quantization": cfg.model.quantization} if cfg.model.quantization != "none" else {}),
        "sites": [s.name for s in sites],
        "projection": projector.spec(),  # settings only: a fitted basis is bound to the index by its sha256
        "storage_dtype": g.storage_dtype,
        "max_seq_length": g.max_seq_length,
    }
    # A hub dataset's rows are keyed by content like a file's; its repo, split and snapshot commit are added so that
    # two revisions never share one index directory (a local file keeps the key it always had).
    from ..setup.records import data_location, location_fingerprint

    hub = location_fingerprint(data_location(cfg, cfg.data.train))
    if hub is not None:
        payload["data"] = hub
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def basis_sample(toks: Sequence[Tokenized], n: int, seed: int) -> list[int]:
    """Positions of the rows a data-aware basis is fitted on: a seeded sample of the rows with supervised tokens,
    in (length, position) order so the batches, and so the bits, are the same on every run."""
    cand = [i for i, t in enumerate(toks) if t.n_supervised > 0]
    if len(cand) > n:
        pick = np.random.default_rng([int(seed), 0x62617369]).choice(len(cand), size=n, replace=False)
        cand = [cand[j] for j in sorted(pick.tolist())]
    return length_order(toks, cand)


def ensure_basis(cfg: Config, capture: GradientCapture, toks: Sequence[Tokenized], root: Path, pad_id: int):
    """A data-aware projector's basis: loaded from `root/projection_basis.safetensors` when that file was fitted
    for these settings, else fitted on `basis_sample` rows with exact per-example gradients (two capture passes
    over at most `projector.fit_rows` rows, before the index build) and written there. Returns its sha256; None
    for the random kinds. Once stored, the basis stays with the index: rows added later are projected with it, so
    every stored vector shares one basis."""
    proj = capture.projector
    if proj.kind != "data-aware" or proj.exact:
        return None
    path = root / BASIS_FILE
    if proj.basis is None and path.exists():
        try:
            return proj.load_basis(path)
        except (OSError, ValueError) as e:
            log.warning("projection basis %s cannot be used (%s); fitting a new one", path, e)
    if proj.basis is None:
        positions = basis_sample(toks, proj.fit_rows, proj.seed)
        if not positions:
            raise ValueError("a data-aware projection needs training rows with supervised tokens to fit on")
        device = next(capture.model.parameters()).device
        fitter = proj.fitter()
        with progress_bar("fit projection", total=fitter.passes * len(positions)) as bar:
            for _ in range(fitter.passes):  # the same batches each pass: wide-side directions, then site PCA
                for batch, ids, attn, sup in batches(toks, positions, cfg.grads.batch_size, pad_id, device):
                    site_iter, _ = capture.iter_site_grads(ids, attn, sup)
                    for i, (dA, dB) in site_iter:  # one site at a time: never batch x exact width at once
                        fitter.update(i, dA, dB)
                    bar.advance(len(batch))
                fitter.end_pass()
        proj.set_basis(fitter.finish())
    elif proj.basis_sha256 and path.exists() and sha256_file(path) == proj.basis_sha256:
        return proj.basis_sha256
    return proj.save_basis(path)


def build_index(cfg: Config, capture: GradientCapture, toks: Sequence[Tokenized], *, key: str, pad_id: int,
                meta: dict) -> tuple[GradientIndex, list[str], IndexInfo]:
    """Capture the rows the index lacks, in length-sorted batches (less padding), and return it open for scoring.

    Under torchrun the batches are dealt out (batch j to rank j % N, the batches one process would run, so each
    vector has the bits one process gives it); each rank writes its own shards to `root/parts/rank-R` (an index
    of the same key, sealed shard by shard), and rank 0 adopts them into the index after a barrier. Parts left by
    a killed run are adopted by the next one, whatever its world size, before it decides what is missing. Every
    rank then opens the sealed index read-only."""
    t0 = time.time()
    ranks = dist_.current()
    row_keys = [t.row_key() for t in toks]
    root = cfg.index_dir / key
    bs = cfg.grads.batch_size
    store_key = key
    # A data-aware basis is fitted once, by rank 0; the file beside the index is how the others get it.
    sha = ensure_basis(cfg, capture, toks, root, pad_id) if ranks.is_main else None
    if ranks.active:
        dist_.barrier()
        if not ranks.is_main:
            sha = ensure_basis(cfg, capture, toks, root, pad_id)
    if sha is not None:
        # Shards are only valid with the basis they were projected with: an index built with another basis
        # (a refit after the file was lost or changed) has another store key, so `open` moves it aside.
        store_key = f"{key}+basis-{sha[:16]}"
        meta = {**meta, "projection": capture.projector.describe(), "block_dims": capture.projector.site_dims(),
                "projection_basis": {"file": BASIS_FILE, "sha256": sha}}
    # Shards end on batch boundaries, so a resumed build replays exactly the batches the killed one would have run;
    # and hold at most about SHARD_BYTES (the write buffer is one shard: 256 exact rows at 4.9M dims would be 5 GB).
    shard_rows = min(cfg.grads.shard_rows, max(1, SHARD_BYTES // (4 * max(capture.dim, 1))))
    shard_rows = -(-shard_rows // bs) * bs
    opts = dict(key=store_key, dim=capture.dim, storage_dtype=cfg.grads.storage_dtype, shard_rows=shard_rows)
    index, plan = None, None
    if ranks.is_main:
        index = GradientIndex.open(root, meta=meta, **opts)
        adopt_parts(index, root)
        missing = index.missing(row_keys)
        # Deduplicate identical rows: one capture serves all of them.
        seen, todo = set(), []
        for i in missing:
            if row_keys[i] not in seen:
                seen.add(row_keys[i])
                todo.append(i)
        # Stable order (by length, then position) keeps batches, and so the bits, the same on every run.
        plan = (len(missing), length_order(toks, todo))
    n_missing, todo = dist_.broadcast(plan)
    device = next(capture.model.parameters()).device
    with progress_bar("index", total=len(todo), split=True) as bar:
        if not ranks.active:
            sink = index
        elif todo:
            sink = GradientIndex.open(root / PARTS_DIR / f"rank-{ranks.rank}", meta={"part_of": store_key}, **opts)
        else:
            sink = None
        try:
            for _, batch, ids, attn, sup in owned_batches(toks, todo, bs, pad_id, device, owned=ranks.owns):
                vecs, _ = capture.vectors(ids, attn, sup)
                sink.add([row_keys[i] for i in batch], vecs.detach().cpu().numpy().astype(np.float32))
                bar.advance(len(batch))
        finally:
            if sink is not None and sink is not index:
                sink.close()
    if ranks.active:
        dist_.barrier()  # every part sealed
        if ranks.is_main:
            adopt_parts(index, root, world=ranks.world)
            index.close()
        dist_.barrier()  # the index sealed: every rank reads it (rank 0 verified the checksums a moment ago)
        index = GradientIndex.open(root, read_only=True, verify=False, **opts)
    else:
        index.flush()
    info = IndexInfo(key=key, root=root, dim=capture.dim, storage_dtype=cfg.grads.storage_dtype, examples=len(toks),
                     reused=len(toks) - n_missing, built=len(todo), bytes=index.nbytes,
                     projection=capture.projector.describe(), seconds=time.time() - t0)
    return index, row_keys, info


def adopt_parts(index: GradientIndex, root: Path, world: int | None = None) -> int:
    """Rank parts under `root/parts` adopted into `index`, in rank order (the manifest names each shard's rank);
    returns the rows adopted."""
    parts = root / PARTS_DIR
    if not parts.is_dir():
        return 0
    done = 0
    names = sorted((p for p in parts.iterdir() if p.is_dir()),
                   key=lambda p: (0, int(p.name[5:])) if p.name[5:].isdigit() else (1, p.name))
    for part in names:
        label = part.name.replace("-", " ")
        origin = f"{label} of {world}" if world else f"{label} of an earlier run"
        n = index.adopt(part, origin=origin)
        if n:
            log.info("gradient index %s: adopted %d rows from %s", root, n, part.name)
        done += n
    try:
        parts.rmdir()
    except OSError:
        pass
    return done


@dataclass
class OpenIndex:
    """An index open for scoring: the capture that wrote it (its projector), the rows of the training set in order
    (`row_keys`, one per row: copies share a key) and what was built."""

    capture: GradientCapture
    index: GradientIndex
    row_keys: list[str]
    info: IndexInfo

    @property
    def rows(self):
        from .rows import RowSource

        return RowSource(index=self.index, row_keys=self.row_keys)

    def close(self) -> None:
        self.index.close()

    def closed_rows(self):
        """The training rows as a RowSource that opens the index read-only for each read: a value handed to later
        stages (clusters' features) holds no open file or lock."""
        from .rows import RowSource

        ix = self.index
        return RowSource(index=Reopening(ix.root, ix.key, ix.dim, ix.storage_dtype, ix.meta), row_keys=self.row_keys)


@dataclass(frozen=True)
class Reopening:
    """A sealed index, opened read-only (a shared lock, no checksum pass) for each read and closed after it: what
    `RowSource` reads from `GradientIndex` (`rows`, `score`, `score_block_rows`)."""

    root: Path
    key: str
    dim: int
    storage_dtype: str
    meta: dict

    def _open(self) -> GradientIndex:
        return GradientIndex.open(self.root, key=self.key, dim=self.dim, storage_dtype=self.storage_dtype,
                                  read_only=True, verify=False)

    def rows(self, keys):
        with self._open() as ix:
            return ix.rows(keys)

    def score(self, queries, keys, **kw):
        with self._open() as ix:
            return ix.score(queries, keys, **kw)

    def score_block_rows(self, block_rows: int = 4096) -> int:
        return min(block_rows, max(1, SCORE_BLOCK_BYTES // (4 * max(self.dim, 1))))


def open_index(cfg: Config, model, sites: Sequence[LoraSite], toks: Sequence[Tokenized], adapter_path: str,
               pad_id: int) -> OpenIndex:
    """Build (the rows it lacks) or reuse the gradient index of this adapter's training set, open for scoring."""
    choice = projection_choice(cfg, sites, len(toks))
    proj = make_projector(cfg, sites, len(toks))
    capture = GradientCapture(model, sites, proj, chunk=cfg.grads.loss_chunk_tokens)
    fingerprints = model_fingerprints(cfg, adapter_path)
    key = cache_key(cfg, sites, proj, adapter_path, fingerprints)
    meta = {
        "base": cfg.model.base, "adapter": adapter_path,
        "base_fingerprint": fingerprints[0],
        "adapter_fingerprint": fingerprints[1],
        "sites": [{"name": x.name, "r": x.r, "d_in": x.d_in, "d_out": x.d_out} for x in sites],
        "block_dims": proj.site_dims(), "projection": proj.describe(),
        "grads": cfg.grads.model_dump(mode="json"),
    }
    index, row_keys, info = build_index(cfg, capture, toks, key=key, pad_id=pad_id, meta=meta)
    info.choice = choice
    return OpenIndex(capture, index, row_keys, info)
