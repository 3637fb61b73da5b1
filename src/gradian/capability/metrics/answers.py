"""The metrics that compare a generated answer with the item's reference: exact_match, contains, regex."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ...config import MetricKind
from ...errors import DataError
from .base import Metric, no_settings


def normalize_answer(s: str) -> str:
    """exact_match normalisation: surrounding white space and one trailing period."""
    s = s.strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    return s


def exact_match(generated: str, expected: str) -> float:
    return float(normalize_answer(generated) == normalize_answer(expected))


def contains(generated: str, expected: str) -> float:
    return float(expected.strip().lower() in generated.lower())


@dataclass(frozen=True)
class ExactMatchMetric(Metric, kind=MetricKind.exact_match):
    """The answer equals the reference after stripping white space and one trailing period."""

    binary = True

    @classmethod
    def from_settings(cls, name: str, **settings) -> "ExactMatchMetric":
        no_settings(name, **settings)
        return cls(name)

    def score(self, item, generated: str) -> float:
        return exact_match(generated, item.answer)


@dataclass(frozen=True)
class ContainsMetric(Metric, kind=MetricKind.contains):
    """The reference is a case-insensitive substring of the answer."""

    binary = True

    @classmethod
    def from_settings(cls, name: str, **settings) -> "ContainsMetric":
        no_settings(name, **settings)
        return cls(name)

    def score(self, item, generated: str) -> float:
        return contains(generated, item.answer)


@dataclass(frozen=True)
class RegexMetric(Metric, kind=MetricKind.regex):
    """`re.search` of `pattern` (each item's answer when None) in the answer; `negate` passes the non-matches."""

    pattern: Optional[str] = None
    negate: bool = False

    binary = True
    needs_settings = True

    @classmethod
    def from_settings(cls, name: str, *, pattern=None, negate=False, fn=None) -> "RegexMetric":
        no_settings(name, fn=fn)
        return cls(name, pattern, bool(negate))

    @property
    def defines_class(self) -> bool:
        return self.pattern is not None  # one pattern for every item: a class; else each item's own answer

    @property
    def needs_answer(self) -> bool:
        return self.pattern is None  # the item's answer is its pattern

    def check_items(self, items) -> None:
        """Every item's answer compiles as a pattern (without evaluation.pattern): DataError naming it."""
        if self.pattern is not None:
            return
        for it in items:
            try:
                re.compile(it.answer)
            except re.error as e:
                raise DataError(f"{it.source or it.id}: 'answer' is not a valid regular expression ({e}): "
                                f"{it.answer!r}; with evaluation.metric: regex each item's answer is the pattern "
                                "searched in the generated answer (or set evaluation.pattern for every item)",
                                check="data.invalid_record") from None

    def describe(self) -> str:
        what = repr(self.pattern) if self.pattern is not None else "each item's answer"
        return f"{super().describe()} (regex {'not ' if self.negate else ''}matching {what})"

    def score(self, item, generated: str) -> float:
        hit = re.search(self.pattern if self.pattern is not None else item.answer, generated) is not None
        return float(hit != self.negate)
