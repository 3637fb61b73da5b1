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
    from gradian.attribution.engine import ModelGradients
    from gradian.attribution.stage import exact_capture

    return ModelGradients.from_session(s, exact_capture(s))


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
    np.testing.assert_allclose(sc.per_item, ref.per_item, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sc.norms, ref.norms, rtol=1e-5)
    assert np.array_equal(np.argsort(-sc.rank_agg, kind="stable")[:20], np.argsort(-ref.rank_agg, kind="stable")[:20])


def test_streamed_rows_score_against_the_sample_preconditioner(demo):
    """A budget that holds 64 rows: the diagonal is the sample's second moment, and every row (held or streamed)
    scores as the exact rows would against that preconditioner."""
    from gradian.attribution.one_pass import HELD_MIN_ROWS, fit_on, preconditioned_units, score_one_pass
    from gradian.attribution.scoring import harm_factor
    from gradian.grads.layout import exact_widths
    from gradian.store.rows import RowSource

    s, ix, qitems, direction, _ = demo
    grads = _grads(s)
    sc, op = score_one_pass(grads, qitems, _settings(s, direction), memory_bytes=1)
    assert len(op.plan.held) == HELD_MIN_ROWS and op.plan.streamed
    assert op.sketches is not None and op.sketches.shape[0] == len(s.toks)
    rows = ix.rows  # exact index rows, training order
    where = {k: i for i, k in enumerate(ix.row_keys)}
    held = RowSource(np.stack([rows.subset([p]).read(0, 1)[0] for p in op.plan.held]).astype(np.float32))
    pre = fit_on("diagonal", None, held, exact_widths(s.sites))
    q = grads.query_vectors(qitems, exact=True)
    unit, _ = preconditioned_units(q, pre)
    inner = rows.inner(unit)
    norms = rows.row_norms(pre.metric_weights())
    want = harm_factor(direction) * inner / norms[None, :]
    np.testing.assert_allclose(sc.per_item, want, rtol=2e-4, atol=1e-6)
    assert len(where) <= len(s.toks)


def test_a_row_score_is_its_naive_gradient_against_the_query(demo):
    """Per row: a plain backward of its summed supervised loss (parameter .grad, one example at a time) dotted
    with the preconditioned unit query, over its norm in the preconditioner's metric."""
    from gradian.attribution.one_pass import score_one_pass
    from gradian.attribution.scoring import harm_factor
    from gradian.grads.objectives import per_example_loss

    s, _, qitems, direction, truth = demo
    sc, _ = score_one_pass(_grads(s), qitems, _settings(s, direction))
    w = sc.precond.metric_weights()
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
        want = harm_factor(direction) * (sc.unit.astype(np.float64) @ g) / np.sqrt((g * g) @ w)
        np.testing.assert_allclose(sc.per_item[:, p], want, rtol=1e-3, atol=1e-6)
    s.model.zero_grad(set_to_none=True)
