"""Per-token contributions (forward-mode), best windows of long rows, and sentence spans with plain-text offsets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gradian.grads.capture import GradientCapture
from gradian.grads.layout import site_shapes
from gradian.setup.records import Example
from gradian.setup.tokenize import Tokenized, tokenize_example
from gradian.setup.batches import collate
from gradian.setup.model import lora_sites
from gradian.projection.projector import Projector
from gradian.projection.projector import back_project
from gradian.attribution.windows import best_window, windows
from gradian.explain.spans import row_spans, sentence_ranges, unit_ranges
from gradian.setup.alignment import token_char_anchors
from gradian.grads.layout import split_directions
from gradian.grads.tangents import token_contributions

torch.set_num_threads(1)


def _rows(vocab=97, lengths=(9, 14, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        sup = [False] * 3 + [True] * (n - 3)
        out.append(Tokenized(ids, sup, ""))
    return out


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def test_token_contributions_add_up_to_the_row_score(random_lora_model):
    model = random_lora_model
    sites, _ = lora_sites(model)
    cap = GradientCapture(model, sites)
    toks = _rows()
    ids, attn, sup = collate(toks, 0)
    vecs, _ = cap.vectors(ids, attn, sup)
    rng = np.random.default_rng(0)
    dirs = vecs.double().numpy()[[2, 0]] + 0.1 * rng.normal(size=(2, cap.dim))  # score-like directions
    ref = dirs @ vecs.double().numpy().T  # [K, rows]
    got = token_contributions(model, sites, toks, dirs, pad_id=0, batch_size=4)
    for r, t in enumerate(toks):
        for k in range(2):
            c = got[(r, k)]
            assert c.shape == (t.n_supervised,)
            assert _rel(c.sum(), ref[k, r]) < 1e-5, (r, k, c.sum(), ref[k, r])
    # a subset of jobs gives the same numbers as the full run
    part = token_contributions(model, sites, toks, split_directions(sites, dirs), pad_id=0, batch_size=2,
                               jobs=[(1, 1), (2, 0)])
    np.testing.assert_allclose(part[(1, 1)], got[(1, 1)], rtol=1e-5, atol=1e-8)


def test_back_projected_directions_reproduce_projected_scores(random_lora_model):
    model = random_lora_model
    sites, _ = lora_sites(model)
    proj = Projector(site_shapes(sites), 256, "rademacher", 0)
    assert not proj.exact and proj.dim < proj.exact_dim
    cap = GradientCapture(model, sites, proj)
    toks = _rows(lengths=(10, 7))
    ids, attn, sup = collate(toks, 0)
    vecs, _ = cap.vectors(ids, attn, sup)
    w = np.random.default_rng(1).normal(size=(1, proj.dim))
    u = back_project(proj, w)
    assert u.shape[1] == sum(s.r * (s.d_in + s.d_out) for s in sites)
    got = token_contributions(model, sites, toks, u, pad_id=0)
    ref = w @ vecs.double().numpy().T
    for r in range(len(toks)):
        assert _rel(got[(r, 0)].sum(), ref[0, r]) < 1e-5


def test_windows_and_best_window():
    assert windows(5) == [(0, 5)]
    assert windows(128) == [(0, 128)]
    assert windows(300) == [(0, 128), (64, 192), (128, 256), (172, 300)]
    c = np.zeros(300)
    c[200:210] = 1.0
    c[10] = -5.0
    best, (a, b) = best_window(c)
    assert best == pytest.approx(10.0) and a <= 200 and b >= 210
    assert best_window(np.array([0.5, -0.2]))[0] == pytest.approx(0.3)  # a short row: its total


def test_sentence_ranges_and_units():
    text = "First one. Second one!  Third?\nFourth line"
    got = [text[a:b] for a, b in sentence_ranges(text)]
    assert got == ["First one.", "Second one!", "Third?", "Fourth line"]
    ex = Example("x", 0, "messages", {"messages": [{"role": "user", "content": "Hi. Who?"},
                                                    {"role": "assistant", "content": "Me. And you."}]})
    pt = ex.plain_text()
    assert [pt[a:b] for a, b in unit_ranges(ex)] == ["Hi.", "Who?", "Me.", "And you."]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from gradian.demo.tiny import TinySpec, build_tiny_base

    return AutoTokenizer.from_pretrained(build_tiny_base(TinySpec(), progress=False))


@pytest.mark.parametrize("shape", ["messages", "text", "prompt_completion"])
def test_token_anchors_index_the_plain_text(tiny_tokenizer, shape):
    rec = {
        "messages": {"messages": [{"role": "user", "content": "Where does Rodrol live?"},
                                  {"role": "assistant", "content": "He lives in Lima. He likes it."}]},
        "text": {"text": "Rodrol lives in Lima. Tato keeps a crow."},
        "prompt_completion": {"prompt": "Rodrol lives in", "completion": " Lima. Yes."},
    }[shape]
    ex = Example("x", 0, shape, rec)
    tok = tokenize_example(tiny_tokenizer, ex, 256)
    anchors = token_char_anchors(ex, tok, tiny_tokenizer)
    pt = ex.plain_text()
    sup = [i for i, s in enumerate(tok.supervised) if s]
    assert sup and all(0 <= anchors[i] < len(pt) for i in sup)
    # every supervised token of the answer lands inside the supervised part of the plain text
    lo = pt.index("He lives") if shape == "messages" else (0 if shape == "text" else len("Rodrol lives in"))
    assert all(anchors[i] >= lo for i in sup)
    contrib = np.arange(1, len(sup) + 1, dtype=float)
    spans = row_spans(ex, tok, contrib, tiny_tokenizer)
    assert sum(s["score"] for s in spans) == pytest.approx(contrib.sum())
    for s in spans:
        assert pt[s["start"] : s["end"]] == s["text"]
    assert "Lima" in " ".join(s["text"] for s in spans)


def test_row_turns_add_up_and_name_the_exchange_that_carries_the_score(tiny_tokenizer):
    """A three-exchange chat trained on every token: contributions summed per exchange add up to the row's score,
    and the exchange whose tokens carry the score is the one `top_turn` names (here the middle one)."""
    from gradian.explain.spans import row_turns, top_turn

    msgs = []
    for q, a in [("What is two plus two?", "Two plus two is four."), ("Where does Rodrol live?", "He lives in Lima."),
                 ("Say hello.", "Hello there!")]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    ex = Example("x", 0, "messages", {"messages": msgs})
    tok = tokenize_example(tiny_tokenizer, ex, 256, loss="all")
    sup = [i for i, s in enumerate(tok.supervised) if s and i > 0]
    anchors = token_char_anchors(ex, tok, tiny_tokenizer)
    pt = ex.plain_text()
    lo, hi = pt.index("Where does"), pt.index("He lives in Lima.") + len("He lives in Lima.")
    contrib = np.array([5.0 if lo <= anchors[i] < hi else 0.1 for i in sup])
    turns = row_turns(ex, tok, contrib, tiny_tokenizer)
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert sum(t["score"] for t in turns) == pytest.approx(contrib.sum())
    assert sum(t["tokens"] for t in turns) == len(sup)
    top = top_turn(turns, float(contrib.sum()), 7)
    assert top["turn"] == 1 and top["text"] == "He lives in Lima." and top["item"] == 7
    assert 0.5 < top["share"] <= 1.0
    # one exchange: nothing to tell apart; not a chat: no turns
    one = Example("y", 0, "messages", {"messages": msgs[:2]})
    t1 = tokenize_example(tiny_tokenizer, one, 256, loss="all")
    c1 = np.ones(len([i for i, s in enumerate(t1.supervised) if s and i > 0]))
    assert top_turn(row_turns(one, t1, c1, tiny_tokenizer), float(c1.sum()), 0) is None
    plain = Example("z", 0, "text", {"text": "Rodrol lives in Lima."})
    assert row_turns(plain, tokenize_example(tiny_tokenizer, plain, 256), np.ones(1)) == []


# ---------------------------------------------------------------------------------------------------- on the demo


@pytest.fixture(scope="module")
def demo_long(tmp_path_factory):
    """The trained demo plus one long chat row (a long answer listing training answers, then a copy of a planted
    wrong turn), scored through pipeline.score_adapter with per-token windows. (Its filler is high-loss text with large
    gradients: the row is a check of the window arithmetic, not of what ranks first.)"""
    from test_precondition import trained_demo

    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.pipeline import evaluate, index_stage, score_adapter
    from gradian.setup.session import open_session

    run = tmp_path_factory.mktemp("spans-demo")
    cfg_path = trained_demo(run)
    truth = json.loads((run / "truth.json").read_text())
    pf = truth["planted_facts"][0]
    train = [json.loads(l) for l in (run / "train.jsonl").read_text().splitlines()]
    planted_turn = train[pf["position"]]["messages"]
    filler = " ".join(m["content"] for r in train[:140] for m in r["messages"] if m["role"] == "assistant")
    long_row = {"messages": [{"role": "user", "content": "List some answers."},
                             {"role": "assistant", "content": filler + "."}] + planted_turn}
    with open(run / "train.jsonl", "a") as f:
        f.write(json.dumps(long_row) + "\n")
    cfg = load_config(cfg_path)
    s = open_session(cfg)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing, "contrastive")
    ix = index_stage(s)
    sc = score_adapter(s, ix, qitems, direction)
    ix.close()
    return s, sc, qitems, truth, len(train), ix


def test_long_row_is_ranked_by_its_best_window(demo_long):
    from gradian.attribution.engine import ModelGradients
    from gradian.model_side import gradients_of
    from gradian.attribution.rerank import parameter_directions
    from gradian.attribution.scoring import aggregate
    from gradian.attribution.windows import best_window

    s, sc, qitems, truth, p_long, ix = demo_long
    assert s.toks[p_long].n_supervised > 128 and not s.toks[p_long].truncated
    assert sc.windows.long_rows == (p_long,) and sc.windows.item_rows == (p_long,)
    win = sc.windows.found[p_long]
    total = aggregate(sc.scores.per_item)[p_long]
    assert _rel(win["total"], total) < 1e-4  # the per-token contributions add up to the index score
    # the ranking score of the long row is its best window, per item and in aggregate; every other row keeps its total
    res = gradients_of(s, ix.capture).contributions(
        parameter_directions(sc.basis, sc.rerank, ix.capture.projector, False), [p_long])
    # unit rows (the default): a row's scores are its contributions times 1 / its norm
    cs = np.stack([res[(p_long, k)] for k in range(len(qitems))]) * sc.basis.scale_of(p_long)
    for k in range(len(qitems)):
        # float32 scores of a long row whose token contributions cancel: the error is relative to their magnitude
        assert abs(cs[k].sum() - sc.scores.per_item[k, p_long]) < 1e-5 * np.abs(cs[k]).sum()
        assert sc.scores.rank_item[k, p_long] == pytest.approx(best_window(cs[k])[0])
    # float32 aggregation of per-item windows vs float64 here: agree to float32 precision
    assert sc.scores.rank_agg[p_long] == pytest.approx(best_window(cs.mean(0))[0], rel=1e-4)
    assert sc.scores.rank_agg[p_long] == pytest.approx(win["score"], rel=1e-4)
    others = np.arange(len(sc.scores.rank_agg)) != p_long
    np.testing.assert_array_equal(sc.scores.rank_agg[others], aggregate(sc.scores.per_item)[others])
    a, b = win["tokens"]
    assert b - a == 128
    from gradian.explain.spans import window_char_range

    text = s.examples[p_long].plain_text()
    lo, hi = window_char_range(s.examples[p_long], s.toks[p_long], 0, s.toks[p_long].n_supervised, s.tokenizer)
    assert text[lo:hi].startswith(text[text.index("assistant: ") + 11 :][:20]) and hi == len(text)
    wlo, whi = window_char_range(s.examples[p_long], s.toks[p_long], a, b, s.tokenizer)
    assert lo <= wlo < whi <= hi


def test_spans_add_up_and_land_on_the_planted_answer(demo_long):
    from gradian.attribution.stage import Ranking, ScoreSource, StateRows
    from gradian.explain.spans import SPANS_PER_ROW
    from gradian.pipeline import spans_stage

    s, sc, qitems, truth, p_long, ix = demo_long
    planted = truth["planted"]
    rows = [{"position": p} for p in planted[:3] + [p_long]]
    ranking = Ranking(sc, ScoreSource("exact_index", ("final",), (s.adapter_path,)),
                      StateRows("exact_index", ix.capture.projector, ix.rows, {}, lambda: None))
    given = [dict(r) for r in rows]
    found = spans_stage(s, ranking, rows, qitems)
    assert rows == given  # the ranking rows are not edited: the drill-down returns what it adds
    spans, rows = found.spans, [found.row(r) for r in rows]
    pos_item = {q.item: k for k, q in enumerate(qitems)}
    for r in rows:
        ts = r["top_span"]
        p, k = r["position"], pos_item[ts["item"]]
        # forward-mode token contributions summed against the reverse-mode index score, both float32: 1.1e-5
        # relative apart under ATEN_CPU_CAPABILITY=default, 1e-6 natively
        assert _rel(ts["item_score"], sc.scores.per_item[k, p]) < 1e-4, (p, ts["item_score"], sc.scores.per_item[k, p])
        assert k == int(np.argmax(sc.scores.rank_item[:, p]))  # against the item the row harms most
        text = s.examples[p].plain_text()
        assert text[ts["start"] : ts["end"]] == ts["text"]
        mine = [sp for sp in spans if sp["position"] == p]
        assert 1 <= len(mine) <= SPANS_PER_ROW and mine[0]["score"] == ts["score"]
    for r in rows[:3]:  # a planted row's top span is its wrong answer
        assert r["top_span"]["text"] == s.examples[r["position"]].record["messages"][-1]["content"]


def test_projected_index_with_preconditioner_reranks_consistently(demo_long, tmp_path):
    """With a projected index and a preconditioner, a re-ranked candidate's exact score is <r, P(g)> + <e, g>: the
    parameter-space direction P^T r + e reproduces it token by token, and the fidelity check still runs."""
    from gradian.attribution.engine import ModelGradients
    from gradian.model_side import gradients_of
    from gradian.attribution.queries import query_items, select_failing
    from gradian.attribution.rerank import parameter_directions
    from gradian.config import load_config
    from gradian.pipeline import evaluate, index_stage, score_adapter
    from gradian.setup.session import open_session

    s0 = demo_long[0]
    cfg = load_config(s0.cfg.root + "/gradian.yaml", [
        "grads.projection_dim=1024", "grads.rerank=12", "grads.fidelity_sample=40",
        "attribution.preconditioner=diagonal", f"grads.cache_dir={tmp_path / 'ix'}"])
    s = open_session(cfg)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing[:4], "contrastive")
    ix = index_stage(s)
    keys, proj = ix.row_keys, ix.capture.projector
    assert not proj.exact
    sc = score_adapter(s, ix, qitems, direction)
    ix.close()
    grads = gradients_of(s, ix.capture)
    assert sc.rerank.cand.size == 12 and sc.rerank.r is not None and sc.rerank.e is not None and sc.rerank.fidelity is not None
    assert sc.scores.order[:12].tolist() == sc.rerank.cand[np.argsort(-sc.scores.rank_agg[sc.rerank.cand], kind="stable")].tolist()
    dirs = parameter_directions(sc.basis, sc.rerank, proj, exact_part=True)
    rows = [int(p) for p in sc.rerank.cand[:3]]
    res = grads.contributions(dirs, rows)
    for p in rows:
        for k in range(len(qitems)):
            c = res[(p, k)] * sc.basis.scale_of(p)  # unit rows: contributions times 1 / the row's norm
            # float32 scores against float64 sums: 1e-3 of the contributions' magnitude holds on every kernel path
            assert abs(c.sum() - sc.scores.per_item[k, p]) < 1e-3 * max(np.abs(c).sum(), 1e-6)
    # a non-candidate keeps its projected score, reproduced by P^T w
    other = int(next(p for p in range(len(keys)) if p not in set(sc.rerank.cand.tolist()) and s.toks[p].n_supervised))
    res = grads.contributions(parameter_directions(sc.basis, sc.rerank, proj, exact_part=False), [other])
    for k in range(len(qitems)):
        c = res[(other, k)] * sc.basis.scale_of(other)
        assert abs(c.sum() - sc.scores.per_item[k, other]) < 1e-3 * max(np.abs(c).sum(), 1e-6)


def test_every_row_reranked_skips_the_projected_windows_and_gives_the_same_scores(demo_long, tmp_path, monkeypatch):
    """With every row a re-rank candidate (rerank >= rows) the exact re-rank recomputes every long row's windows, so
    the projected windows are skipped: the same scores, order and windows bit for bit, at half the forward-mode jobs
    (one per long row and item instead of two)."""
    import gradian.attribution.windows as win
    from gradian.attribution.engine import ModelGradients
    from gradian.model_side import gradients_of
    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.pipeline import evaluate, index_stage, score_adapter
    from gradian.setup.session import open_session

    s0 = demo_long[0]
    cfg = load_config(s0.cfg.root + "/gradian.yaml", [
        "grads.projection_dim=512", "grads.rerank=1000", "grads.fidelity_sample=16", f"grads.cache_dir={tmp_path / 'ix'}"])
    s = open_session(cfg)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing[:3], "contrastive")
    ix = index_stage(s)
    assert not ix.capture.projector.exact and len(ix.row_keys) <= 1000
    jobs = []
    real = ModelGradients.contributions

    def counting(self, dirs, positions, items=None):
        out = real(self, dirs, positions, items)
        jobs.append(len(out))
        return out

    monkeypatch.setattr(ModelGradients, "contributions", counting)
    skipped = score_adapter(s, ix, qitems, direction)
    n_skipped = sum(jobs)
    jobs.clear()
    monkeypatch.setattr(win, "projected_windows_overwritten", lambda *a: False)
    full = score_adapter(s, ix, qitems, direction)
    n_full = sum(jobs)
    ix.close()
    long_rows = win.long_rows(s.toks)
    assert long_rows and list(skipped.windows.long_rows) == list(full.windows.long_rows) == long_rows
    assert n_skipped == len(long_rows) * len(qitems) and n_full == 2 * n_skipped
    assert skipped.rerank.cand.size == full.rerank.cand.size == len(s.toks)
    for name in ("per_item", "rank_item", "rank_agg", "order"):
        assert np.array_equal(getattr(skipped.scores, name), getattr(full.scores, name)), name
    assert skipped.windows.found == full.windows.found and skipped.windows.item_rows == full.windows.item_rows
    assert skipped.rerank.fidelity == full.rerank.fidelity
    assert skipped.windows.all_items and full.windows.all_items
