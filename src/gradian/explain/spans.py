"""Span drill-down: a row's contributions summed over the sentences of its text.

Character offsets index `Example.plain_text()` (what the report's ranking rows show as `text`; for `messages` rows
"role: content" lines, for `text` and `prompt`/`completion` rows the record's own text). Tokens are mapped there
through `Tokenized.offsets` (into the rendered text) and, for chat-template rows, the position of each message's
content in both renderings; template tokens (a turn's end-of-turn token) count toward the sentence they close. A
row's span scores add up to its per-item score: every supervised token's contribution (`grads.tangents`) lands in
exactly one span.

Conversations (`row_turns`): a chat row's score summed per exchange (a user turn and the assistant's reply), so the
report says which turn of a long conversation carries it (`ranking[i]["top_turn"]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..setup.alignment import (exchange_ranges, supervised_token_indices, token_char_anchors,
                               token_char_ranges)
from ..setup.records import Example
from ..setup.tokenize import Tokenized

SPAN_ROWS = 10  # ranking rows that get a span drill-down
SPANS_PER_ROW = 3


_SENT_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n+")


def sentence_ranges(text: str, start: int = 0, end: Optional[int] = None) -> list[tuple[int, int]]:
    """[start, end) character ranges of the sentences (split after . ! ? plus white space, and at line breaks) of
    text[start:end], surrounding white space trimmed; empty pieces dropped."""
    end = len(text) if end is None else end
    out, a = [], start
    for m in _SENT_END.finditer(text, start, end):
        out.append((a, m.start()))
        a = m.end()
    out.append((a, end))
    trimmed = []
    for a, b in out:
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if b > a:
            trimmed.append((a, b))
    return trimmed


def unit_ranges(ex: Example) -> list[tuple[int, int]]:
    """Sentence ranges of `ex.plain_text()`; for chat rows the sentences of each message's content (a turn never
    merges with the next, and the "role: " prefixes are no sentence)."""
    text = ex.plain_text()
    if ex.messages() is None:
        return sentence_ranges(text)
    out, pos = [], 0
    for m in ex.messages():
        pos += len(m["role"]) + 2
        out.extend(sentence_ranges(text, pos, pos + len(m["content"])))
        pos += len(m["content"]) + 1
    return out


def row_spans(ex: Example, tok: Tokenized, contrib: np.ndarray, tokenizer=None) -> list[dict]:
    """Sentence spans of a row with their summed contributions, sorted by score (highest first).

    Every supervised token's contribution lands in exactly one span (a token outside every sentence goes to the
    nearest sentence before it, else the first), so the span scores add up to the row's score."""
    units = unit_ranges(ex)
    text = ex.plain_text()
    if not units:
        units = [(0, len(text))]
    starts = np.array([a for a, _ in units])
    anchors = token_char_anchors(ex, tok, tokenizer)
    sup = supervised_token_indices(tok)
    contrib = np.asarray(contrib, dtype=np.float64)
    if len(sup) != contrib.size:
        raise ValueError(f"{contrib.size} contributions for {len(sup)} supervised tokens")
    score = np.zeros(len(units))
    ntok = np.zeros(len(units), dtype=np.int64)
    for t, c in zip(sup, contrib):
        ch = anchors[t] if t < len(anchors) else -1
        u = int(np.searchsorted(starts, ch, side="right") - 1) if ch >= 0 else 0
        u = min(max(u, 0), len(units) - 1)
        score[u] += c
        ntok[u] += 1
    spans = [{"start": int(a), "end": int(b), "text": text[a:b], "score": float(sc), "tokens": int(k)}
             for (a, b), sc, k in zip(units, score, ntok) if k > 0]
    spans.sort(key=lambda d: (-d["score"], d["start"]))
    return spans


def row_turns(ex: Example, tok: Tokenized, contrib: np.ndarray, tokenizer=None) -> list[dict]:
    """A chat row's score per exchange (a user turn and the assistant's reply to it), in conversation order:
    {"turn": exchange index (0-based, = the index of its assistant reply), "score", "tokens", "text": the reply}.

    TRL trains every token of a `messages` row when the template has no generation tags, so one planted reply
    among benign ones is a part of a long row's score; summed per exchange, the planted exchange stands out. Every
    supervised token lands in exactly one exchange (template tokens with the message they close or open after),
    so the exchanges' scores add up to the row's score. [] for rows that are not chats."""
    ranges = exchange_ranges(ex)
    if not ranges:
        return []
    msgs = ex.messages()
    starts = np.array([a for a, _, _ in ranges])
    anchors = token_char_anchors(ex, tok, tokenizer)
    sup = supervised_token_indices(tok)
    contrib = np.asarray(contrib, dtype=np.float64)
    if len(sup) != contrib.size:
        raise ValueError(f"{contrib.size} contributions for {len(sup)} supervised tokens")
    n = max(k for _, _, k in ranges) + 1
    score, ntok = np.zeros(n), np.zeros(n, dtype=np.int64)
    for t, c in zip(sup, contrib):
        ch = anchors[t] if t < len(anchors) else -1
        m = int(np.searchsorted(starts, ch, side="right") - 1) if ch >= 0 else 0
        k = ranges[min(max(m, 0), len(ranges) - 1)][2]
        score[min(k, n - 1)] += c
        ntok[min(k, n - 1)] += 1
    replies = [m["content"] for m in msgs if m["role"] == "assistant"]
    return [{"turn": k, "score": float(score[k]), "tokens": int(ntok[k]),
             "text": replies[k] if k < len(replies) else ""} for k in range(n) if ntok[k] > 0]


def top_turn(turns: list[dict], total: float, item: int) -> Optional[dict]:
    """The exchange that carries a multi-exchange row's score (`row_turns`), with its share of the row's score;
    None for rows of one exchange (nothing to tell apart)."""
    if len(turns) < 2:
        return None
    best = max(turns, key=lambda d: (d["score"], -d["turn"]))
    return {"turn": best["turn"], "turns": len(turns), "text": best["text"], "score": best["score"],
            "share": best["score"] / total if total else None, "item": item,
            "scores": [round(d["score"], 6) for d in turns]}


def window_char_range(ex: Example, tok: Tokenized, a: int, b: int, tokenizer=None) -> Optional[tuple[int, int]]:
    """Plain-text character range covered by supervised tokens [a, b) (indices among the supervised tokens)."""
    sup = supervised_token_indices(tok)[a:b]
    ranges = token_char_ranges(ex, tok, tokenizer)
    got = [ranges[t] for t in sup if t < len(ranges) and ranges[t][0] >= 0]
    if not got:
        return None
    return min(r[0] for r in got), max(r[1] for r in got)


@dataclass(frozen=True)
class RankingSpans:
    """What the span drill-down found: the report's `spans` (best first) and, per ranking position, what its row
    gains: `top_span` and, for a conversation, `top_turn`. The ranking rows themselves are not touched."""

    spans: list[dict]
    rows: dict[int, dict]  # position -> {"top_span": ..., "top_turn": ...} (the keys it has)

    def row(self, r: dict) -> dict:
        """Ranking row `r` with what the drill-down adds to it (a new dict)."""
        return {**r, **self.rows[r["position"]]} if r["position"] in self.rows else r


def spans_for(ranking: list[dict], rank_item: np.ndarray, cand: set, examples, toks, qitems, contributions,
              tokenizer=None) -> RankingSpans:
    """Sentence spans of the top `SPAN_ROWS` ranking rows against each row's most-harmed failing item, and each
    such row's `top_span` (and `top_turn`). `contributions(exact_part, positions, items)` gives the per-token
    contributions {(position, item): c} along the directions that reproduce the rows' scores (the exact ones for
    re-ranked candidates `cand`). A row's span scores add up to its per-item score for that item."""
    rows = ranking[:SPAN_ROWS]
    if not rows:
        return RankingSpans([], {})
    positions = [r["position"] for r in rows]
    items = [int(np.argmax(rank_item[:, p])) for p in positions]
    out: list[dict] = []
    tops: dict[int, dict] = {}
    groups = {False: [j for j, p in enumerate(positions) if p not in cand],
              True: [j for j, p in enumerate(positions) if p in cand]}
    for exact_part, js in groups.items():
        if not js:
            continue
        res = contributions(exact_part, [positions[j] for j in js], [items[j] for j in js])
        for j in js:
            p, k = positions[j], items[j]
            contrib = res[(p, k)]
            spans = row_spans(examples[p], toks[p], contrib, tokenizer)
            if not spans:
                continue
            total = float(contrib.sum())
            top = spans[0]
            tops[p] = {"top_span": {"start": top["start"], "end": top["end"], "text": top["text"],
                                    "score": top["score"], "item": int(qitems[k].item), "item_score": total}}
            turn = top_turn(row_turns(examples[p], toks[p], contrib, tokenizer), total, int(qitems[k].item))
            if turn is not None:  # conversations: which exchange of the row carries its score
                tops[p]["top_turn"] = turn
            for sp in spans[:SPANS_PER_ROW]:
                out.append({"position": p, "start": sp["start"], "end": sp["end"], "text": sp["text"],
                            "score": sp["score"], "tokens": sp["tokens"], "item": int(qitems[k].item),
                            "item_score": total, "share": sp["score"] / total if total else None})
    out.sort(key=lambda d: (-d["score"], d["position"], d["start"]))
    return RankingSpans(out, tops)
