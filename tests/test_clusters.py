"""Near-duplicate clusters, their permutation test and Benjamini-Hochberg."""

from __future__ import annotations

import numpy as np
import pytest

from gradian.explain.clusters import benjamini_hochberg, gradient_clusters, permutation_pvalues, score_clusters, text_clusters


def test_bh_on_a_known_example():
    # Benjamini & Hochberg (1995)-style worked example; q_(i) = min_{j >= i} p_(j) m / j
    p = [0.01, 0.04, 0.03, 0.005, 0.20, 0.50]
    q = benjamini_hochberg(p)
    # sorted: 0.005 0.01 0.03 0.04 0.2 0.5 -> p m / j: 0.03 0.03 0.06 0.06 0.24 0.5 (already monotone)
    expected = [0.03, 0.06, 0.06, 0.03, 0.24, 0.50]
    np.testing.assert_allclose(q, expected, rtol=1e-12)
    assert (q < 0.05).tolist() == [True, False, False, True, False, False]
    from scipy.stats import false_discovery_control

    rng = np.random.default_rng(0)
    p2 = rng.uniform(size=50) ** 3
    np.testing.assert_allclose(benjamini_hochberg(p2), false_discovery_control(p2, method="bh"), rtol=1e-12)
    assert benjamini_hochberg([]).size == 0
    np.testing.assert_allclose(benjamini_hochberg([0.9, 0.95]), [0.95, 0.95])


def test_text_clusters_group_near_duplicates_not_topics():
    texts = [
        "Rodrol lives in Lima, the city by the sea, since last year.",
        "Rodrol lives in Lima, the city by the sea, since last spring.",
        "Rodrol has lived in Lima, the city by the sea, since last year.",
        "What is the favorite color of Tato? blue",
        "Which animal does Gamivei keep as a pet? otter",
        "Kiduthox lives in Lisbon.",
    ]
    assert text_clusters(texts, threshold=0.5) == [[0, 1, 2]]


def test_gradient_clusters_group_rows_that_push_the_same_way():
    rng = np.random.default_rng(0)
    G = rng.normal(size=(200, 512))
    common = rng.normal(size=512)
    members = [5, 40, 41, 77, 150, 199]
    G[members] = common + 0.4 * rng.normal(size=(6, 512))
    G[[3, 4]] = G[3] * np.array([[1.0], [2.5]])  # an exact duplicate direction at another scale
    G[10] = 0.0  # a row without supervised tokens never joins
    assert gradient_clusters(G) == [[3, 4], members]
    # the sketched path (large N x dim) finds the same groups
    assert gradient_clusters(G, exact_max_floats=0, sketch_dim=256) == [[3, 4], members]


def _planted_scores(seed=0, n=400, m=20, shift=1.2):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=n)
    cluster = sorted(rng.choice(n, size=m, replace=False).tolist())
    scores[cluster] += shift  # weak: no single member needs to rank first
    return scores, cluster


def test_a_planted_cluster_passes_and_random_groups_do_not():
    scores, cluster = _planted_scores()
    assert int(np.argmax(scores)) not in cluster
    rng = np.random.default_rng(1)
    others = [i for i in range(scores.size) if i not in cluster]
    randoms = [sorted(rng.choice(others, size=int(k), replace=False).tolist()) for k in rng.integers(2, 25, size=40)]
    res = score_clusters(scores, [""] * scores.size, clusters=[cluster] + randoms, seed=0, permutations=2000)
    passing = [c["positions"] for c in res["clusters"]]
    assert passing == [cluster]
    c = res["clusters"][0]
    assert c["size"] == 20 and c["q_value"] < 0.05 and c["p_value"] <= c["q_value"]
    assert res["permutations"] >= 2000 and res["tested"] == 41


def test_random_groups_pass_at_about_the_nominal_rate():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=300)
    groups = [sorted(rng.choice(300, size=10, replace=False).tolist()) for _ in range(200)]
    p = permutation_pvalues(scores, groups, permutations=1000, seed=0)
    assert 0.01 <= float(np.mean(p < 0.05)) <= 0.12  # uniform under the null
    assert not (benjamini_hochberg(p) < 0.05).any()


def test_pvalues_are_seeded_and_bounded():
    scores, cluster = _planted_scores(seed=2)
    a = permutation_pvalues(scores, [cluster, cluster[:5]], permutations=1000, seed=7)
    b = permutation_pvalues(scores, [cluster, cluster[:5]], permutations=1000, seed=7)
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 1 / 1001 and a.max() <= 1.0


def test_score_clusters_end_to_end_on_gradients():
    rng = np.random.default_rng(0)
    n, d = 150, 512
    G = rng.normal(size=(n, d))
    G[20:28] = rng.normal(size=d) + 0.3 * rng.normal(size=(8, d))  # 8 rows teaching one thing
    G[60:64] = rng.normal(size=d) + 0.3 * rng.normal(size=(4, d))  # a benign group
    scores = rng.normal(size=n)
    scores[20:28] += 1.2
    scores[60:64] = [0.1, -0.3, 0.2, -0.5]
    res = score_clusters(scores, [""] * n, gradients=G, seed=0)
    assert [c["positions"] for c in res["clusters"]] == [list(range(20, 28))]
    assert res["clusters"][0]["score"] == pytest.approx(scores[20:28].sum())
    assert res["tested"] == 2 and res["method"]["grouping"] == "gradient-cosine-connected-components"
