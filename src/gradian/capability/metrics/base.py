"""The `Metric` interface and the registry of metric kinds.

One class per kind (`config.MetricKind`) registers itself by subclassing `Metric` with ``kind=...``; what callers
need to know about a metric is a property of its class (`generative`, `scores_likelihood`, `binary`,
`needs_answer`), never a comparison of its name. Calling the base class, ``Metric(name, pattern, negate, fn)``,
builds the class the name's kind registered (`make_metric`): the constructor callers have always used.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

from ...config import MetricKind, metric_kind
from ...kinds import BuildsItsKind

_CLASSES: dict[MetricKind, type["Metric"]] = {}


@dataclass(frozen=True)
class Metric(metaclass=BuildsItsKind):
    """A resolved `evaluation.metric`: `score(item, generated)` in [0, 1] for every metric that scores generated
    answers (`generative`); the likelihood metric scores the reference's probability instead (`LoglikMetric`)."""

    name: str

    kind: ClassVar[MetricKind]
    generative: ClassVar[bool] = True  # scores the model's generated answer (False: the reference's likelihood)
    binary: ClassVar[bool] = False  # every score is 0 or 1: a per-item score is the item's correct mark
    needs_settings: ClassVar[bool] = False  # cannot be built from its name alone (a pattern, an imported function)
    # What the settings of the regex and Python metrics read on any metric (their own classes hold real values).
    pattern: ClassVar[Optional[str]] = None
    negate: ClassVar[bool] = False
    fn: ClassVar[Optional[Callable[..., Any]]] = None

    def __init_subclass__(cls, kind: Optional[MetricKind] = None, **kw):
        super().__init_subclass__(**kw)
        if kind is not None:
            cls.kind = kind
            _CLASSES[kind] = cls

    @staticmethod
    def _build_kind(*args, **kwargs) -> "Metric":
        """``Metric(...)`` itself (`kinds.BuildsItsKind`): `make_metric`."""
        return make_metric(*args, **kwargs)

    @classmethod
    @abstractmethod
    def from_settings(cls, name: str, *, pattern: Optional[str] = None, negate: bool = False,
                      fn: Optional[Callable[..., Any]] = None) -> "Metric":
        """The metric `name` of this kind from the settings `make_metric` was given (ValueError for a setting the
        kind does not take)."""

    @property
    def defines_class(self) -> bool:
        """The metric defines a class of answers (a behaviour: refusing, a language, a format) rather than one
        reference answer per item: what `attribution.query: auto` queries by sampling (`attribution.behaviour`)."""
        return False

    @property
    def scores_likelihood(self) -> bool:
        """Scores the reference answer's likelihood, not a generated answer (no generated wrong answer to contrast
        a query with)."""
        return not self.generative

    @property
    def needs_answer(self) -> bool:
        """Whether eval records need a reference `answer` (not for a fixed regex or a Python metric)."""
        return True

    def check_items(self, items) -> None:
        """Raise `DataError` naming the first item this metric cannot score (nothing to check by default)."""

    def describe(self) -> str:
        """The metric as a message names it: its name, and its settings where it has any."""
        return f"evaluation.metric '{self.name}'"

    @abstractmethod
    def score(self, item, generated: str) -> float:
        """The item's score in [0, 1] for the answer `generated` (1 = passes)."""


def metric_class(name: str) -> type[Metric]:
    """The class of the metric `name` (a builtin name or python:module:function); ValueError when none."""
    try:
        return _CLASSES[metric_kind(name)]
    except (KeyError, ValueError):
        known = ", ".join(k.value for k in MetricKind if k in _CLASSES and k is not MetricKind.python)
        raise ValueError(f"unknown metric {name!r}; use one of {known} or python:module:function") from None


def make_metric(name: str, pattern: Optional[str] = None, negate: bool = False,
                fn: Optional[Callable[..., Any]] = None) -> Metric:
    """The metric `name` with its settings (`pattern`, `negate`: regex; `fn`: a Python metric's function)."""
    cls = metric_class(name)
    return cls.from_settings(str(name), pattern=pattern, negate=negate, fn=fn)


def is_binary_metric(name: Any) -> bool:
    """Whether the metric named `name` (as a report records it) scores 0 or 1 only; False for an unknown name."""
    try:
        return metric_class(str(name)).binary
    except ValueError:
        return False


def no_settings(name: str, **settings) -> None:
    """ValueError when a metric without settings is given some (`pattern`, `negate`, `fn` set)."""
    given = [k for k, v in settings.items() if v not in (None, False)]
    if given:
        raise ValueError(f"metric {name!r} takes no {', '.join(given)} (evaluation.pattern and evaluation.negate are "
                         "for metric: regex, a function for python:module:function)")
