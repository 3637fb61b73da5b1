"""The models of report.json's ranking rows (`report.schema.Report.ranking`): a row, its best window, its top span
and, for a conversation, its exchanges."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .schema_base import IntPair, _absent, _Model


class Window(_Model):
    """A long row's best window."""

    tokens: IntPair = Field(description="[a, b): indices among the row's supervised tokens.")
    start: int = _absent("Character offset of the window's start in the row's plain text.")
    end: int = _absent("Character offset of its end.")


class TopSpan(_Model):
    """The row's highest-scoring sentence span against its most-harmed failing item."""

    start: int = Field(description="Character offset into the row's plain text.")
    end: int = Field(description="End character offset (exclusive).")
    text: str = Field(description="The span's text.")
    score: float = Field(description="Sum of the span's supervised-token contributions.")
    item: int = _absent("The eval item the contributions are measured against.")
    item_score: float = _absent("The row's whole score for that item (its spans add up to it).")


class TopTurn(_Model):
    """Chat rows of several exchanges: the exchange (a user turn and the assistant's reply) that carries the row's
    score against its most-harmed failing item (`explain.spans.row_turns`); the exchanges' scores add up to it."""

    turn: int = Field(description="0-based index of the exchange (= of its assistant reply) in the conversation.")
    turns: int = Field(description="How many exchanges the row has.")
    text: str = Field(description="The exchange's assistant reply.")
    score: float = Field(description="Sum of the exchange's supervised-token contributions.")
    share: Optional[float] = _absent("Its share of the row's score for that item.")
    item: int = _absent("The eval item the contributions are measured against.")
    scores: list[float] = _absent("Every exchange's score, in conversation order.")


class RankedTurn(_Model):
    """Conversations ranked by their best exchange (`attribution.per_turn`): each exchange's part of the row's
    gradient at unit norm against each failing item; per item the row's ranking score is its best exchange's."""

    turn: int = Field(description="0-based index of the exchange that adds the most to the row's ranking score "
                                  "(the sum of its scores on the items it is the best exchange of).")
    turns: int = Field(description="How many exchanges the row has.")
    text: str = Field(description="That exchange's assistant reply.")
    items: int = Field(description="For how many of the failing items it is the best exchange.")
    scores: list[float] = Field(description="Every exchange's unit score, averaged over the failing items, in "
                                            "conversation order.")


class RankingRow(_Model):
    """One of the top `attribution.top_k` training rows, in rank order."""

    rank: int = Field(description="1-based rank.")
    position: int = Field(description="0-based record number in the training file.")
    id: str = Field(description="Example id, `train-<position:06d>-<content hash>`.")
    score: float = Field(
        description="Total score: > 0 pushed the model toward the failure, < 0 toward the right answer. In a "
                    "smoke test, the squared gradient norm.")
    window_score: float = _absent("The score the ranking uses: best window for long rows, best exchange for "
                                  "conversations ranked by exchange (`turn`), else the total.")
    preview: str = Field(description="The row's text on one line, at most 160 characters.")
    text: str = Field(description="The row's plain text (`role: content` lines for chats); offsets index into it.")
    base_loss: float = Field(description="Mean supervised-token loss under the base (adapter disabled).")
    tuned_loss: float = Field(description="Mean supervised-token loss under the fine-tune.")
    verdict: Literal["taught", "base_believed", "not_learned", "unknown"] = _absent(
        "Attributed only: taught by the fine-tune, base already believed it, or not learned.")
    verdict_text: str = _absent("`verdict` in plain words.")
    window: Window = _absent("Long rows only: the best window.")
    turn: RankedTurn = _absent("Conversations of several exchanges ranked by their best exchange only.")
    top_span: TopSpan = _absent("Top rows with a span drill-down only.")
    top_turn: TopTurn = _absent("Chat rows of several exchanges with a span drill-down only: the exchange that "
                                "carries the score.")
    accused: bool = _absent("Attributed only: the row is in the accused set (`accused`).")
