import numpy as np

from gradian.attribution.rerank import agreement, order_scores, rerank_order, spearman_within_top, topk_recall


def test_rerank_puts_candidates_first_in_exact_order():
    approx = np.array([0.9, 0.1, 0.8, 0.85, 0.2])
    cand = np.array([0, 2, 3])
    exact = np.array([0.1, 0.7, 0.5])  # exact scores of rows 0, 2, 3
    order = rerank_order(approx, cand, exact)
    assert order.tolist() == [2, 3, 0, 4, 1]


def test_agreement_is_perfect_for_identical_scores_and_drops_for_noise():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(3, 500))
    a = agreement(e, e)
    assert a["top10_recall"] == 1.0 and a["top50_recall"] == 1.0 and a["spearman"] > 0.999
    noisy = agreement(e, e + rng.normal(scale=1.0, size=e.shape))
    assert noisy["top10_recall"] < 1.0 and noisy["spearman"] < 0.9


def test_order_scores_reproduce_the_order():
    order = np.array([3, 0, 2, 1])
    s = order_scores(order)
    assert np.argsort(-s).tolist() == order.tolist()


def test_topk_and_top_spearman():
    e = np.arange(100.0)
    assert topk_recall(e, e, 10) == 1.0
    assert topk_recall(e, -e, 10) == 0.0
    assert spearman_within_top(e, e) > 0.999
