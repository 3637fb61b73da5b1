"""The paired bootstrap of a capability change and the smallest change an eval set detects: pure statistics over
per-item scores."""

from __future__ import annotations

from statistics import NormalDist
from typing import Sequence

import numpy as np


def paired_bootstrap(
    base: Sequence[float], tuned: Sequence[float], *, samples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Delta (tuned - base) of the means and its paired percentile-bootstrap interval."""
    d = np.asarray(tuned, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    n = d.size
    if n == 0:
        return 0.0, 0.0, 0.0
    delta = float(d.mean())
    if np.all(d == d[0]):
        # Every resample has the same mean; the interval is that point, never NaN.
        return delta, delta, delta
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    step = max(1, 2_000_000 // n)  # resample in blocks so a large eval set does not allocate samples x n at once
    for s in range(0, samples, step):
        m = min(step, samples - s)
        idx = rng.integers(0, n, size=(m, n))
        means[s : s + m] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return delta, float(lo), float(hi)


def min_detectable_delta(n: int, confidence: float = 0.95, power: float = 0.8, sd: float = 0.5) -> float:
    """Smallest |delta| a paired test on n items detects with this power, for per-item differences of spread sd.

    sd = 0.5 is the spread of a 50/50 binary outcome, the conservative case for exact_match and contains.
    """
    if n <= 0:
        return float("inf")
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2) + NormalDist().inv_cdf(power)
    return float(z * sd / np.sqrt(n))
