"""One pass over the training rows (`attribution.one_pass`): exact scores without an index.

Proven three ways on the trained demo: with every row held it is the exact index's maths (the same scores); with a
held sample and the rest streamed, each streamed row scores as it would from memory against the preconditioner
fitted on the sample; and a row's score is its naive gradient (one example per plain backward) against the
preconditioned unit query, times its unit-row scale.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from test_precondition import trained_demo

    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.pipeline import evaluate, index_stage
    from gradian.setup.session import open_session

    run = tmp_path_factory.mktemp("one-pass")
    cfg = load_config(trained_demo(run))
    s = open_session(cfg)
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing[:6], "contrastive")
    ix = index_stage(s)
    assert ix.capture.projector.exact  # the demo's index is exact: the reference
    truth = json.loads((run / "truth.json").read_text())
    yield s, ix, qitems, direction, truth
    ix.close()


def _grads(s):
    from gradian.model_side import gradients_of

    return gradients_of(s)


def _settings(s, direction, **kw):
    from gradian.attribution.engine import ScoringSettings

    return ScoringSettings.from_config(s.cfg, direction, windows=False, **kw)


@pytest.mark.parametrize("kind", ["diagonal", "identity", "fisher"])
def test_every_row_held_is_the_exact_index(demo, kind):
    from gradian.attribution.one_pass import score_one_pass
    from gradian.pipeline import score_adapter

    s, ix, qitems, direction, _ = demo
    ref = score_adapter(s, ix, qitems, direction, preconditioner=kind, windows=False)
    sc, op = score_one_pass(_grads(s), qitems, _settings(s, direction, preconditioner=kind))
    assert op.plan.all_held and len(op.plan.held) == len(op.plan.unique)
    np.testing.assert_allclose(sc.scores.per_item, ref.scores.per_item, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sc.basis.norms, ref.basis.norms, rtol=1e-5)
    assert np.array_equal(np.argsort(-sc.scores.rank_agg, kind="stable")[:20],
                          np.argsort(-ref.scores.rank_agg, kind="stable")[:20])


def test_streamed_rows_score_against_the_sample_preconditioner(demo):
    """A budget that holds 64 rows: the diagonal is the sample's second moment, and every row (held or streamed)
    scores as the exact rows would against that preconditioner."""
    from gradian.attribution.basis import fit_preconditioner, preconditioned_units
    from gradian.attribution.one_pass import HELD_MIN_ROWS, score_one_pass
    from gradian.attribution.scoring import harm_factor
    from gradian.grads.layout import exact_widths
    from gradian.store.rows import RowSource

    s, ix, qitems, direction, _ = demo
    grads = _grads(s)
    sc, op = score_one_pass(grads, qitems, _settings(s, direction), memory_bytes=1)
    assert len(op.plan.held) == HELD_MIN_ROWS and op.plan.streamed
    assert isinstance(op.features, np.ndarray) and op.features.shape[0] == len(s.toks)  # sketches: clusters
    rows = ix.rows  # exact index rows, training order
    where = {k: i for i, k in enumerate(ix.row_keys)}
    held = RowSource(np.stack([rows.subset([p]).read(0, 1)[0] for p in op.plan.held]).astype(np.float32))
    pre = fit_preconditioner("diagonal", None, held, exact_widths(s.sites))
    q = grads.query_vectors(qitems, exact=True)
    unit, _ = preconditioned_units(q, pre)
    inner = rows.inner(unit)
    norms = rows.row_norms(pre.metric_weights())
    want = harm_factor(direction) * inner / norms[None, :]
    np.testing.assert_allclose(sc.scores.per_item, want, rtol=2e-4, atol=1e-6)
    assert len(where) <= len(s.toks)


def test_a_row_score_is_its_naive_gradient_against_the_query(demo):
    """Per row: a plain backward of its summed supervised loss (parameter .grad, one example at a time) dotted
    with the preconditioned unit query, over its norm in the preconditioner's metric."""
    from gradian.attribution.one_pass import score_one_pass
    from gradian.attribution.scoring import harm_factor
    from gradian.grads.objectives import per_example_loss

    s, _, qitems, direction, truth = demo
    sc, _ = score_one_pass(_grads(s), qitems, _settings(s, direction))
    w = sc.basis.precond.metric_weights()
    for p in truth["planted"][:2] + [0]:
        t = s.toks[p]
        ids = torch.tensor([t.input_ids])
        attn = torch.ones_like(ids)
        sup = torch.tensor([t.supervised])
        s.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            per_example_loss(s.model, ids, attn, sup).sum().backward()
        g = torch.cat([torch.cat([x.A.weight.grad.flatten(), x.B.weight.grad.flatten()]) for x in s.sites])
        g = g.double().numpy()
        want = harm_factor(direction) * (sc.basis.unit.astype(np.float64) @ g) / np.sqrt((g * g) @ w)
        np.testing.assert_allclose(sc.scores.per_item[:, p], want, rtol=1e-3, atol=1e-6)
    s.model.zero_grad(set_to_none=True)


def test_a_smoke_test_ranks_rows_by_their_naive_gradient_norm(demo):
    """No eval set: `row_pass.gradient_norms` streams the rows once (no index) and gives each its squared gradient
    norm, and the rows their gradient agreement; both against plain backwards, one example at a time (every row)."""
    from gradian.attribution.row_pass import gradient_norms
    from gradian.checks.convergence import gradient_agreement
    from gradian.grads.objectives import per_example_loss

    s, *_ = demo
    squared, agree = gradient_norms(_grads(s))
    naive = []
    for t in s.toks:
        ids = torch.tensor([t.input_ids])
        s.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            per_example_loss(s.model, ids, torch.ones_like(ids), torch.tensor([t.supervised])).sum().backward()
        naive.append(torch.cat([torch.cat([x.A.weight.grad.flatten(), x.B.weight.grad.flatten()])
                                for x in s.sites]).double().numpy())
    s.model.zero_grad(set_to_none=True)
    naive = np.stack(naive)
    want = (naive * naive).sum(1)
    np.testing.assert_allclose(squared, want, rtol=1e-3, atol=1e-6 * want.max())  # float32 batched vs one by one
    assert squared.shape == (len(s.toks),) and np.unique(squared).size > len(s.toks) // 2  # not flat
    ratio, n = gradient_agreement([naive])
    assert agree[1] == n and agree[0] == pytest.approx(ratio, rel=1e-4)


def test_a_conversation_is_ranked_by_its_best_exchange(demo):
    """Chat rows of several exchanges, every token trained: `per_item` stays the whole row's score, `rank_item` is
    the best exchange's unit score, each exchange's the naive reference (its positions' share of a plain backward,
    weights copied there) against the preconditioned unit query over its norm; one-exchange rows are unchanged."""
    from dataclasses import replace

    from test_capture import _naive_segment_grads

    from gradian.attribution.one_pass import score_one_pass
    from gradian.attribution.row_pass import position_turns
    from gradian.attribution.scoring import harm_factor
    from gradian.grads.objectives import naive_per_example_loss
    from gradian.setup.alignment import token_exchanges
    from gradian.setup.records import Example
    from gradian.setup.tokenize import tokenize_example

    s, _, qitems, direction, _ = demo
    pairs = [("What is two plus two?", "Two plus two is four."), ("Where does Rodrol live?", "He lives in Lima."),
             ("Say hello.", "Hello there!"), ("Name a colour.", "Blue is a colour.")]
    rows = []
    for k in range(6):
        msgs = []
        for q, a in pairs[k % 2 : k % 2 + 2 + k % 3]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append(Example(f"c{k}", k, "messages", {"messages": msgs}))
    toks = [tokenize_example(s.tokenizer, ex, 256, loss="all") for ex in rows]
    turns = [token_exchanges(ex, t, s.tokenizer) for ex, t in zip(rows, toks)]
    assert [0 if t is None else int(t.max()) + 1 for t in turns] == [2, 3, 4, 2, 3, 3]
    grads = replace(_grads(s), toks=toks)
    sc, _ = score_one_pass(grads, qitems, _settings(s, direction), turns=turns)
    whole, _ = score_one_pass(grads, qitems, _settings(s, direction, per_turn=False))
    assert np.array_equal(sc.scores.per_item, whole.scores.per_item)
    assert np.array_equal(whole.scores.rank_item, whole.scores.per_item)
    assert not np.array_equal(sc.scores.rank_item, sc.scores.per_item)
    w = sc.basis.precond.metric_weights()
    for p in (1, 5):
        t = toks[p]
        ids = torch.tensor(t.input_ids)
        lab = position_turns(turns[p])
        want = []
        for u in range(int(lab.max()) + 1):
            logits, copies, handles = _naive_segment_grads(s.model, s.sites, ids, len(ids), torch.tensor(lab == u))
            try:
                with torch.enable_grad():
                    loss = naive_per_example_loss(logits, ids[None], torch.tensor([t.supervised])).sum()
                    g = torch.autograd.grad(loss, [x for ab in copies for x in ab])
            finally:
                for h in handles:
                    h.remove()
            g = torch.cat([x.flatten() for x in g]).double().numpy()
            want.append(harm_factor(direction) * (sc.basis.unit.astype(np.float64) @ g) / np.sqrt((g * g) @ w))
        want = np.stack(want, axis=1)  # [Q, U]
        np.testing.assert_allclose(sc.exchanges.found[p]["scores"], want, rtol=2e-3, atol=1e-6)
        np.testing.assert_allclose(sc.scores.rank_item[:, p], want.max(1), rtol=2e-3, atol=1e-6)
        assert np.array_equal(sc.exchanges.found[p]["best"], want.argmax(1))
        np.testing.assert_allclose(sc.scores.rank_agg[p], want.max(1).mean(), rtol=2e-3, atol=1e-6)


def test_the_ranking_row_names_the_exchange_the_ranking_took():
    """`pipeline.ranked_turn`: the exchange whose wins add the most to the row's ranking score, its reply, how many
    items it wins, every exchange's mean score, and the HTML's note; a schema-valid entry."""
    from gradian.pipeline import ranked_turn
    from gradian.report.ranking_schema import RankedTurn
    from gradian.report.sections import _turn_note
    from gradian.setup.records import Example

    msgs = []
    for q, a in [("Hi?", "Hello."), ("Capital of Japan?", "Osaka."), ("Bye?", "Goodbye.")]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    ex = Example("c", 0, "messages", {"messages": msgs})
    # items 0 and 1 won by exchange 0 by a little, item 2 by exchange 1 by a lot: exchange 1 carries the score
    scores = np.array([[0.30, 0.29, 0.0], [0.2, 0.1, 0.0], [0.0, 0.9, 0.1]], dtype=np.float32)
    t = ranked_turn(ex, {"best": scores.argmax(1), "scores": scores})
    assert t["turn"] == 1 and t["turns"] == 3 and t["text"] == "Osaka." and t["items"] == 1
    assert t["scores"] == pytest.approx([0.5 / 3, 1.29 / 3, 0.1 / 3], abs=1e-6)
    RankedTurn.model_validate(t)
    assert _turn_note(RankedTurn.model_validate(t)) == "ranked by exchange 2 of 3" and _turn_note(None) is None


def test_attribute_ranks_a_tiny_conversation_set_by_exchange(tmp_path):
    """conversation4 (seed 0, one wrong assistant turn in 4-turn chats) on the tiny model, whose exact index would be
    stored: conversations take the one pass and are ranked by exchange; the report names each conversation row's
    exchange, the planted rows' `turn` is their planted turn, and the planted rows rank as well as whole rows do
    (measured with `bench/fidelity.py --scenarios conversation4 --seeds 0`: AUPRC 0.942 by exchange, 0.898 whole;
    7 accused, all planted, against 1). By exchange / whole rows, each kernel path with a fresh cache (its own
    adapter): native 0.942 / 0.898, ATEN_CPU_CAPABILITY=default 0.934 / 0.899, avx2 0.802 / 0.764 (items combined by
    their mean; with the max z of `attribution.combine: auto`, the default since, 0.958 by exchange natively, and the
    test passes under the default and avx2 kernel paths with fresh caches)."""
    from test_precondition import trained_scenario

    from gradian.attribution.scoring import auprc
    from gradian.config import load_config
    from gradian.pipeline import attribute

    run = tmp_path / "conv4"
    cfg_path = trained_scenario(run, "conversation4", 0)
    truth = json.loads((run / "truth.json").read_text())
    turns = {int(k): v for k, v in truth["planted_turns"].items()} if isinstance(truth["planted_turns"], dict) else \
        {d["position"]: d["turn"] for d in truth["planted_turns"]}
    by_turn = attribute(load_config(cfg_path, ["output=by-turn"]))
    whole = attribute(load_config(cfg_path, ["output=whole", "attribution.per_turn=false"]))
    assert by_turn.get("index") is None or "one pass" in json.dumps(by_turn.get("index"))  # no stored index
    rows = by_turn["ranking"]
    assert all("turn" in r for r in rows) and not any("turn" in r for r in whole["ranking"])
    named = [r for r in rows if r["position"] in turns]
    assert named and all(r["turn"]["turn"] == turns[r["position"]] for r in named[:5])
    planted = truth["planted"]
    s_turn = np.load(run / "by-turn" / "scores.npy")
    s_whole = np.load(run / "whole" / "scores.npy")
    a_turn, a_whole = auprc(s_turn, planted), auprc(s_whole, planted)
    # the margin holds under the default and avx2 kernel paths too, whose last bits train another adapter
    assert a_turn >= a_whole and a_turn >= 0.75, (a_turn, a_whole)
    acc = by_turn["accused"]["positions"]
    assert acc and set(acc) <= set(planted)


def test_token_parts_bound_the_padded_tokens():
    """`token_parts` cuts a batch where rows x its longest row would pass the bound; a row longer than the bound is
    a batch of its own; without a bound (or under it) the batches are those of `batch_size` alone."""
    from gradian.setup.batches import token_parts
    from gradian.setup.tokenize import Tokenized

    toks = [Tokenized([1] * n, [True] * n, "") for n in (10, 10, 10, 30, 30, 100, 5, 5)]
    pos = list(range(len(toks)))
    assert token_parts(toks, pos, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert token_parts(toks, pos, 3, max_tokens=10_000) == token_parts(toks, pos, 3)
    parts = token_parts(toks, pos, 3, max_tokens=60)
    assert parts == [[0, 1, 2], [3, 4], [5], [6, 7]]
    assert sorted(p for part in parts for p in part) == pos  # every row once, in the order given
    for part in parts:
        assert len(part) == 1 or len(part) * max(len(toks[p].input_ids) for p in part) <= 60


def test_a_token_bound_cuts_batches_not_scores(demo, monkeypatch):
    """A backward budget small enough to cut the demo's batches (rows of a few tokens each) differentiates the rows
    in more, smaller batches: each row's exact gradient is its own, so the scores match the uncut pass's and the
    store, keyed by the bound, is not shared between the two."""
    from gradian.attribution.one_pass import score_one_pass
    from gradian.grads import budget

    s, _, qitems, direction, _ = demo
    grads = _grads(s)
    default = grads.max_batch_tokens
    assert default > grads.batch_size * max(len(t.input_ids) for t in s.toks)  # the demo's batches are never cut
    uncut, _ = score_one_pass(grads, qitems, _settings(s, direction))
    per_token = budget.backward_bytes_per_token(grads.model, grads.sites)
    longest = max(len(t.input_ids) for t in s.toks)
    monkeypatch.setattr(budget, "BACKWARD_BYTES", per_token * 2 * longest)
    assert grads.max_batch_tokens == 2 * longest
    parts = grads.parts(list(range(len(s.toks))))
    assert max(len(p) for p in parts) <= 2 and len(parts) > len(s.toks) // grads.batch_size
    from gradian.attribution.row_pass import exact_batches

    some = list(range(12))
    assert [part for _, part, _, _ in exact_batches(grads, some, "cut")] == grads.parts(some)  # what is run
    cut, _ = score_one_pass(grads, qitems, _settings(s, direction))
    np.testing.assert_allclose(cut.scores.per_item, uncut.scores.per_item, rtol=1e-4, atol=1e-6)
