"""The model side of scoring, bound to one adapter state: `ModelGradients` (query gradients in the rows' space or
exact, exact row gradients against parameter-space directions, per-token contributions along them), the `Storage`
that says where that state's rows are kept, and the small typed `ScoringSettings` every scoring step reads.

Built at the edge (`gradian.model_side`, from a session), never from a session here. Nothing holds (exact width x
rows) or (exact width x items): exact rows are streamed batch by batch, and parameter-space directions
(`attribution.directions`) and exact query gradients come in fixed blocks of items of at most
`directions.DIRECTION_BYTES`, one pass over the rows scored per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..grads.budget import max_batch_tokens as token_bound
from ..grads.capture import GradientCapture
from ..grads.layout import exact_widths, site_shapes
from ..grads.tangents import token_contributions
from ..progress import progress_bar
from ..projection import Projector
from ..distributed import current, gather_by_index
from ..setup.batches import owned_batches, token_parts
from . import directions as dirs_
from .queries import query_vectors
from .values import Basis


@dataclass(frozen=True)
class ScoringSettings:
    direction: str  # "regression" | "improvement"
    preconditioner: str = "diagonal"
    damping: Optional[float] = None
    rerank: int = 200  # projected index: the top rows re-scored exactly
    fidelity_sample: int = 512  # projected index: rows of the projected-vs-exact self-check
    seed: int = 0
    windows: bool = True  # best-window scores of long rows
    unit_rows: bool = True  # rows scaled to unit norm in the preconditioner's metric (`scoring.row_scales`)
    per_turn: bool = True  # one pass, unit rows: conversations ranked by their best exchange (`one_pass`)
    combine: str = "mean"  # how items combine into a row's ranking score (`scoring.combine_items`): the shortlist's
    top_k: int = 50  # the rows a report ranks (`attribution.top_k`): what a later question's shortlist must hold
    store: str = "full"  # `attribution.store`: the one pass's per-row store, and what a later question does

    @classmethod
    def from_config(cls, cfg, direction: str, **overrides) -> "ScoringSettings":
        a, g = cfg.attribution, cfg.grads
        base = dict(direction=direction, preconditioner=a.preconditioner, damping=a.damping, rerank=g.rerank,
                    fidelity_sample=g.fidelity_sample, seed=cfg.seed, unit_rows=a.unit_rows,
                    per_turn=a.per_turn, top_k=a.top_k, store=a.store)
        return cls(**{**base, **overrides})


@dataclass(frozen=True)
class Storage:
    """Where one adapter state's rows are kept, decided from the config at the edge (`gradian.model_side`).

    `open_index()` builds (the rows it lacks) or reuses the gradient index of this state (a `store.build.OpenIndex`);
    `auto`: `grads.projection_dim` is `auto` (an integer asks for a projected index and its exact re-rank, null for
    the exact index); `exact_index`: it resolves to the exact index (small widths), which is then the row source;
    `locate()`: (the directory of this state's per-row stores (`store.rowstore`), what they are keyed by: the
    model, the adapter state and the data; computed when a pass asks, it hashes the weights); None: none kept."""

    open_index: Callable
    auto: bool = True
    exact_index: bool = False
    locate: Optional[Callable[[], tuple[Path, str]]] = None


@dataclass
class ModelGradients:
    """What scoring needs from the model, for one adapter state: `capture` maps batches to vectors in the rows'
    space (exact for the one pass; an index's projection for an index), the data, and where the rows are kept."""

    capture: GradientCapture
    tokenizer: object
    eval_items: list
    toks: list
    chat: bool
    batch_size: int
    max_len: int
    chunk: int
    timings: dict = field(default_factory=dict)
    _exact: Optional[GradientCapture] = None
    examples: Sequence = ()  # the training records (a conversation's exchanges)
    adapter_path: str = ""
    storage: Optional[Storage] = None

    @property
    def model(self):
        return self.capture.model

    @property
    def sites(self):
        return self.capture.sites

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0

    @property
    def max_batch_tokens(self) -> int:
        """The padded tokens one per-example backward of the pass may hold (`grads.budget`)."""
        return token_bound(self.model, self.sites)

    def parts(self, positions) -> list[list[int]]:
        """`positions` (in the order given) in the batches the pass differentiates them in (`token_parts`)."""
        return token_parts(self.toks, positions, self.batch_size, self.max_batch_tokens)

    def exact(self) -> GradientCapture:
        """A capture of this adapter with no projection (parameter space)."""
        if self._exact is None:
            self._exact = GradientCapture(self.model, self.sites, Projector(site_shapes(self.sites)), chunk=self.chunk)
        return self._exact

    def query_vectors(self, qitems, *, exact: bool = False) -> np.ndarray:
        cap = self.exact() if exact else self.capture
        return query_vectors(cap, self.tokenizer, self.eval_items, qitems, chat=self.chat, max_len=self.max_len,
                             batch_size=self.batch_size).numpy()

    @property
    def exact_width(self) -> int:
        return sum(exact_widths(self.sites))

    def exact_queries(self, qitems) -> Callable[[Sequence[int]], np.ndarray]:
        """ks -> exact (parameter-space) query gradients of items ks, float32 [len(ks), D_exact]. Computed in the
        fixed blocks of `directions.blocks` (so an item's vector has the same bits whichever caller asks) and only
        the last block is kept (at most `directions.DIRECTION_BYTES`): [Q, D_exact] is never held for all items,
        and re-ranking, windows and spans of up to a block of items share one computation."""
        qitems = list(qitems)
        size = dirs_.block_size(self.exact_width)
        cache: dict = {}

        def block(b: int) -> np.ndarray:
            if b not in cache:
                cache.clear()  # the previous block goes before the next is computed
                cache[b] = self.query_vectors(qitems[b * size : (b + 1) * size], exact=True)
            return cache[b]

        def get(ks: Sequence[int]) -> np.ndarray:
            ks = [int(k) for k in ks]
            out = None
            for b in sorted({k // size for k in ks}):
                lo, blk = b * size, block(b)
                if [k - lo for k in ks] == list(range(blk.shape[0])):
                    return blk  # the whole block, in order (callers never write into it)
                if out is None:
                    out = np.empty((len(ks), blk.shape[1]), dtype=np.float32)
                js = [j for j, k in enumerate(ks) if k // size == b]
                out[js] = blk[[ks[j] - lo for j in js]]
            return out if out is not None else np.zeros((0, self.exact_width), dtype=np.float32)

        return get

    def exact_inner(self, dirs, positions: Sequence[int], block_sq: Optional[np.ndarray] = None) -> np.ndarray:
        """Directions (an [Q, D_exact] array or `directions.Directions`) @ exact gradients of the rows at
        `positions` -> [Q, len(positions)] float32. Streamed: no exact row vector is kept, and the directions are
        taken in blocks of at most `directions.DIRECTION_BYTES` (one capture pass over the rows per block).
        `block_sq` ([len(positions), sites], float64), when given, receives each row's squared exact norm per LoRA
        site (taken in the first pass)."""
        dirs = dirs_.as_directions(dirs)
        out = np.zeros((dirs.n, len(positions)), dtype=np.float32)
        widths = exact_widths(self.sites)
        edges = np.concatenate([[0], np.cumsum(widths)]).astype(int)
        device = next(self.model.parameters()).device
        pos = list(positions)
        rows = [self.toks[p] for p in pos]
        order = sorted(range(len(pos)), key=lambda j: (len(rows[j].input_ids), pos[j]))
        exact = self.exact()
        groups = dirs_.blocks(dirs.n, dirs.width)
        ranks = current()  # under torchrun batch j is rank j % N's; the blocks are gathered, each one process's bits
        with progress_bar("exact re-rank", total=len(pos) * len(groups), split=True) as bar:
            for g_i, ks in enumerate(groups):
                d32 = dirs.rows(ks)
                got = {}
                for j, js, ids, attn, sup in owned_batches(rows, order, self.batch_size, self.pad_id, device,
                                                           ranks.owns):
                    vecs, _ = exact.vectors(ids, attn, sup)
                    v = vecs.detach().cpu().numpy()
                    sq = None
                    if block_sq is not None and g_i == 0:
                        sq = np.stack([np.square(v[:, a:b], dtype=np.float64).sum(1)
                                       for a, b in zip(edges[:-1], edges[1:])], axis=1)
                    got[j] = (js, d32 @ v.T, sq)
                    bar.advance(len(js))
                if ranks.active:
                    got = gather_by_index(got)
                for js, blk, sq in got.values():
                    out[ks[0] : ks[-1] + 1, js] = blk
                    if sq is not None:
                        block_sq[js] = sq
                del d32
        return out

    def contributions(self, dirs, positions: Sequence[int], items: Optional[Sequence[int]] = None) -> dict:
        """{(position, k): per-token contributions} along direction k (every direction, or one per row: `items`) of
        an [K, D_exact] array or a `directions.Directions`, taken in blocks of directions."""
        dirs = dirs_.as_directions(dirs)
        toks = [self.toks[p] for p in positions]
        if items is None:
            jobs = [(j, k) for j in range(len(positions)) for k in range(dirs.n)]
        else:
            jobs = [(j, int(k)) for j, k in enumerate(items)]
        out: dict = {}
        for ks in dirs_.blocks(dirs.n, dirs.width):
            lo, hi = ks[0], ks[-1] + 1
            sub = [(j, k - lo) for j, k in jobs if lo <= k < hi]
            if not sub:
                continue
            need = sorted({k for _, k in sub})  # only the directions these jobs use
            where = {k: i for i, k in enumerate(need)}
            d = dirs.rows([lo + k for k in need])
            res = token_contributions(self.model, self.sites, toks, d, pad_id=self.pad_id,
                                      batch_size=self.batch_size, jobs=[(j, where[k]) for j, k in sub],
                                      chunk=self.chunk)
            out.update({(positions[j], lo + need[i]): v for (j, i), v in res.items()})
            del d
        return out


def block_dims_of(index) -> Optional[list[int]]:
    """The per-site block widths an index records (None when unknown or inconsistent with its width)."""
    bd = (index.meta or {}).get("block_dims") if hasattr(index, "meta") else None
    return list(bd) if bd and sum(bd) == index.dim else None


def scaled_contributions(basis: Basis, contribs: dict) -> dict:
    """Per-token contributions {(position, k): c} in the units of the row's score: times its `row_scale`."""
    if basis.row_scale is None:
        return contribs
    return {key: c * basis.scale_of(key[0]) for key, c in contribs.items()}
