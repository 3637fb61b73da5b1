"""The per-row store a first pass leaves (`store.rowstore`, `attribution.one_pass`, `attribution.shortlist`), on the
trained demo with a held budget of 64 rows (the rest streamed): a rerun of the same question reads every score
back without a backward; a pass killed with SIGKILL (in its held phase or its streamed phase) resumes and ends with
the bits of an uninterrupted pass; a later question shortlists by the store and ranks its top rows as a full pass
does, scoring fewer rows; a corrupt, truncated or foreign store is detected and not trusted; and `gradian
attribute` asks a second question of a conversation run through the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from test_precondition import trained_demo

    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.pipeline import evaluate
    from gradian.setup.session import open_session

    run = tmp_path_factory.mktemp("row-store")
    cfg_path = trained_demo(run)
    s = open_session(load_config(cfg_path))
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    first = query_items(cap, s.eval_items, failing[:4], "contrastive")
    later = query_items(cap, s.eval_items, failing[4:10], "contrastive")
    return s, cfg_path, first, later, direction


def _settings(s, direction):
    from gradian.attribution.engine import ScoringSettings

    return ScoringSettings.from_config(s.cfg, direction, windows=False, top_k=20)


def _pass(s, qitems, direction, root):
    from gradian.attribution.one_pass import score_one_pass
    from gradian.model_side import gradients_of

    return score_one_pass(gradients_of(s), qitems, _settings(s, direction), memory_bytes=1, store_root=root,
                          store_key="demo")


@pytest.fixture
def backward_rows(monkeypatch):
    """Training rows differentiated from now on (each batch's row count; the queries' own backward aside)."""
    return _counting(monkeypatch)


def _counting(monkeypatch) -> list[int]:
    from gradian.attribution import row_pass, shortlist

    seen: list[int] = []
    real = row_pass.exact_batches

    def counting(*a, **kw):
        for got in real(*a, **kw):
            seen.append(len(got[1]))
            yield got

    monkeypatch.setattr(row_pass, "exact_batches", counting)
    monkeypatch.setattr(shortlist, "exact_batches", counting)
    return seen


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a.scores, k), getattr(b.scores, k)) for k in ("per_item", "rank_item",
                                                                                    "rank_agg"))


def test_a_rerun_reads_every_row_back(demo, tmp_path, backward_rows):
    s, _, first, _, direction = demo
    a, op = _pass(s, first, direction, tmp_path / "store")
    assert op.reused == 0 and sum(backward_rows) == len(op.plan.held) + len(op.plan.streamed)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["sealed"] and not (tmp_path / "store" / "held.f32").exists()  # not every row was held
    backward_rows.clear()
    b, op = _pass(s, first, direction, tmp_path / "store")
    assert sum(backward_rows) == 0 and op.reused == len(op.plan.unique)
    assert _same(a, b)


KILL = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from gradian.attribution.engine import ScoringSettings
from gradian.attribution.one_pass import score_one_pass
from gradian.attribution.queries import query_items, select_failing
from gradian.config import load_config
from gradian.model_side import gradients_of
from gradian.pipeline import evaluate
from gradian.setup.session import open_session
from gradian.store.rowstore import RowStore

phase, after, root = sys.argv[2], int(sys.argv[3]), sys.argv[5]
s = open_session(load_config(sys.argv[4]))
cap = evaluate(s)
failing, direction = select_failing(cap, s.eval_items)
q = query_items(cap, s.eval_items, failing[:4], "contrastive")
name = "put_held" if phase == "held" else "put_part"
real, done = getattr(RowStore, name), []

def dying(self, *a, **kw):
    real(self, *a, **kw)
    done.append(1)
    if len(done) == after:
        os.kill(os.getpid(), signal.SIGKILL)

setattr(RowStore, name, dying)
score_one_pass(gradients_of(s), q, ScoringSettings.from_config(s.cfg, direction, windows=False, top_k=20),
               memory_bytes=1, store_root=root, store_key="demo")
"""


@pytest.mark.parametrize("phase,after", [("held", 3), ("streamed", 2)])
def test_a_pass_killed_with_sigkill_resumes_to_the_same_bits(demo, tmp_path, backward_rows, phase, after):
    """The child dies by SIGKILL right after the store recorded `after` held batches (the preconditioner's sample)
    or `after` parts (the held rows' part and the first streamed one: 192 of 300 rows). The
    resumed pass recomputes only what the store lacks and ends with an uninterrupted pass's bits."""
    s, cfg_path, first, _, direction = demo
    root = tmp_path / "killed"
    env = {**os.environ, "GRADIAN_PROGRESS": "0"}
    p = subprocess.run([sys.executable, "-c", KILL, str(HERE.parent / "src"), phase, str(after), str(cfg_path),
                        str(root)], env=env, capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    manifest = json.loads((root / "manifest.json").read_text())
    assert not manifest["sealed"]
    got, op = _pass(s, first, direction, root)
    n = len(op.plan.held) + len(op.plan.streamed)
    if phase == "held":
        assert len(manifest["held"]["batches"]) == after and manifest["precond"] is None
        assert sum(backward_rows) == n - after * s.cfg.grads.batch_size
    else:
        assert len(manifest["parts"]) == after and op.reused == sum(p["rows"] for p in manifest["parts"])
        assert 0 < sum(backward_rows) < len(op.plan.streamed)
    backward_rows.clear()
    want, _ = _pass(s, first, direction, tmp_path / "whole")
    assert _same(got, want)
    # the reference rows' exact gradients a later question reads: the uninterrupted pass's bytes
    assert (root / "ref.f32").read_bytes() == (tmp_path / "whole" / "ref.f32").read_bytes()


def test_a_later_question_shortlists_by_the_store(demo, tmp_path, backward_rows):
    """Another question on a finished store: its top rows are a full pass's, the shortlist's scores are exact (a
    full pass's up to the batches they were computed in), the reference rows are scored from the exact gradients the
    pass kept of them, a few rows are differentiated, and the bound on what the shortlist can miss is stated."""
    from gradian.attribution.one_pass import opened, prepare
    from gradian.attribution.scoring import rank
    from gradian.attribution.shortlist import score_shortlist
    from gradian.model_side import gradients_of

    s, _, first, later, direction = demo
    root = tmp_path / "store"
    _pass(s, first, direction, root)
    full, op = _pass(s, later, direction, None)
    settings = _settings(s, direction)
    backward_rows.clear()
    grads = gradients_of(s)
    with opened(root, "demo", {}) as store:
        ps = prepare(grads, later, settings, store, None, memory_bytes=1)
        assert store.sealed and store.question != ps.qkey
        got, _, info = score_shortlist(grads, store, ps, settings, None, 20)
    # the 256 reference rows are read from the exact gradients the pass kept of them: the rest from a backward each
    assert info.stored == 256 and (tmp_path / "store" / "ref.f32").exists()
    assert 0 < sum(backward_rows) == info.exact - info.stored < 64
    top = rank(full.scores.rank_agg, 20)
    assert rank(got.scores.rank_agg, 20).tolist() == top.tolist()
    np.testing.assert_allclose(got.scores.per_item[:, top], full.scores.per_item[:, top], rtol=1e-5, atol=1e-9)
    d = info.describe()
    assert d["exact_rows"] == info.exact and 0 <= d["shortlist"]["expected_missed"] < 0.05
    # the sketch's errors on the rows scored both ways are its predicted spread (CountSketch variance), give or take
    assert 0.7 < d["shortlist"]["calibration"] < 1.5 and "sketch error" in d["shortlist"]["rule"]
    # a corrupt reference file is not trusted: its rows are differentiated again, to the same ranking
    raw = bytearray((root / "ref.f32").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (root / "ref.f32").write_bytes(bytes(raw))
    backward_rows.clear()
    with opened(root, "demo", {}) as store:
        ps = prepare(grads, later, settings, store, None, memory_bytes=1)
        again, _, info = score_shortlist(grads, store, ps, settings, None, 20)
    assert info.stored == 0 and sum(backward_rows) == info.exact > 256
    assert rank(again.scores.rank_agg, 20).tolist() == top.tolist()


def test_the_reference_rows_kept_fit_their_disk_budget(demo, tmp_path, backward_rows, monkeypatch):
    """With room for 40 rows (`one_pass.REF_BYTES`), the store keeps the first 40 reference rows; a later question
    reads those and differentiates the other 216 with its shortlist, to the same ranking."""
    from gradian.attribution import one_pass
    from gradian.attribution.one_pass import opened, prepare
    from gradian.attribution.scoring import rank
    from gradian.attribution.shortlist import score_shortlist
    from gradian.model_side import gradients_of

    s, _, first, later, direction = demo
    grads = gradients_of(s)
    settings = _settings(s, direction)
    with opened(None, "", {}) as tmp:
        width = prepare(grads, first, settings, tmp, None, memory_bytes=1).width
    monkeypatch.setattr(one_pass, "REF_BYTES", 40 * 4 * width + 3)
    root = tmp_path / "store"
    _pass(s, first, direction, root)
    assert (root / "ref.f32").stat().st_size == 40 * 4 * width
    full, _ = _pass(s, later, direction, None)
    backward_rows.clear()
    with opened(root, "demo", {}) as store:
        ps = prepare(grads, later, settings, store, None, memory_bytes=1)
        got, _, info = score_shortlist(grads, store, ps, settings, None, 20)
    assert info.stored == 40 and info.reference == 256 and sum(backward_rows) == info.exact - 40 > 216
    assert rank(got.scores.rank_agg, 20).tolist() == rank(full.scores.rank_agg, 20).tolist()


def test_a_corrupt_or_foreign_store_is_not_trusted(demo, tmp_path, backward_rows):
    s, _, first, _, direction = demo
    root = tmp_path / "store"
    clean, op = _pass(s, first, direction, root)
    manifest = json.loads((root / "manifest.json").read_text())
    part = manifest["parts"][1]
    raw = bytearray((root / part["file"]).read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit pattern in the middle of a part
    (root / part["file"]).write_bytes(bytes(raw))
    backward_rows.clear()
    again, _ = _pass(s, first, direction, root)
    assert sum(backward_rows) == part["rows"] and _same(clean, again)  # that part alone recomputed
    (root / manifest["parts"][2]["file"]).write_bytes(raw[: len(raw) // 3])  # truncated
    backward_rows.clear()
    again, _ = _pass(s, first, direction, root)
    assert sum(backward_rows) == manifest["parts"][2]["rows"] and _same(clean, again)
    m = json.loads((root / "manifest.json").read_text())
    m["key"] = "another-model"
    (root / "manifest.json").write_text(json.dumps(m))
    backward_rows.clear()
    again, _ = _pass(s, first, direction, root)
    assert sum(backward_rows) == len(op.plan.held) + len(op.plan.streamed) and _same(clean, again)
    (root / "manifest.json").write_text("{not json")
    backward_rows.clear()
    again, _ = _pass(s, first, direction, root)
    assert sum(backward_rows) == len(op.plan.held) + len(op.plan.streamed) and _same(clean, again)


@pytest.mark.parametrize("held", ["every", "sample"])
def test_attribute_asks_a_second_question_of_a_conversation_run(tmp_path, monkeypatch, held):
    """conversation4 (conversations ranked by exchange, through `gradian attribute`): the first run leaves the store
    (in the cache the runs share); a rerun reads every score back (the same scores.npy); the same config with another
    eval set (every other eval item) is asked of the store and ranks the same top rows as a full pass over that eval
    set does (`attribution.store: full`).

    `every`: each of the 100 rows is held (the default budget), so the store keeps every row's exact gradient and the
    second question reads them all, without a backward: a full pass's scores to the bit. `sample`: a held budget of
    64 rows (the rest streamed) and 40 reference rows (`scoring.REFERENCE_ROWS`, 256 in use): the second question
    scores the reference rows (and their exchanges) from the exact gradients the pass kept of them, shortlists the
    rest by the store's sketches and scores the shortlist from a backward each."""
    from test_precondition import trained_scenario

    from gradian.attribution import one_pass, scoring
    from gradian.attribution.scoring import rank

    if held == "sample":
        monkeypatch.setattr(scoring, "REFERENCE_ROWS", 40)
        monkeypatch.setattr(one_pass, "DEFAULT_HELD_BYTES", 1)
    from gradian.config import load_config
    from gradian.pipeline import attribute

    run = tmp_path / "conv4"
    cfg_path = trained_scenario(run, "conversation4", 0)
    cache = "grads.cache_dir=cache"  # one cache for every output (the default is OUT/index)
    first = attribute(load_config(cfg_path, ["output=first", cache]))
    store = first["scoring"]["store"]
    assert first["scoring"]["reused_rows"] == 0 and (Path(store) / "manifest.json").exists()
    assert (Path(store) / "ref.f32").exists() == (held == "sample")
    again = attribute(load_config(cfg_path, ["output=again", cache]))
    assert again["scoring"]["reused_rows"] == first["scoring"]["unique_rows"]
    assert (run / "first" / "scores.npy").read_bytes() == (run / "again" / "scores.npy").read_bytes()
    lines = (run / "eval.jsonl").read_text().splitlines()
    (run / "eval2.jsonl").write_text("\n".join(lines[::2]) + "\n")
    sets = ["data.eval=eval2.jsonl", "attribution.top_k=10", cache]
    seen = _counting(monkeypatch)
    second = attribute(load_config(cfg_path, ["output=second", "attribution.store=shortlist", *sets]))
    differentiated = sum(seen)
    # the full pass in a cache of its own: every row differentiated again, nothing read from the first pass's store
    full = attribute(load_config(cfg_path, ["output=full", "attribution.store=full", *sets, "grads.cache_dir=fresh"]))
    assert full["scoring"]["reused_rows"] == 0 and full["scoring"]["store"] != store
    assert second["verdict"] == full["verdict"] == "attributed"
    sl = second["scoring"]
    assert sl["mode"].startswith("per-row store") and sl["store"] == store
    s2, sf = np.load(run / "second" / "scores.npy"), np.load(run / "full" / "scores.npy")
    if held == "every":
        assert "every row's exact gradient" in sl["mode"] and differentiated == 0
        assert s2.tobytes() == sf.tobytes()
        return
    assert sl["stored_exact_rows"] == sl["shortlist"]["reference_rows"] <= 40 < sl["exact_rows"] < sl["unique_rows"]
    assert 0 < differentiated == sl["exact_rows"] - sl["stored_exact_rows"] and "sketch error" in sl["shortlist"]["rule"]
    # the same top rows with the same scores (a row's z: its exact score against its item's exact reference rows)
    top = rank(sf, 10)
    assert set(rank(s2, 10).tolist()) == set(top.tolist()) and rank(s2, 1).tolist() == rank(sf, 1).tolist()
    np.testing.assert_allclose(s2[top], sf[top], rtol=1e-4)


def test_the_fused_sketches_are_the_count_sketches():
    """`row_pass.Reducer.sketches` (one sparse product, the metric folded into the signs) against each CountSketch
    applied on its own (float64): the clusters' unit sketch of the unit row, and the store's sketch of sqrt(w) g /
    |g|_w (what a later question's unit query / sqrt(w), sketched by `CountSketch.apply`, is scored against)."""
    from gradian.attribution.row_pass import Reducer, norms_of

    rng = np.random.default_rng(3)
    D = 5000
    v = rng.normal(size=(6, D)).astype(np.float32)
    v[2] = 0.0
    w = rng.uniform(0.2, 5.0, size=D)
    red = Reducer.make(rng.normal(size=(2, D)).astype(np.float32), w, D, seed=7, sketch_dim=64)
    red.cluster.block = red.score.block = 1500  # several hash blocks
    nm = norms_of(v, w)
    cl, sk = red.sketches(v, nm)
    unit = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
    ref = red.cluster.apply(unit)
    ref = ref / np.maximum(np.linalg.norm(ref, axis=1, keepdims=True), 1e-30)
    np.testing.assert_allclose(cl, ref, rtol=1e-4, atol=1e-6)
    want = red.score.apply(v.astype(np.float64) * np.sqrt(w) / np.maximum(nm, 1e-30)[:, None])
    np.testing.assert_allclose(sk.astype(np.float64), want, rtol=2e-3, atol=2e-3)
    assert not cl[2].any() and not sk[2].any()
    q = rng.normal(size=D)  # a query's sketch against a row's: the inner product <q / sqrt(w), sqrt(w) g> / |g|_w
    est = red.score.apply((q / np.sqrt(w))[None, :]) @ sk.astype(np.float64).T
    exact = (q @ v.T.astype(np.float64)) / np.maximum(nm, 1e-30)
    assert np.corrcoef(est[0, [0, 1, 3, 4, 5]], exact[[0, 1, 3, 4, 5]])[0, 1] > 0.5
