"""How the failing items' scores combine into a row's ranking score (`attribution.combine`): the mean over items, or
the max (the item the row explains best), auto = max for own-words queries; the accused rows are neither's
(`attribution.accused` has its own statistic)."""

import json

import numpy as np
import pytest

from gradian.attribution.accused import accuse
from gradian.attribution.scoring import robust_z
from gradian.attribution.scoring import (MAD_TO_SD, REFERENCE_ROWS, combine_items, item_z, rank,
                                        reference_rows, resolve_combine)


def test_auto_is_max_only_when_every_item_is_an_own_words_query():
    assert resolve_combine("auto", [True, True, True]) == "max"
    assert resolve_combine("auto", [True, False]) == "mean"  # a behaviour or contrastive item among them
    assert resolve_combine("auto", [False, False]) == "mean"
    assert resolve_combine("auto", []) == "mean"
    assert resolve_combine("mean", [True]) == "mean" and resolve_combine("max", [False]) == "max"


def _collateral(seed=0, q=6, n=300):
    """Q failing items, one taught by row 7 alone; row 11 leans a little toward every item (a broad, benign row);
    the bulk is noise."""
    rng = np.random.default_rng(seed)
    per = rng.normal(0.0, 0.01, size=(q, n)).astype(np.float32)
    per[0, 7] += 0.30  # the row that planted item 0's wrong fact: nothing on the collateral items
    per[:, 11] += 0.08  # mean 0.08 > row 7's mean 0.05, but row 7's item-0 score is near four times row 11's best
    return per


def test_the_mean_dilutes_the_row_that_taught_one_item_and_the_max_does_not():
    per = _collateral()
    assert rank(combine_items(per, "mean"))[0] == 11
    assert rank(combine_items(per, "max"))[0] == 7
    np.testing.assert_allclose(combine_items(per, "mean"), per.mean(0))
    # max: each item's robust z against its own reference rows (the accusation rule's null), then the max over
    # items; beyond REFERENCE_ROWS rows the median and scale are the seeded sample's (`reference_rows`)
    ref = reference_rows(per.shape[1])
    assert per.shape[1] > REFERENCE_ROWS and ref.size == REFERENCE_ROWS and np.all(np.diff(ref) > 0)
    assert np.array_equal(ref, reference_rows(per.shape[1]))  # the same sample on every call
    med = np.median(per[:, ref].astype(np.float64), axis=1, keepdims=True)
    scale = MAD_TO_SD * np.median(np.abs(per[:, ref] - med), axis=1, keepdims=True)
    z = (per - med) / scale
    np.testing.assert_allclose(item_z(per), z, rtol=1e-12)
    np.testing.assert_array_equal(combine_items(per, "max"), item_z(per).max(0))
    assert combine_items(np.zeros((0, 5), np.float32), "max").shape == (5,)
    few = per[:, :200]  # up to REFERENCE_ROWS rows, every row
    np.testing.assert_array_equal(item_z(few), np.stack([robust_z(r)[0] for r in few]))


def test_a_noisy_items_bulk_does_not_win_the_max():
    """Item 0's query is garbled (its rows scatter widely: sd 0.1) and a benign row reaches 0.45 there; item 1's rows
    scatter by 0.01 and the row that taught it scores 0.08. The raw max ranks the benign row first; in each item's
    robust z units (about 4.5 against 8) the taught row wins (measured on a 40-row SmolLM2 fact set: AUPRC 0.771 raw,
    1.000 in z)."""
    rng = np.random.default_rng(1)
    per = np.stack([rng.normal(0, 0.1, 400), rng.normal(0, 0.01, 400)]).astype(np.float32)
    per[0, 3], per[1, 3] = 0.45, 0.0  # benign, on the noisy item
    per[0, 9], per[1, 9] = 0.0, 0.08  # taught item 1
    assert rank(per.max(0))[0] == 3
    assert rank(combine_items(per, "max"))[0] == 9


def test_the_accused_rows_come_from_their_own_statistic_whatever_the_combine():
    """The accusation does not read the ranking score: from the per-item scores it accuses row 7 for the one item
    it taught and row 11 for leaning toward all six (8 SD on each), whichever way the ranking combines them."""
    per = _collateral()
    acc = accuse(per, list(range(per.shape[0])))
    assert acc.positions == [7, 11]
    assert acc.evidence[0].items == (0,) and len(acc.evidence[1].items) == per.shape[0]


def test_with_max_the_named_exchange_is_the_best_items_best():
    """`pipeline.ranked_turn` under max: the exchange that sets the row's score (the best exchange of the item the
    row explains best), where the mean's rule (the exchange whose wins sum highest) names another."""
    from gradian.pipeline import ranked_turn
    from gradian.setup.records import Example

    msgs = []
    for q, a in [("Hi?", "Hello."), ("Bye?", "Goodbye."), ("Capital of Japan?", "Osaka.")]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    ex = Example("c", 0, "messages", {"messages": msgs})
    scores = np.array([[0.3, 0.0, 0.1], [0.3, 0.0, 0.1], [0.3, 0.0, 0.1], [0.0, 0.1, 0.5]], dtype=np.float32)
    found = {"best": scores.argmax(1), "scores": scores}
    assert ranked_turn(ex, found)["turn"] == 0  # wins three items: 0.9 in all
    t = ranked_turn(ex, found, 3)  # item 3 sets the row's score under max
    assert t["turn"] == 2 and t["text"] == "Osaka." and t["items"] == 1


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """The tiny demo (own-words queries) attributed with auto and with attribution.combine: mean."""
    from test_precondition import trained_demo

    from gradian.config import load_config
    from gradian.pipeline import attribute

    run = tmp_path_factory.mktemp("combine-demo")
    path = trained_demo(run)
    truth = json.loads((run / "truth.json").read_text())
    out = {}
    for how in ("auto", "mean"):
        cfg = load_config(path, [f"attribution.combine={how}", f"output=out-{how}"])
        out[how] = (attribute(cfg, truth=truth), np.load(cfg.output_dir / "scores.npy"))
    return out, truth


def test_attribute_ranks_own_words_items_by_their_max_and_accuses_the_same_rows_either_way(demo_runs):
    (auto, s_auto), (mean, s_mean) = demo_runs[0]["auto"], demo_runs[0]["mean"]
    assert all(it["formulation"] == "own_words" for it in auto["query"]["items"])
    assert auto["query"]["combine"] == "max" and mean["query"]["combine"] == "mean"
    assert len(auto["query"]["items"]) > 1
    assert not np.allclose(s_auto, s_mean)  # (how scores.npy follows combine_items: tests/test_checkpoints.py)
    # the ranking follows the max; the accused rows are the accusation statistic's either way
    assert [r["position"] for r in auto["ranking"]] == rank(s_auto, len(auto["ranking"])).tolist()
    assert auto["accused"]["positions"] == mean["accused"]["positions"]
    # every row the report accuses under max was planted (the demo's poisons)
    planted = set(demo_runs[1]["planted"])
    assert auto["accused"]["count"] > 0 and set(auto["accused"]["positions"]) <= planted
