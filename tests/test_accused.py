"""How many rows are accused (`attribution.accused`): outliers of the null the other rows' scores form."""

import numpy as np

from gradian.attribution.accused import Z_ACCUSED, accused_count, accused_set, none_accused, robust_z


def _scores(n=300, causes=(3, 50, 120, 200, 299), height=40.0, seed=0):
    rng = np.random.default_rng(seed)
    s = rng.standard_t(4, size=n)  # a heavy-tailed bulk, as gradient scores are
    s[list(causes)] += height
    return s


def test_the_causes_and_only_they_are_accused():
    s = _scores()
    acc = accused_set(s)
    assert acc["count"] == 5 and sorted(acc["positions"]) == [3, 50, 120, 200, 299]
    assert acc["positions"] == np.argsort(-s, kind="stable")[:5].tolist()  # a prefix of the ranking
    assert "robust standard deviations" in acc["rule"] and acc["z_threshold"] == Z_ACCUSED


def test_the_bulk_sets_the_scale_so_many_causes_are_still_found():
    """20 causes of 300 (the cluster scenario's share) leave the median and MAD to the other rows."""
    causes = list(range(0, 300, 15))
    s = _scores(causes=causes)
    assert accused_count(s) == 20
    z, med, scale = robust_z(s)
    assert abs(med) < 0.5 and 0.5 < scale < 2.5


def test_a_null_run_accuses_nobody():
    """No cause: a normal bulk of 100,000 rows has no row 10 robust deviations out (its maximum is about 4.5), in
    30 seeds. (A heavier tail can: the threshold is calibrated on the scenarios' scores, whose benign rows reach a
    robust z of 1.5 to 10; see the module docstring.)"""
    assert all(accused_count(np.random.default_rng(k).normal(size=100_000)) == 0 for k in range(30))
    assert none_accused("declined")["count"] == 0


def test_the_order_given_decides_which_rows_and_the_limit_caps_them():
    s = _scores()
    order = [299, 200, 120, 50, 3] + [i for i in range(300) if i not in (3, 50, 120, 200, 299)]
    acc = accused_set(s, order, limit=3)
    assert acc["count"] == 3 and acc["positions"] == [299, 200, 120] and acc["capped_at_top_k"]


def test_constant_scores_fall_back_to_the_mean_deviation_or_accuse_nobody():
    s = np.zeros(100)
    s[7] = 5.0
    assert accused_set(s)["positions"] == [7]  # MAD 0: the mean absolute deviation sets the scale
    assert accused_count(np.ones(50)) == 0


def test_verify_drops_the_accused_set_by_default(tmp_path):
    """verify's default K is the report's accused count; a report without one falls back to truth.json's planted
    rows, then to min(top_k, 5% of the rows)."""
    import json

    from gradian.config import config_from_dict
    from gradian.validate.verify import default_top_k

    from gradian.report.schema import Accused, Report, Truth

    def rep(count=None, planted=None) -> Report:  # the parts of a typed report verify reads here
        return Report.model_construct(
            accused=None if count is None else Accused.model_construct(count=count, positions=list(range(count))),
            truth=None if planted is None else Truth.model_construct(planted=planted))

    cfg = config_from_dict({"model": {"base": "b"}, "data": {"train": "t.jsonl"}, "output": "out"}, root=tmp_path)
    k, rule = default_top_k(cfg, rep(7, [1, 2, 3]), 1000)
    assert k == 7 and "accused" in rule
    assert default_top_k(cfg, rep(0, [1, 2, 3]), 1000)[0] == 3
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "truth.json").write_text(json.dumps({"planted": [4, 5]}))
    assert default_top_k(cfg, rep(), 1000)[0] == 2
    (tmp_path / "out" / "truth.json").unlink()
    assert default_top_k(cfg, rep(), 1000) == (50, "min(attribution.top_k, 5% of the rows)")
    assert default_top_k(cfg, rep(), 300)[0] == 15
