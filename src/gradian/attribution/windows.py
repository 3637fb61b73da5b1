"""Best windows of long rows: one wrong sentence in a long document is not diluted by the rest of it.

Windows are runs of `WINDOW_TOKENS` consecutive supervised tokens, stride `WINDOW_STRIDE`. A row with more
supervised tokens than one window is ranked by its best window: the highest sum of its per-token contributions
(`grads.tangents.token_contributions`) over a window, against the item (or the items' mean direction). Everything
here is a pure function of contributions and scores.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..setup.tokenize import Tokenized

WINDOW_TOKENS = 128
WINDOW_STRIDE = 64
WINDOW_ITEMS_MAX = 16  # per-item window scores of every long row up to this many failing items
WINDOW_JOBS = 4096  # beyond that, per-item windows for the top WINDOW_JOBS // Q long rows (row x item passes)


def windows(n: int, size: int = WINDOW_TOKENS, stride: int = WINDOW_STRIDE) -> list[tuple[int, int]]:
    """[a, b) runs over n supervised tokens: one run when n <= size, else size-long runs every `stride`, the last
    one ending at n."""
    if n <= size:
        return [(0, n)]
    starts = list(range(0, n - size + 1, stride))
    if starts[-1] != n - size:
        starts.append(n - size)
    return [(a, a + size) for a in starts]


def best_window(contrib: np.ndarray, size: int = WINDOW_TOKENS, stride: int = WINDOW_STRIDE) -> tuple[float, tuple[int, int]]:
    """The highest window sum of a contribution vector and its [a, b) token range (first one on ties)."""
    c = np.concatenate([[0.0], np.cumsum(np.asarray(contrib, dtype=np.float64))])
    best, where = -np.inf, (0, 0)
    for a, b in windows(len(contrib), size, stride):
        v = c[b] - c[a]
        if v > best:
            best, where = float(v), (a, b)
    return (best if np.isfinite(best) else 0.0), where


def is_long(tok: Tokenized, size: int = WINDOW_TOKENS) -> bool:
    return tok.n_supervised > size


def long_rows(toks: Sequence[Tokenized]) -> list[int]:
    return [p for p, t in enumerate(toks) if is_long(t)]


def aggregate_windows(sc, rows: Sequence[int], contribs: dict):
    """`sc` with the best windows of `rows` along the items' mean direction (contributions {(p, 0): c}) as their
    aggregate ranking score; used when there are too many items for per-item windows of every long row."""
    rank_agg = sc.rank_agg.copy()
    found = dict(sc.windows)
    for p in rows:
        best, (a, b) = best_window(contribs[(p, 0)])
        rank_agg[p] = best
        found[p] = {"tokens": (a, b), "score": best, "total": float(contribs[(p, 0)].sum())}
    return replace(sc, rank_agg=rank_agg, windows=found)


def projected_windows_overwritten(exact: bool, n_rows: int, rerank: int, n_items: int) -> bool:
    """Whether the exact re-rank will recompute every window the projected scores would get: a projected index,
    every row a re-rank candidate (`rerank` >= rows) and per-item windows for every long row (items <=
    `WINDOW_ITEMS_MAX`, so which long rows get them does not depend on the projected scores). The projected windows
    (one forward-mode pass per long row and item) are then skipped: the candidates' exact windows replace all of them,
    the same report either way, at half the windows' cost on a set of up to `rerank` rows."""
    return not exact and rerank >= n_rows and n_items <= WINDOW_ITEMS_MAX


def item_window_rows(sc, rows: Sequence[int], n_items: int) -> list[int]:
    """The long rows that get per-item windows: all of them up to `WINDOW_ITEMS_MAX` items, else the
    `WINDOW_JOBS // Q` highest by their aggregate window score."""
    if n_items <= WINDOW_ITEMS_MAX:
        return list(rows)
    n = max(1, WINDOW_JOBS // n_items)
    return sorted(rows, key=lambda p: (-sc.rank_agg[p], p))[:n]


def apply_item_windows(sc, rows: Sequence[int], contribs: dict, n_items: int, *, aggregate: bool):
    """`sc` with the per-item best windows of `rows` (contributions {(p, k): c} along each item's direction) in
    `rank_item`; with `aggregate`, the best window of the items' mean contributions is also the row's ranking
    score."""
    rank_item = sc.rank_item.copy()
    rank_agg = sc.rank_agg.copy()
    found = dict(sc.windows)
    for p in rows:
        cs = np.stack([contribs[(p, k)] for k in range(n_items)])
        for i in range(n_items):
            rank_item[i, p] = best_window(cs[i])[0]
        if aggregate:
            agg_c = cs.mean(0)
            best, (a, b) = best_window(agg_c)
            rank_agg[p] = best
            found[p] = {"tokens": (a, b), "score": best, "total": float(agg_c.sum())}
    return replace(sc, rank_item=rank_item, rank_agg=rank_agg, windows=found)


def candidate_windows(sc, cand: np.ndarray, rows: Sequence[int], item_contribs: dict, agg_contribs: dict,
                      exact_agg: np.ndarray, n_items: int):
    """Exact best windows of the long re-ranked candidates `rows` (of `cand`): per item for those with per-item
    windows (`item_contribs`), else along the mean direction (`agg_contribs`). Returns (`sc` with them in
    `rank_item` and `windows`, the candidates' exact ranking scores)."""
    item_rows = set(sc.window_item_rows)
    out = exact_agg.copy()
    rank_item = sc.rank_item.copy()
    found = dict(sc.windows)
    where = {int(p): j for j, p in enumerate(cand)}
    for p in rows:
        if p in item_rows:
            cs = np.stack([item_contribs[(p, k)] for k in range(n_items)])
            for i in range(n_items):
                rank_item[i, p] = best_window(cs[i])[0]
            agg_c = cs.mean(0)
        else:
            agg_c = agg_contribs[(p, 0)]
        best, (a, b) = best_window(agg_c)
        out[where[p]] = best
        found[p] = {"tokens": (a, b), "score": best, "total": float(agg_c.sum())}
    return replace(sc, rank_item=rank_item, windows=found), out
