"""Preconditioners: exact maths on small problems, streaming from an on-disk index, and the damping defaults pinned
on the built-in poisoned demo (a trained demo run is cached under GRADIAN_CACHE/test-runs by content hash)."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gradian.attribution.precondition import DEFAULT_DAMPING, DEFAULT_KIND, Preconditioner, datainf_inverse, diagonal_inverse, fisher_inverse_dense, fisher_inverse_woodbury, mean_eigenvalue, precondition
from gradian.store.rows import RowSource
from gradian.grads.layout import block_slices

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------- a cached demo run


def trained_scenario(dst: Path, name: str = "substitution", seed: int = 0) -> Path:
    """A built-in scenario written to `dst` (the demo's own files for "substitution") with its trained adapter.
    Training is deterministic on CPU, so the adapter is cached under GRADIAN_CACHE/test-runs by a hash of everything
    it depends on (data, config, training code, torch version) and copied on later calls."""
    import gradian.demo.run as demo_run
    import gradian.training.loop as train_mod
    from gradian.config import load_config
    from gradian.demo.tiny import cache_root

    if name == "substitution":
        cfg_path = demo_run.prepare_demo(dst, seed=seed, progress=False)
    else:
        from gradian.demo.scenario import write_scenario
        from gradian.demo.scenarios import make_scenario
        from gradian.demo.tiny import TinySpec, build_tiny_base
        from gradian.demo.world import World

        spec = TinySpec()
        sc = make_scenario(name, World.generate(seed=spec.seed, n_entities=spec.n_entities), seed)
        truth = sc.truth()
        base = build_tiny_base(TinySpec(**(truth.get("tiny_spec") or {})), progress=False)
        write_scenario(sc, dst)
        extra = {k: truth[k] for k in ("grads", "evaluation") if truth.get(k)}
        cfg_path = demo_run.write_demo_config(dst, base, train=truth.get("train") or {}, extra=extra)
    h = hashlib.sha256()
    for f in ("train.jsonl", "eval.jsonl", "gradian.yaml"):
        h.update((dst / f).read_bytes())
    h.update(inspect.getsource(train_mod).encode())
    h.update(torch.__version__.encode())
    cached = cache_root() / "test-runs" / f"{name}-{seed}-{h.hexdigest()[:16]}"
    if not (cached / "complete").exists():
        train_mod.train_adapter(load_config(cfg_path), progress=False)
        tmp = cached.with_name(cached.name + f".tmp-{id(dst)}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(dst / "adapter", tmp / "adapter")
        (tmp / "complete").write_text("1")
        try:
            tmp.rename(cached)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.copytree(cached / "adapter", dst / "adapter")
    return cfg_path


def trained_demo(dst: Path, seed: int = 0) -> Path:
    return trained_scenario(dst, "substitution", seed)


# ------------------------------------------------------------------------------------------------ exact maths


def _problem(n=12, d=40, q=3, seed=0):
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.1, 3.0, size=d)  # uneven coordinates so the methods differ
    return rng.normal(size=(n, d)) * scale, rng.normal(size=(q, d))


def test_woodbury_equals_the_dense_inverse():
    G, Q = _problem()
    lam = 0.05
    dense = fisher_inverse_dense(Q, G, lam)
    wood = fisher_inverse_woodbury(Q, G, lam)
    np.testing.assert_allclose(wood, dense, rtol=1e-9, atol=1e-9)
    # and it is the inverse: (F + lam I) x = q
    F = G.T @ G / G.shape[0] + lam * np.eye(G.shape[1])
    np.testing.assert_allclose(dense @ F.T, Q, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("memory", [1 << 30, 3000])  # one group of blocks, or one block per pass
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 8 * 40 * 5])  # all rows at once, or 5-row chunks (pairs)
def test_fisher_class_is_the_block_diagonal_dense_inverse(memory, chunk_bytes):
    G, Q = _problem(n=12, d=40)
    dims = [25, 10, 5]  # a Woodbury block (25 > N=12) and two primal blocks (10, 5 <= N)
    rel = 0.3
    p = Preconditioner("fisher", rel, dims, memory_bytes=memory).fit(RowSource(G, memory_bytes=chunk_bytes))
    got = p.apply(Q)
    assert p.describe()["solver"] == {"primal_blocks": 2, "woodbury_blocks": 1}
    for s in block_slices(dims):
        lam = rel * mean_eigenvalue(G[:, s])
        np.testing.assert_allclose(got[:, s], fisher_inverse_dense(Q[:, s], G[:, s], lam), rtol=1e-8, atol=1e-10)


def test_datainf_matches_its_formula():
    G, Q = _problem(n=9, d=30)
    dims = [20, 10]
    rel = 2.0
    got = Preconditioner("datainf", rel, dims).fit(RowSource(G, memory_bytes=8 * 30 * 4)).apply(Q)
    for s in block_slices(dims):
        g = G[:, s]
        lam = rel * mean_eigenvalue(g)
        for qi in range(Q.shape[0]):
            q = Q[qi, s]
            ref = sum(q - (q @ gi) / (lam + gi @ gi) * gi for gi in g) / (len(g) * lam)
            np.testing.assert_allclose(got[qi, s], ref, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(datainf_inverse(q, g, lam), ref, rtol=1e-10, atol=1e-12)


def test_diagonal_uses_the_second_moment_and_a_global_damping():
    G, Q = _problem()
    rel = 0.5
    got = precondition(Q, G, "diagonal", damping=rel, block_dims=[20, 20])
    m = np.square(G).mean(0)
    np.testing.assert_allclose(got, diagonal_inverse(Q, m, rel * m.mean()), rtol=1e-12)


def test_identity_and_unknown_kind():
    G, Q = _problem()
    np.testing.assert_array_equal(precondition(Q, G, "identity"), Q)
    with pytest.raises(ValueError, match="unknown kind"):
        Preconditioner("kfac")


def test_streams_from_an_on_disk_index_with_duplicate_rows(tmp_path):
    """Fisher statistics from index shards equal those of the in-memory rows; a key listed twice counts twice."""
    from gradian.store.index import GradientIndex

    G, Q = _problem(n=10, d=24)
    keys = [f"row{i}" for i in range(10)]
    idx = GradientIndex.open(tmp_path / "ix", key="k", dim=24, storage_dtype="float32", shard_rows=4)
    idx.add(keys, G.astype(np.float32))
    idx.flush()
    row_keys = keys + ["row3"]  # a duplicated training row
    G_all = np.concatenate([G, G[3:4]]).astype(np.float32).astype(np.float64)
    for kind in ("fisher", "datainf", "diagonal"):
        a = Preconditioner(kind, 0.7, [16, 8]).fit(RowSource(index=idx, row_keys=row_keys, memory_bytes=8 * 24 * 3))
        b = Preconditioner(kind, 0.7, [16, 8]).fit(RowSource(G_all))
        np.testing.assert_allclose(a.apply(Q), b.apply(Q), rtol=1e-9, atol=1e-12)
    idx.close()


# ------------------------------------------------------------------------------------ damping defaults on the demo


def _per_item_scores(run: Path, cfg_path: Path, settings, *, checkpoints: bool = False) -> tuple[dict, dict, list]:
    """Per-item scores for each (preconditioner, damping), through pipeline.score_adapter on one session: at the final
    adapter alone, or (checkpoints=True) averaged over the adapter's saved epoch checkpoints as `attribute` reports
    them by default (attribution.checkpoints: auto)."""
    from gradian.attribution.queries import query_items, select_failing
    from gradian.config import load_config
    from gradian.pipeline import evaluate, index_stage, score_adapter, score_stage
    from gradian.setup.session import open_session

    # the figures the damping was chosen on: scores averaged over the saved epoch checkpoints (`auto`)
    s = open_session(load_config(cfg_path, ["attribution.checkpoints=auto"] if checkpoints else []))
    cap = evaluate(s)
    failing, direction = select_failing(cap, s.eval_items)
    qitems = query_items(cap, s.eval_items, failing, "contrastive")
    # score_stage opens the indexes of the states it scores itself: an index held open here would hold its lock
    ix = None if checkpoints else index_stage(s)
    out = {}
    for kind, damping in settings:
        if checkpoints:
            ranking = score_stage(s, qitems, direction, preconditioner=kind, damping=damping)
            assert ranking.source.entry["source"] == "saved"
            out[(kind, damping)] = ranking.totals
        else:
            out[(kind, damping)] = score_adapter(s, ix, qitems, direction, preconditioner=kind,
                                                 damping=damping).scores.per_item
    if ix is not None:
        ix.close()
    return out, json.loads((run / "truth.json").read_text()), qitems


@pytest.fixture(scope="module")
def demo_per_item(tmp_path_factory):
    run = tmp_path_factory.mktemp("precond-demo")
    return _per_item_scores(run, trained_demo(run), [("identity", None), ("diagonal", None), ("fisher", None),
                                                     ("datainf", None), ("ekfac", None), ("fisher", 0.1)],
                            checkpoints=True)


def _figures(per_item, truth, qitems):
    from gradian.attribution.scoring import aggregate, auprc, recall_at_k

    agg = aggregate(per_item)
    planted = truth["planted"]
    item_planted = ({int(k): v for k, v in truth["item_planted"].items()} if "item_planted" in truth else
                    {i: [pf["position"]] for pf in truth["planted_facts"] for i in pf["eval_indices"]})
    top1 = np.mean([int(np.argmax(row)) in item_planted.get(q.item, []) for row, q in zip(per_item, qitems)])
    return recall_at_k(agg, planted, 10), auprc(agg, planted), float(top1)


@pytest.mark.parametrize("kind", ["identity", "diagonal", "fisher", "datainf", "ekfac"])
def test_default_damping_finds_the_planted_rows_on_the_demo(demo_per_item, kind):
    """Scores as `attribute` reports them with `attribution.checkpoints: auto` (averaged over the saved epoch
    checkpoints, unit rows, contrastive queries), the setting the damping defaults were chosen on. Measured with unit rows (recall@10 / AUPRC / per-item top-1, every kind alike within 0.03): native (AVX512)
    1.0 / 1.000 / 0.968; `ATEN_CPU_CAPABILITY=default` 0.9 / 0.905-0.926 / 1.0 (one planted row just below the
    top 10); `avx2` as native. Against them, Fisher at a tenth of its damping: 0.6 / 0.70 natively, 0.4 / 0.42 under
    `default`. The bars sit below the lowest kernel path's figures and well above what a broken kind gives."""
    out, truth, qitems = demo_per_item
    r10, ap, top1 = _figures(out[(kind, None)], truth, qitems)
    assert r10 >= 0.9 and ap >= 0.85, (kind, r10, ap)
    assert top1 >= 0.9, (kind, top1)


def test_small_fisher_damping_explains_the_query_away(demo_per_item):
    """Why the Fisher default is large: at 0.1 x the mean eigenvalue the inverse divides away the planted rows'
    direction (N << D: a near pseudo-inverse on the span of the training gradients). Measured (native / default /
    avx2 kernels): recall@10 0.9 against 1.0 and AUPRC 0.977 / 0.967 / 0.921 against 1.0."""
    out, truth, qitems = demo_per_item
    assert DEFAULT_DAMPING["fisher"] >= 10
    r_small, ap_small, _ = _figures(out[("fisher", 0.1)], truth, qitems)
    r_default, ap_default, _ = _figures(out[("fisher", None)], truth, qitems)
    assert r_small < r_default and ap_small < ap_default - 0.01, (r_small, r_default, ap_small, ap_default)


def test_default_preconditioner_ranks_eight_turn_chats_at_least_as_well_as_identity(tmp_path):
    """conversation8 (seed 0): one wrong assistant turn hidden in 8-turn chats, scored at the final adapter with unit
    rows. Long chats share many directions with every query; the default diagonal preconditioner divides the common
    ones down. Measured (recall@10 / AUPRC / per-item top-1, default vs identity): native and avx2 0.88 / 0.912 / 1.0
    vs 0.50 / 0.572 / 0.857; `ATEN_CPU_CAPABILITY=default` 1.0 / 1.000 / 0.75 vs 1.0 / 0.986 / 0.833. Training differs
    in the last bits between kernel paths and which items flip differs with it: per-item top-1 is not a stable
    comparison (unit rows already took most of the long chats' advantage), the AUPRC ordering is."""
    run = tmp_path / "conv8"
    out, truth, qitems = _per_item_scores(run, trained_scenario(run, "conversation8", 0),
                                          [("identity", None), (DEFAULT_KIND, None)])
    _, ap_id, top1_id = _figures(out[("identity", None)], truth, qitems)
    r10, ap, top1 = _figures(out[(DEFAULT_KIND, None)], truth, qitems)
    assert ap >= ap_id and ap >= 0.85 and r10 >= 0.8, (ap, ap_id, r10)
    assert top1 >= 0.7, (top1, top1_id)
