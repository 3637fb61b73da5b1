"""The whole path on the built-in tiny model: train the poisoned adapter, attribute, check the report and the sign."""

import json
import shutil

import numpy as np
import pytest

from gradian import api
from gradian.config import load_config
from gradian.demo.run import prepare_demo
from gradian.attribution.queries import query_items, query_vectors, select_failing
from gradian.attribution.scoring import harm_from_inner, recall_at_k, unit_queries
from gradian.pipeline import attribute, evaluate, index_stage
from gradian.setup.session import open_session
from gradian.training.loop import train_adapter


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("demo")
    cfg_path = prepare_demo(run, progress=False)
    cfg = load_config(cfg_path)
    train_adapter(cfg)
    truth = json.loads((run / "truth.json").read_text())
    report = api.attribute(cfg, truth=truth)
    return run, cfg_path, truth, report


def test_attribute_writes_a_report_with_the_schema_fields(demo_run):
    run, _, truth, report = demo_run
    on_disk = json.loads((run / "report.json").read_text())
    assert on_disk["schema"] == "gradian.report/1"
    for key in ("verdict", "flags", "capability", "query", "ranking", "clusters", "spans", "index", "timings"):
        assert key in on_disk, key
    cap = on_disk["capability"]
    for key in ("metric", "n", "base", "tuned", "delta", "ci", "confidence", "significant"):
        assert key in cap, key
    assert on_disk["verdict"] == "attributed" and cap["significant"] and cap["delta"] < 0
    row = on_disk["ranking"][0]
    for key in ("rank", "position", "id", "score", "preview", "base_loss", "tuned_loss"):
        assert key in row, key
    assert row["id"].startswith(f"train-{row['position']:06d}-")
    assert on_disk["index"]["examples"] == 300
    scores = np.load(run / "scores.npy")
    assert scores.shape == (300,)
    assert [r["position"] for r in on_disk["ranking"]] == np.argsort(-scores, kind="stable")[: len(on_disk["ranking"])].tolist()
    items = on_disk["query"]["items"]
    assert items and all(i["ranking"] and i["generated"] != i["expected"] for i in items)
    assert (run / "report.html").exists()
    # the public API returns the same report, typed
    assert report.verdict == "attributed" and report.to_dict()["ranking"] == on_disk["ranking"]
    assert report.capability.delta == cap["delta"] and report.ranking[0].position == row["position"]


def test_planted_rows_rank_at_the_top_as_harmful(demo_run):
    run, _, truth, report = demo_run
    scores = np.load(run / "scores.npy")
    assert recall_at_k(scores, truth["planted"], 10) >= 0.9
    # harmful has a positive score: at the earliest checkpoint (the default) every planted row natively, 9 of 10
    # under ATEN_CPU_CAPABILITY=default (one lands just at or below zero: training amplifies the last bits)
    assert np.mean([scores[p] > 0 for p in truth["planted"]]) >= 0.9


def test_the_accused_set_is_the_planted_rows(demo_run):
    """The accused rows come from the scores (the rows above the widest drop of the accusation statistic), not from
    attribution.top_k: on the demo the 10 planted rows (measured: 10, every one planted), each with the eval items
    it explains, and the report's ranking marks exactly them."""
    run, _, truth, _ = demo_run
    on_disk = json.loads((run / "report.json").read_text())
    acc = on_disk["accused"]
    planted = set(truth["planted"])
    assert len(planted) / 2 <= acc["count"] <= 2 * len(planted), acc
    assert len(set(acc["positions"]) & planted) >= 0.9 * acc["count"]
    assert {r["position"] for r in on_disk["ranking"] if r["accused"]} == set(acc["positions"])
    assert acc["count"] < on_disk["settings"]["attribution"]["top_k"]
    assert [e["position"] for e in acc["evidence"]] == acc["positions"]
    failing = {q["item"] for q in on_disk["query"]["items"]}
    for e in acc["evidence"]:  # each accused row names failing items it explains, and passed the threshold
        assert e["items"] and set(e["items"]) <= failing and e["statistic"] > e["threshold"] == acc["threshold"]


def test_a_flag_names_the_checkpoints_the_scores_came_from(demo_run):
    """attribution.checkpoints: earliest (the default) found the epochs gradian train saved and scored the first
    alone; the info flag says so."""
    run, _, _, _ = demo_run
    on_disk = json.loads((run / "report.json").read_text())
    ck = on_disk["query"]["checkpoints"]
    assert ck["source"] == "saved" and ck["count"] == 1 and ck["labels"] == ["epoch-1"], ck
    assert ck["adapters"][0].endswith("checkpoints/epoch-1")
    flag = next(f for f in on_disk["flags"] if f["id"] == "attribution.checkpoints_used")
    assert flag["level"] == "info" and "earliest saved checkpoint alone (epoch-1" in flag["message"], flag


def test_a_row_duplicating_a_query_item_ranks_first_as_helpful(demo_run, tmp_path):
    run, cfg_path, truth, _ = demo_run
    work = tmp_path / "dup"
    shutil.copytree(run, work, ignore=shutil.ignore_patterns("index"))
    cfg = load_config(work / "gradian.yaml")
    s = open_session(cfg)
    cap = evaluate(s)
    failing, _ = select_failing(cap, s.eval_items)
    item = s.eval_items[failing[0]]
    dup = {"messages": [{"role": "user", "content": item.prompt}, {"role": "assistant", "content": item.answer}]}
    with open(work / "train.jsonl", "a") as f:
        f.write(json.dumps(dup) + "\n")
    s = open_session(cfg)
    ix = index_stage(s)
    capture, idx, keys = ix.capture, ix.index, ix.row_keys
    q = query_items(cap, s.eval_items, [failing[0]], "contrastive")
    qv = query_vectors(capture, s.tokenizer, s.eval_items, q, chat=True, max_len=256, batch_size=8).numpy()
    per_item = harm_from_inner(idx.score(unit_queries(qv), keys))[0]
    ix.close()
    assert int(np.argmin(per_item)) == len(keys) - 1  # the duplicate is the most helpful row
    planted_for_item = [p["position"] for p in truth["planted_facts"] if failing[0] in p["eval_indices"]]
    assert int(np.argmax(per_item)) in planted_for_item  # and that item's planted row the most harmful


def test_rerun_is_bit_identical(demo_run, tmp_path):
    run, _, truth, _ = demo_run
    work = tmp_path / "again"
    shutil.copytree(run, work, ignore=shutil.ignore_patterns("index", "report*", "scores.npy"))
    attribute(load_config(work / "gradian.yaml"), truth=truth)
    assert np.array_equal(np.load(work / "scores.npy"), np.load(run / "scores.npy"))
    a = json.loads((work / "report.json").read_text())
    b = json.loads((run / "report.json").read_text())
    assert a["ranking"] == b["ranking"] and a["capability"] == b["capability"]
