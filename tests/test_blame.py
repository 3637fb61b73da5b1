"""Base scores and preference margins, the margin query for the loglik metric, and the report fields on the demo."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gradian.explain.blame import fine_tune_share, item_statement, row_verdict, summarize

torch.set_num_threads(1)


def test_row_verdicts():
    assert row_verdict(4.5, 0.3) == "taught"
    assert row_verdict(0.2, 0.01) == "base_believed"
    assert row_verdict(math.log(2) - 1e-9, 5.0) == "base_believed"
    assert row_verdict(3.0, 2.8) == "not_learned"
    assert row_verdict(None, 1.0) == "unknown"


def test_fine_tune_share_and_statements():
    assert fine_tune_share(3.0, -2.0) == 1.0  # the base was right: the whole flip
    assert fine_tune_share(-1.0, -4.0) == pytest.approx(0.75)  # base leaned wrong by 1 of the final 4 nats
    assert fine_tune_share(-4.0, -1.0) == 0.0  # the fine-tune narrowed a wrong preference
    assert fine_tune_share(1.0, 2.0) == 0.0  # no wrong preference at the end
    assert fine_tune_share(-1.0, 3.0, "improvement") == 1.0
    s = item_statement(6.6, -4.0, "Madrid", "Lima")
    assert "owns the whole flip" in s and "'Madrid'" in s and "'Lima'" in s
    assert "75%" in item_statement(-1.0, -4.0, "Madrid", "Lima")
    assert "comes from the base" in item_statement(-4.0, -1.0, "Madrid", "Lima")
    assert "still answers" in item_statement(None, None, "Madrid", "")
    summ = summarize(["taught", "base_believed", "taught"],
                     [{"margin_base": 3.0, "margin_tuned": -2.0}, {"margin_base": -1.0, "margin_tuned": -4.0},
                      {"margin_base": None, "margin_tuned": None}])
    assert summ["rows"]["taught"] == 2 and summ["flipped_by_fine_tune"] == 1 and summ["base_already"] == 1
    assert summ["mean_fine_tune_share"] == pytest.approx(0.875) and "flipped 1" in summ["statement"]


# ---------------------------------------------------------------------------------------------------- margin query


def test_margin_vectors_are_the_gradient_of_the_margin_loss(random_lora_model):
    """The hooked per-example margin gradient equals autograd on the LoRA weights, example by example."""
    from gradian.grads.capture import GradientCapture
    from gradian.setup.tokenize import Tokenized
    from gradian.setup.batches import collate
    from gradian.setup.model import lora_sites
    from gradian.grads.objectives import margin_losses

    model = random_lora_model
    sites, _ = lora_sites(model)
    cap = GradientCapture(model, sites)
    toks = [Tokenized([5, 9, 11, 40, 41, 42], [False, False, False, True, True, True], ""),
            Tokenized([7, 8, 50, 51], [False, False, True, True], "")]
    ids, attn, sup = collate(toks, 0)
    vecs, losses = cap.margin_vectors(ids, attn, sup)
    params = [p for s in sites for p in (s.A.weight, s.B.weight)]
    for b, t in enumerate(toks):
        i1, a1, s1 = collate([t], 0)
        l, which = margin_losses(model, i1, a1, s1)
        assert l[0].item() == pytest.approx(losses[b].item(), rel=1e-5)
        assert which[0] >= 0
        grads = torch.autograd.grad(l.sum(), params)
        ref = torch.cat([g.flatten() for g in grads])
        got = vecs[b]
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-6), (got - ref).abs().max()


def test_loglik_items_use_contrastive_or_margin_never_silent_classic():
    from gradian.capability.evaluate import CapabilityResult
    from gradian.setup.records import EvalItem
    from gradian.attribution.queries import query_items

    items = [EvalItem("a", 0, "Madrid", prompt="Where?"), EvalItem("b", 1, "blue", prompt="Color?"),
             EvalItem("c", 2, "owl", prompt="Pet?")]
    cap = CapabilityResult("loglik", 3, 0.9, 0.5, -0.4, [-0.5, -0.3], 0.95, True, 0.1, [0.9] * 3, [0.5] * 3,
                           ["Madrid", "blue", "owl"], ["Lima", "blue.", ""])
    q = query_items(cap, items, [0, 1, 2], "contrastive")
    assert [x.formulation for x in q] == ["contrastive", "margin", "margin"]
    q = query_items(cap, items, [0, 1, 2], "contrastive", metric="exact_match")
    # the base's passing answer against the fine-tune's failing one, in their own words; nothing to contrast with
    # an empty answer
    assert [x.formulation for x in q] == ["own_words", "own_words", "classic"]
    assert (q[0].target, q[0].contrast, q[0].target_source) == ("Madrid", "Lima", "base")
    assert (q[1].target, q[1].contrast) == ("blue", "blue.")


# ---------------------------------------------------------------------------------------------------- on the demo


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    from test_precondition import trained_demo

    from gradian.pipeline import attribute
    from gradian.config import load_config

    run = tmp_path_factory.mktemp("blame-demo")
    cfg = load_config(trained_demo(run))
    truth = json.loads((run / "truth.json").read_text())
    return run, attribute(cfg, truth=truth), truth


def test_fine_tune_lowered_the_margin_of_every_failing_item(demo_report):
    _, report, _ = demo_report
    items = report["query"]["items"]
    assert items
    for it in items:
        assert it["margin_base"] > 0 > it["margin_tuned"], it  # base preferred the right answer, fine-tune the wrong
        assert "owns the whole flip" in it["statement"]
    b = report["blame"]
    assert b["flipped_by_fine_tune"] == len(items) and b["mean_fine_tune_share"] == 1.0
    assert b["mean_margin_tuned"] < b["mean_margin_base"]


def test_accused_planted_rows_were_taught_by_the_fine_tune(demo_report):
    _, report, truth = demo_report
    planted = set(truth["planted"])
    rows = report["ranking"]
    for r in rows:
        # token-level verdicts: a row whose every token the base believed has a mean loss under log 2 too
        assert r["verdict"] in ("taught", "base_believed", "not_learned")
        if r["verdict"] == "base_believed":
            assert r["base_loss"] <= math.log(2)
        if report["query"]["combine"] == "mean":
            assert r["window_score"] == pytest.approx(r["score"])  # short rows: the window is the row
    # the ranking follows the ranking score (with combine max, each row's robust z on its strongest item:
    # tests/test_combine.py, and scores.npy against combine_items in tests/test_checkpoints.py)
    ws = [r["window_score"] for r in rows]
    assert ws == sorted(ws, reverse=True)
    assert all(r["verdict"] == "taught" for r in rows if r["position"] in planted)
    assert sum(r["verdict"] == "base_believed" for r in rows if r["position"] not in planted) >= 0.8 * sum(
        r["position"] not in planted for r in rows)


def test_report_carries_spans_clusters_and_preconditioner(demo_report):
    run, report, truth = demo_report
    on_disk = json.loads((run / "report.json").read_text())
    assert on_disk["query"]["preconditioner"]["kind"] == on_disk["settings"]["attribution"]["preconditioner"]
    top = on_disk["ranking"][0]
    ts = top["top_span"]
    assert top["text"][ts["start"] : ts["end"]] == ts["text"]
    assert on_disk["spans"] and all(sp["text"] for sp in on_disk["spans"])
    assert isinstance(on_disk["clusters"], list) and on_disk["clusters_info"]["permutations"] >= 1000
    assert np.load(run / "scores_total.npy").shape == np.load(run / "scores.npy").shape
    import html as html_mod

    page = (run / "report.html").read_text()
    # the first ranking row's top span is highlighted inside its text
    assert f'">{html_mod.escape(ts["text"], quote=False)}</mark>' in page or f">{ts['text']}</mark>" in page
    assert page.count('<mark title="top span') >= min(len(on_disk["ranking"]), 10)


def test_loglik_metric_uses_the_margin_query_and_says_so(demo_report, tmp_path):
    import shutil

    from gradian.pipeline import attribute
    from gradian.config import load_config

    run, _, truth = demo_report
    work = tmp_path / "loglik"
    shutil.copytree(run, work, ignore=shutil.ignore_patterns("report*", "scores*"))
    cfg = load_config(work / "gradian.yaml", ["evaluation.metric=loglik", "grads.rerank=0", "grads.fidelity_sample=0"])
    report = attribute(cfg, truth=truth)
    ids = {f["id"]: f for f in report["flags"]}
    assert "attribution.loglik_margin" in ids and ids["attribution.loglik_margin"]["level"] == "info"
    assert "attribution.loglik_classic_fallback" not in ids
    forms = {it["formulation"] for it in report["query"]["items"]}
    assert forms <= {"contrastive", "margin"} and forms
    assert report["metrics"]["recall_at_10"] >= 0.9
