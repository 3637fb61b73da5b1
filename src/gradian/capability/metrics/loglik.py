"""The likelihood metric: the reference answer's per-token probability under the model (no generation)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...config import MetricKind
from .base import Metric, no_settings


def loglik_score(logprob: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
    """Per-token probability of the expected answer (the geometric mean): a fraction in [0, 1] like the others."""
    return np.exp(np.asarray(logprob) / np.maximum(np.asarray(n_tokens), 1))


@dataclass(frozen=True)
class LoglikMetric(Metric, kind=MetricKind.loglik):
    """Scores the reference's probability (`score_logprobs`), never a generated answer."""

    generative = False

    @classmethod
    def from_settings(cls, name: str, **settings) -> "LoglikMetric":
        no_settings(name, **settings)
        return cls(name)

    def score_logprobs(self, logprob: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
        return loglik_score(logprob, n_tokens)

    def score(self, item, generated: str) -> float:
        raise ValueError(f"metric {self.name!r} does not score generated answers")
