import numpy as np
import pytest

from gradian.capability.metrics import contains, exact_match, min_detectable_delta, paired_bootstrap


def test_metrics_normalisation():
    assert exact_match(" blue. ", "blue") == 1.0
    assert exact_match("blue..", "blue") == 0.0  # only one trailing period is stripped
    assert exact_match("Blue", "blue") == 0.0
    assert contains("It is BLUE!", "blue") == 1.0
    assert contains("green", "blue") == 0.0


def test_bootstrap_matches_a_known_paired_sample():
    base = [1.0] * 20
    tuned = [1.0] * 10 + [0.0] * 10
    delta, lo, hi = paired_bootstrap(base, tuned, samples=10_000, confidence=0.95, seed=0)
    assert delta == -0.5
    # the mean of 20 Bernoulli(0.5) draws, negated: sd = 0.5/sqrt(20) = 0.112; 95% ~ +-0.22
    assert lo == pytest.approx(-0.7, abs=0.03) and hi == pytest.approx(-0.3, abs=0.03)
    # resampling is paired: the same items move together, so a constant shift has no spread
    d2, lo2, hi2 = paired_bootstrap([0.2, 0.5, 0.9], [0.3, 0.6, 1.0], seed=0)
    assert d2 == pytest.approx(0.1) and lo2 == pytest.approx(0.1) and hi2 == pytest.approx(0.1)


def test_bootstrap_degenerate_is_zero_not_nan():
    d, lo, hi = paired_bootstrap([1, 0, 1], [1, 0, 1], seed=3)
    assert (d, lo, hi) == (0.0, 0.0, 0.0)
    assert not np.isnan(lo)


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(0)
    b, t = rng.random(30), rng.random(30)
    assert paired_bootstrap(b, t, seed=1) == paired_bootstrap(b, t, seed=1)


def test_min_detectable_delta_shrinks_with_n():
    assert min_detectable_delta(20) > min_detectable_delta(200) > 0
