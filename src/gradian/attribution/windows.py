"""Best windows of long rows: one wrong sentence in a long document is not diluted by the rest of it.

Windows are runs of `WINDOW_TOKENS` consecutive supervised tokens, stride `WINDOW_STRIDE`. A row with more
supervised tokens than one window is ranked by its best window: the highest sum of its per-token contributions
(`grads.tangents.token_contributions`) over a window, against the item (or the items' mean direction).

Which long rows get windows is a rule (one class each): `EveryLongRow` (an index: every long row, per item up to
`WINDOW_ITEMS_MAX` items) and `TopLongRows` (the one pass and the store: the `WINDOW_ROWS` long rows with the highest
whole-row score along the items' mean, the top `WINDOW_ITEM_ROWS` of those per item, each costing a forward-mode
pass). `best_windows` runs a rule from a `contributions(directions, rows)` function; everything else here is a pure
function of contributions and scores.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from ..setup.tokenize import Tokenized
from .values import Scored

WINDOW_TOKENS = 128
WINDOW_STRIDE = 64
WINDOW_ITEMS_MAX = 16  # per-item window scores of every long row up to this many failing items
WINDOW_JOBS = 4096  # beyond that, per-item windows for the top WINDOW_JOBS // Q long rows (row x item passes)
WINDOW_ROWS = 32  # `TopLongRows`: the long rows windowed are the top WINDOW_ROWS by their whole-row score
WINDOW_ITEM_ROWS = 8  # ... and the top WINDOW_ITEM_ROWS of those by their best window get per-item windows


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


def aggregate_windows(st: Scored, rows: Sequence[int], contribs: dict) -> Scored:
    """`st` with the best windows of `rows` along the items' mean direction (contributions {(p, 0): c}) as their
    aggregate ranking score."""
    rank_agg = st.scores.rank_agg.copy()
    found = dict(st.windows.found)
    for p in rows:
        best, (a, b) = best_window(contribs[(p, 0)])
        rank_agg[p] = best
        found[p] = {"tokens": (a, b), "score": best, "total": float(contribs[(p, 0)].sum())}
    return replace(st, scores=replace(st.scores, rank_agg=rank_agg), windows=replace(st.windows, found=found))


def projected_windows_overwritten(exact: bool, n_rows: int, rerank: int, n_items: int) -> bool:
    """Whether the exact re-rank will recompute every window the projected scores would get: a projected index,
    every row a re-rank candidate (`rerank` >= rows) and per-item windows for every long row (items <=
    `WINDOW_ITEMS_MAX`, so which long rows get them does not depend on the projected scores). The projected windows
    (one forward-mode pass per long row and item) are then skipped: the candidates' exact windows replace all of them,
    the same report either way, at half the windows' cost on a set of up to `rerank` rows."""
    return not exact and rerank >= n_rows and n_items <= WINDOW_ITEMS_MAX


def item_window_rows(st: Scored, rows: Sequence[int], n_items: int) -> list[int]:
    """The long rows that get per-item windows: all of them up to `WINDOW_ITEMS_MAX` items, else the
    `WINDOW_JOBS // Q` highest by their aggregate window score."""
    if n_items <= WINDOW_ITEMS_MAX:
        return list(rows)
    n = max(1, WINDOW_JOBS // n_items)
    return sorted(rows, key=lambda p: (-st.scores.rank_agg[p], p))[:n]


def apply_item_windows(st: Scored, rows: Sequence[int], contribs: dict, n_items: int, *, aggregate: bool) -> Scored:
    """`st` with the per-item best windows of `rows` (contributions {(p, k): c} along each item's direction) in
    `rank_item`; with `aggregate`, the best window of the items' mean contributions is also the row's ranking
    score."""
    rank_item = st.scores.rank_item.copy()
    rank_agg = st.scores.rank_agg.copy()
    found = dict(st.windows.found)
    for p in rows:
        cs = np.stack([contribs[(p, k)] for k in range(n_items)])
        for i in range(n_items):
            rank_item[i, p] = best_window(cs[i])[0]
        if aggregate:
            agg_c = cs.mean(0)
            best, (a, b) = best_window(agg_c)
            rank_agg[p] = best
            found[p] = {"tokens": (a, b), "score": best, "total": float(agg_c.sum())}
    return replace(st, scores=replace(st.scores, rank_item=rank_item, rank_agg=rank_agg),
                   windows=replace(st.windows, found=found))


def candidate_windows(st: Scored, cand: np.ndarray, rows: Sequence[int], item_contribs: dict, agg_contribs: dict,
                      exact_agg: np.ndarray, n_items: int) -> tuple[Scored, np.ndarray]:
    """Exact best windows of the long re-ranked candidates `rows` (of `cand`): per item for those with per-item
    windows (`item_contribs`), else along the mean direction (`agg_contribs`). Returns (`st` with them in
    `rank_item` and the windows, the candidates' exact ranking scores)."""
    item_rows = set(st.windows.item_rows)
    out = exact_agg.copy()
    rank_item = st.scores.rank_item.copy()
    found = dict(st.windows.found)
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
    return replace(st, scores=replace(st.scores, rank_item=rank_item), windows=replace(st.windows, found=found)), out


# ------------------------------------------------------------------------------------------------ the rules


class WindowRule:
    """Which long rows get a window along the items' mean direction, which get per-item windows, and whether the
    per-item windows' mean also sets a row's ranking score."""

    bounded = False

    def aggregate_rows(self, st: Scored, long_rows: Sequence[int]) -> list[int]:  # pragma: no cover - interface
        raise NotImplementedError

    def item_rows(self, st: Scored, long_rows: Sequence[int], aggregated: Sequence[int]) -> list[int]:
        raise NotImplementedError  # pragma: no cover - interface

    def aggregate_items(self, n_items: int) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class EveryLongRow(WindowRule):
    """An index's rows: every long row gets per-item windows up to `WINDOW_ITEMS_MAX` items (their mean is the
    row's ranking score); beyond, every long row a window along the mean and the top `WINDOW_JOBS // Q` per item."""

    def aggregate_rows(self, st, long_rows):
        return list(long_rows) if st.scores.n_items > WINDOW_ITEMS_MAX else []

    def item_rows(self, st, long_rows, aggregated):
        return item_window_rows(st, long_rows, st.scores.n_items)

    def aggregate_items(self, n_items):
        return n_items <= WINDOW_ITEMS_MAX


class TopLongRows(WindowRule):
    """Rows scored without an index (one forward-mode pass per row and direction, whatever the rows): the top
    `WINDOW_ROWS` long rows by whole-row score get their best window along the items' mean (by linearity the mean
    of the per-item contributions), the top `WINDOW_ITEM_ROWS` of them per-item windows too; every other long row
    keeps its whole-row score. In row order: which rows share a forward batch does not depend on the scores."""

    bounded = True

    def aggregate_rows(self, st, long_rows):
        return sorted(sorted(long_rows, key=lambda p: (-st.scores.rank_agg[p], p))[:WINDOW_ROWS])

    def item_rows(self, st, long_rows, aggregated):
        return sorted(sorted(aggregated, key=lambda p: (-st.scores.rank_agg[p], p))[:WINDOW_ITEM_ROWS])

    def aggregate_items(self, n_items):
        return False


def best_windows(st: Scored, long_rows: Sequence[int], rule: WindowRule, contributions: Callable,
                 *, skip: bool = False) -> Scored:
    """`st` with the best windows of its long rows under `rule`. `contributions(per_item, rows)` gives the
    per-token contributions {(p, k): c} in the units of the rows' scores, along the items' mean direction
    (`per_item` false: k = 0) or each item's. With `skip` (`projected_windows_overwritten`) only the bookkeeping."""
    st = replace(st, windows=replace(st.windows, long_rows=tuple(long_rows), bounded=rule.bounded))
    if not long_rows:
        return st
    Q = st.scores.n_items
    agg = rule.aggregate_rows(st, long_rows)
    if agg:
        st = aggregate_windows(st, agg, contributions(False, agg))
    items = rule.item_rows(st, long_rows, agg)
    st = replace(st, windows=replace(st.windows, item_rows=tuple(items), all_items=len(items) == len(long_rows)))
    if skip or not (Q and items):
        return st
    return apply_item_windows(st, items, contributions(True, items), Q, aggregate=rule.aggregate_items(Q))
