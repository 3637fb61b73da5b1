"""Where each token of a rendered row comes from: its characters in the record's plain text, and for a
conversation its exchange (a user turn and the assistant's reply to it).

Character offsets index `Example.plain_text()` (for `messages` rows "role: content" lines). Tokens are mapped there
through `Tokenized.offsets` (into the rendered text) and the position of each message's content in both renderings;
template tokens (a turn's end-of-turn token) belong to the record character before them. Used by the span
drill-down (`explain.spans`) and by the one pass's per-exchange scores (`attribution.one_pass`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .records import Example
from .tokenize import Tokenized


def _rendered_to_plain(ex: Example, tok: Tokenized) -> Optional[np.ndarray]:
    """For each character of the rendered text, its plain-text character (or -1 when it is template text)."""
    rendered, plain = tok.text, ex.plain_text()
    if ex.messages() is None:
        m = np.full(len(rendered), -1, dtype=np.int64)
        k = min(len(rendered), len(plain))
        if rendered[:k] == plain[:k]:
            m[:k] = np.arange(k)
            return m
        start = rendered.find(plain)
        if start < 0:
            return None
        m[start : start + len(plain)] = np.arange(len(plain))
        return m
    m = np.full(len(rendered), -1, dtype=np.int64)
    cur, ppos = 0, 0
    for msg in ex.messages():
        ppos += len(msg["role"]) + 2
        c = msg["content"]
        at = rendered.find(c, cur) if c else cur
        if at < 0:
            return None
        m[at : at + len(c)] = np.arange(ppos, ppos + len(c))
        cur = at + len(c)
        ppos += len(c) + 1
    return m


def token_char_ranges(ex: Example, tok: Tokenized, tokenizer=None) -> list[tuple[int, int]]:
    """For each token of `tok`, the [start, end) plain-text characters it covers. A token with no record character
    (template text, e.g. an end-of-turn token) gets the empty range at the end of the last record character before
    it; (-1, -1) when nothing maps (no offsets and no tokenizer to rebuild them)."""
    offsets = tok.offsets
    if offsets is None and tokenizer is not None:
        offsets = _rebuild_offsets(tok, tokenizer)
    n = len(tok.input_ids)
    cmap = _rendered_to_plain(ex, tok) if offsets is not None else None
    if cmap is None:
        return [(-1, -1)] * n
    out, last = [], -1
    for a, b in offsets[:n]:
        hits = [int(cmap[c]) for c in range(max(a, 0), min(b, len(cmap))) if cmap[c] >= 0]
        if hits:
            out.append((hits[0], hits[-1] + 1))
            last = hits[-1]
            continue
        prev = -1
        for c in range(min(a, len(cmap)) - 1, -1, -1):
            if cmap[c] >= 0:
                prev = int(cmap[c])
                break
        prev = prev if prev >= 0 else last
        out.append((prev + 1, prev + 1) if prev >= 0 else (-1, -1))
    return out


def token_char_anchors(ex: Example, tok: Tokenized, tokenizer=None) -> list[int]:
    """For each token, a plain-text character it belongs to: its first record character, else (template tokens)
    the last record character before it; -1 when none."""
    return [a if b > a else (a - 1 if a > 0 else -1) for a, b in token_char_ranges(ex, tok, tokenizer)]


def _rebuild_offsets(tok: Tokenized, tokenizer) -> Optional[list[tuple[int, int]]]:
    """Offsets by decoding each token and finding it in the rendered text in order (templates whose token ids
    differ from the plain encoding; best effort)."""
    out, cur = [], 0
    for t in tok.input_ids:
        piece = tokenizer.decode([t])
        at = tok.text.find(piece, cur) if piece else -1
        if at < 0:
            out.append((cur, cur))
            continue
        out.append((at, at + len(piece)))
        cur = at + len(piece)
    return out


def supervised_token_indices(tok: Tokenized) -> list[int]:
    """Positions of the supervised targets, in the order `token_contributions` lists them."""
    return [i for i, s in enumerate(tok.supervised) if s and i > 0]


def exchange_ranges(ex: Example) -> list[tuple[int, int, int]]:
    """(start, end, exchange) plain-text character ranges of a chat row's messages, each message labelled with its
    exchange: the number of assistant messages before it (a user turn and the assistant's reply to it share one;
    a system message belongs to the first). [] for rows that are not chats."""
    msgs = ex.messages()
    if msgs is None:
        return []
    out, pos, k = [], 0, 0
    for m in msgs:
        pos += len(m["role"]) + 2
        out.append((pos, pos + len(m["content"]), k))
        pos += len(m["content"]) + 1
        k += m["role"] == "assistant"
    return out


def token_exchanges(ex: Example, tok: Tokenized, tokenizer=None) -> Optional[np.ndarray]:
    """int64 [len(tok.input_ids)]: the exchange of every token of a conversation (`exchange_ranges`; template tokens
    with the message they close), or None when the row is not a chat of at least two exchanges with supervised
    tokens, or its tokens cannot be mapped to its messages."""
    ranges = exchange_ranges(ex)
    if len({k for _, _, k in ranges}) < 2:
        return None
    anchors = token_char_anchors(ex, tok, tokenizer)
    if all(a < 0 for a in anchors):
        return None
    starts = np.array([a for a, _, _ in ranges])
    ex_of = np.array([k for _, _, k in ranges])
    m = np.searchsorted(starts, np.asarray(anchors), side="right") - 1
    out = ex_of[np.clip(m, 0, len(ranges) - 1)]
    out[np.asarray(anchors) < 0] = 0  # before any message content: the first exchange's template header
    sup = [out[i] for i, s in enumerate(tok.supervised) if s and i > 0]
    if len(set(int(k) for k in sup)) < 2:
        return None
    return out.astype(np.int64)
