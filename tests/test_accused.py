"""Which rows are accused (`attribution.accused`): the rows above the widest drop of the scan statistic, each with
its evidence, and nobody where the drop is what a heavy tail of innocent rows gives by itself."""

import numpy as np

from gradian.attribution.accused import A_MIN, accuse, nobody, scan, widest_drop
from gradian.attribution.scoring import item_z


def _noise(q, n, seed, df=3):
    """Per-item scores of rows that caused nothing: Student-t, a heavier tail than gradient scores usually have."""
    return np.random.default_rng(seed).standard_t(df, size=(q, n))


def test_rows_that_planted_a_fact_are_accused_with_the_items_they_explain():
    s = _noise(20, 300, 0, df=4)
    s[0, 5] += 120.0
    s[1, 5] += 100.0  # row 5 planted the fact asked by items 0 and 1 (two phrasings)
    s[7, 77] += 90.0  # row 77 the fact of item 7
    items = list(range(100, 120))  # the failing items' eval positions
    acc = accuse(s, items)
    assert acc.positions == [5, 77]
    e5, e77 = acc.evidence
    assert e5.items == (100, 101) and e77.items == (107,)
    z = item_z(s)
    assert abs(e5.statistic - (z[0, 5] + z[1, 5]) / np.sqrt(2)) < 1e-9 and e5.item_z == z[0, 5]
    stat, _ = scan(z)
    below = np.sort(stat)[::-1][2]
    assert below < e77.threshold < e77.statistic and e5.threshold == e77.threshold
    entry = acc.to_report()
    assert entry["count"] == 2 and entry["evidence"][0]["items"] == [100, 101] and entry["drop"] > 1.3


def test_rows_of_the_failing_task_itself_are_not_accused_however_far_out():
    """Issue 42: on a 2,000-row set, 220 true facts of the failing task stand 20 to 80 robust SD out (a fixed
    threshold, or the old rule, accuses them all); the planted rows stand above them. The shape is the one measured
    on the real SmolLM2 facts fine-tune (bench/real_models.py smol_facts): an innocent row of the task stands out on
    the item it resembles and a little on the others, a planted row far out on the items that ask its fact."""
    rng = np.random.default_rng(1)
    q, n = 16, 2000
    s = _noise(q, n, 1)
    task = rng.choice(n, 220, replace=False)
    s[:, task] += rng.uniform(3, 12, size=(1, 220))  # a little on every item of the task
    s[rng.integers(0, q, 220), task] += rng.uniform(20, 80, size=220)  # far out on the one it resembles
    planted = [int(p) for p in rng.choice(np.setdiff1d(np.arange(n), task), 8, replace=False)]
    for j, p in enumerate(planted):
        s[2 * j: 2 * j + 2, p] += rng.uniform(150, 400)
    acc = accuse(s, list(range(q)), limit=50)
    assert sorted(acc.positions) == sorted(planted)
    assert all(len(e.items) <= 2 for e in acc.evidence)
    z = item_z(s)[:, task]
    assert (z.max(axis=0) > A_MIN).mean() > 0.9  # nearly every one of them passes a fixed threshold
    assert (z.mean(axis=0) > A_MIN).mean() > 0.5  # and half of them the old rule's (mean score 6 robust SD out)


def test_a_cause_shared_by_every_item_is_found_by_the_sum_over_items():
    """30 rows that taught one format stand 3-8 SD out on each of 6 items, no further than the bulk's top on any one
    item; summed over the items they stand apart."""
    rng = np.random.default_rng(2)
    s = _noise(6, 300, 2, df=8)
    group = rng.choice(300, 30, replace=False)
    s[:, group] += rng.uniform(3, 8, size=(6, 30))
    acc = accuse(s, list(range(6)))
    assert sorted(acc.positions) == sorted(group.tolist())
    assert all(len(e.items) >= 4 for e in acc.evidence)


def test_noise_alone_rarely_accuses_anyone_and_the_tail_test_is_why():
    """Rows that caused nothing, with Student-t tails (3 degrees of freedom): the widest drop above 6 passes its
    ratio in about half the runs; the tail test keeps all but a few of them from accusing anyone."""
    runs, raw, gated = 0, 0, 0
    for q, n in ((1, 300), (6, 300), (20, 300), (16, 72), (30, 2000)):
        for seed in range(100):  # 500 runs: 40 a setting put 13 of 200 (6.5%) against a rate of 4.8%
            stat, _ = scan(item_z(_noise(q, n, 1000 + seed)))
            runs += 1
            raw += widest_drop(stat, alpha=1.0).count > 0
            gated += widest_drop(stat).count > 0
    assert raw > 0.3 * runs
    assert gated <= 0.06 * runs


def test_the_limit_caps_the_accused_and_says_so():
    s = _noise(4, 300, 3, df=30)
    s[0, :12] += np.linspace(140, 60, 12)  # far enough apart that noise on other items keeps the order
    acc = accuse(s, [0, 1, 2, 3], limit=5)
    assert acc.count == 5 and acc.capped and acc.positions == list(range(5))
    assert accuse(s, [0, 1, 2, 3]).count == 12


def test_flat_or_empty_scores_and_declined_runs_accuse_nobody():
    assert accuse(np.zeros((3, 50)), [0, 1, 2]).count == 0
    assert accuse(np.zeros((0, 50)), []).count == 0
    assert accuse(_noise(5, 300, 4, df=50), list(range(5))).count == 0
    n = nobody("declined")
    assert n.count == 0 and n.to_report()["rule"] == "declined" and "threshold" not in n.to_report()


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
