"""A user's metric, ``python:module:function``: ``function(prompt, generated, item) -> float in [0, 1]`` (imported by
`loader`); its failures are `ConfigError`s that say where and what to fix, without our traceback."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ...config import MetricKind
from ...errors import ConfigError
from .base import Metric, no_settings


@dataclass(frozen=True)
class PythonMetric(Metric, kind=MetricKind.python):
    """`fn(prompt, generated, item record as a dict)`, checked to return a number in [0, 1]."""

    fn: Optional[Callable[..., Any]] = field(default=None, compare=False)

    needs_settings = True

    @classmethod
    def from_settings(cls, name: str, *, pattern=None, negate=False, fn=None) -> "PythonMetric":
        no_settings(name, pattern=pattern, negate=negate)
        return cls(name, fn)

    @property
    def defines_class(self) -> bool:
        return True  # the user's function is the class of answers that pass

    @property
    def needs_answer(self) -> bool:
        return False  # the function decides from the record

    def score(self, item, generated: str) -> float:
        if self.fn is None:
            raise ValueError(f"metric {self.name!r} does not score generated answers")
        where = item.source or item.id
        try:
            v = self.fn(item.question_text(), generated, dict(item.record or {}))
        except Exception as e:  # the user's function failed: say where, without our traceback
            raise ConfigError(f"evaluation.metric '{self.name}' raised {type(e).__name__} on {where}: "
                              f"{' '.join(str(e).split())[:300]}; fix the function (it is called as "
                              "score(prompt, generated, item) with item the eval record as a dict)") from None
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = float("nan")
        if not (0.0 <= f <= 1.0):
            raise ConfigError(f"evaluation.metric '{self.name}' returned {v!r} on {where}; it must return a number "
                              "in [0, 1] (1 = the item passes)")
        return f
