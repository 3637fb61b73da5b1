"""Memory that does not grow with width x rows, and defaults that fit: the pieces, on small arrays and models.

The real-shaped end-to-end runs are in test_real_shapes.py (marked `scale`)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch

from gradian.attribution import directions as D
from gradian.grads.layout import SiteShape
from gradian.projection import AUTO_EXACT_MAX_WIDTH, AUTO_WIDTH, Projector, back_project, choose_projection
from gradian.projection.data_aware import Basis

from conftest import make_random_lora_model

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ projection: auto


def test_auto_keeps_small_indexes_exact_and_projects_real_widths():
    demo = choose_projection("auto", 45_056, 300)  # the demo: its figures must not move
    assert demo.dim is None and "exact gradients" in demo.reason
    smol = choose_projection("auto", 4_884_480, 64)  # SmolLM-135M, r 16 on all 7 projections
    assert smol.dim == AUTO_WIDTH and "4884480" in smol.reason and str(AUTO_EXACT_MAX_WIDTH) in smol.reason
    many = choose_projection("auto", 45_056, 20_000)  # 3.4 GiB exact: over the budget
    assert many.dim == AUTO_WIDTH and "GiB" in many.reason
    half = choose_projection("auto", 45_056, 20_000, "float16")  # half precision halves the exact index: 1.7 GiB
    assert half.dim is None
    narrow = choose_projection("auto", 4_000, 10_000_000)  # no narrower than the projection: exact
    assert narrow.dim is None
    assert choose_projection(None, 4_884_480, 64).dim is None
    assert choose_projection(1024, 4_884_480, 64).dim == 1024
    assert choose_projection(10**8, 4_884_480, 64).dim is None
    assert set(smol.describe()) == {"setting", "dim", "exact", "exact_width", "reason"}


def test_config_default_is_auto_and_null_means_exact():
    from gradian.config import config_from_dict, load_config

    cfg = config_from_dict({"model": {"base": "x"}, "data": {"train": "t.jsonl"}})
    assert cfg.grads.projection_dim == "auto" and cfg.model.quantization == "none"
    cfg = config_from_dict({"model": {"base": "x"}, "data": {"train": "t.jsonl"}, "grads": {"projection_dim": None}})
    assert cfg.grads.projection_dim is None
    from gradian.errors import ConfigError

    with pytest.raises(ConfigError, match="grads.projection_dim"):
        config_from_dict({"model": {"base": "x"}, "data": {"train": "t"}, "grads": {"projection_dim": "big"}})
    with pytest.raises(ConfigError, match="model.quantization"):
        config_from_dict({"model": {"base": "x", "quantization": "nf8"}, "data": {"train": "t"}})


# ------------------------------------------------------------------------------------------------ back_project


def _one_sided_projector():
    """A data-aware projector whose fit gave site 0 dims on its A side only and site 1 nothing at all."""
    sites = [SiteShape("a", 2, 6, 5), SiteShape("b", 2, 4, 3)]
    pr = Projector(sites, 3, "data-aware")
    g = torch.Generator().manual_seed(0)
    basis = Basis(stage2={("a", "A"): torch.linalg.qr(torch.randn(2 * 6, 3, generator=g))[0]}, examples=1)
    pr.set_basis(basis)
    assert pr.site_dims() == [3, 0]
    return pr


def test_back_project_with_a_side_of_width_zero():
    pr = _one_sided_projector()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, pr.dim))
    u = back_project(pr, w)  # raised "appears to not have been used in the graph" before
    assert u.shape == (4, pr.exact_dim) and u.dtype == np.float32
    dA = torch.randn(5, 2, 6)
    dB = torch.randn(5, 5, 2)
    dA2, dB2 = torch.randn(5, 2, 4), torch.randn(5, 3, 2)
    proj = torch.cat([pr.project(0, dA, dB), pr.project(1, dA2, dB2)], 1).numpy()
    exact = torch.cat([dA.flatten(1), dB.flatten(1), dA2.flatten(1), dB2.flatten(1)], 1).numpy()
    np.testing.assert_allclose(w @ proj.T, u @ exact.T, rtol=1e-4, atol=1e-5)  # <w, P g> = <P^T w, g>
    assert not u[:, 12:].any()  # the empty side and the empty site get zeros


# ------------------------------------------------------------------------------------------------ directions


def test_directions_in_blocks_equal_the_whole_matrix(monkeypatch):
    rng = np.random.default_rng(1)
    A = rng.standard_normal((7, 50)).astype(np.float32)
    B = rng.standard_normal((7, 50)).astype(np.float32)
    whole = D.ArrayDirections(A) + D.ArrayDirections(B)
    monkeypatch.setattr(D, "DIRECTION_BYTES", 4 * 50 * 3)  # 3 items per block
    assert D.blocks(7, 50) == [[0, 1, 2], [3, 4, 5], [6]]
    np.testing.assert_allclose(np.concatenate([whole.rows(b) for b in D.blocks(7, 50)]), A + B, rtol=1e-6)
    np.testing.assert_allclose(whole.mean().rows([0])[0], (A + B).mean(0), rtol=1e-5, atol=1e-6)
    calls = []
    part = D.ExactPart(lambda ks: (calls.append(list(ks)), A[list(ks)])[1], np.arange(7) + 1.0, [20, 30],
                       scale=np.array([2.0, 0.5]))
    got = part.rows([2, 5])
    want = A[[2, 5]] * np.array([[3.0], [6.0]])
    want[:, :20] *= 2.0
    want[:, 20:] *= 0.5
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert calls == [[2, 5]]


def test_exact_inner_and_contributions_stream_directions_in_blocks(monkeypatch):
    """A block of directions per capture pass gives the same inner products and per-token contributions as all
    directions at once (the memory bound may not change a figure)."""
    from gradian.attribution.engine import ModelGradients
    from gradian.grads.capture import GradientCapture
    from gradian.setup.model import lora_sites
    from gradian.setup.tokenize import Tokenized

    model = make_random_lora_model()
    sites, _ = lora_sites(model)
    g = torch.Generator().manual_seed(3)
    toks = []
    for n in (9, 12, 7):
        ids = torch.randint(3, 97, (n,), generator=g).tolist()
        toks.append(Tokenized(ids, [False] * 3 + [True] * (n - 3), ""))

    class Tok:
        pad_token_id = 0

    cap = GradientCapture(model, sites)
    mg = ModelGradients(cap, Tok(), [], toks, False, 2, 64, 1024)
    rng = np.random.default_rng(0)
    dirs = rng.standard_normal((5, cap.dim)).astype(np.float32)
    full = mg.exact_inner(dirs, [0, 1, 2])
    full_c = mg.contributions(dirs, [0, 2], [4, 1])
    monkeypatch.setattr(D, "DIRECTION_BYTES", 4 * cap.dim * 2)  # 2 directions per block
    # BLAS sums a [2, D] block in another order than [5, D]: equal to float32 precision, not bit for bit
    np.testing.assert_allclose(mg.exact_inner(dirs, [0, 1, 2]), full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
    blocked_c = mg.contributions(dirs, [0, 2], [4, 1])
    assert set(blocked_c) == set(full_c) == {(0, 4), (2, 1)}
    for k in full_c:  # other batches (other padding) per block: float32 precision
        np.testing.assert_allclose(blocked_c[k], full_c[k], rtol=1e-4, atol=1e-5 * np.abs(full_c[k]).max())
    vecs, _ = cap.vectors(*__import__("gradian.setup.batches", fromlist=["collate"]).collate(toks, 0))
    np.testing.assert_allclose(full, dirs @ vecs.numpy().T, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------------ clusters


def test_cluster_sketch_never_holds_a_dense_width_by_k_matrix():
    """At a real exact width (here 400k dims) the old dense Gaussian sketch was width x 1024 float64 (3.3 GB here,
    37 GB at 4.9M dims); the hashed sketch holds one column block."""
    from gradian.explain.clusters import gradient_clusters

    rng = np.random.default_rng(0)
    n, d = 24, 400_000
    G = rng.standard_normal((n, d)).astype(np.float32)
    G[[3, 11, 17]] = G[3] + 0.3 * rng.standard_normal((3, d)).astype(np.float32)
    tracemalloc.start()
    groups = gradient_clusters(G, exact_max_floats=0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert groups == [[3, 11, 17]]
    assert peak < 400 << 20, f"{peak / 2**20:.0f} MB"


def test_clusters_grow_from_the_top_scored_rows_in_one_pass():
    """More rows than seeds: the pool is the top-scored rows and their gradient neighbours, so a cluster reached
    from a top row is found whole (its low-scored members too), and the work is linear in rows."""
    from gradian.explain.clusters import cluster_pool, gradient_clusters
    from gradian.store.rows import RowSource

    rng = np.random.default_rng(0)
    n, d = 3000, 256
    G = rng.standard_normal((n, d))
    common = rng.standard_normal(d)
    members = [7, 500, 1200, 2999]
    G[members] = common + 0.3 * rng.standard_normal((4, d))
    scores = rng.normal(size=n)
    scores[7] = 10.0  # one member at the top, the others anywhere
    scores[[500, 1200, 2999]] = -1.0
    src = RowSource(G, memory_bytes=8 * d * 256)  # 256 rows per chunk
    pool = cluster_pool(src, scores, seeds=50, pool_max=200)
    assert set(members) <= set(pool.tolist()) and pool.size < 200
    reads = src.reads
    assert gradient_clusters(src, scores=scores, seeds=50, pool_max=200) == [members]
    # one pass over the rows (12 chunks) plus the seeds' and the pool's rows, not n^2
    assert src.reads - reads <= 12 + 2 + 2
    # without scores (or with at most `seeds` rows) every row is in the graph, as before
    assert gradient_clusters(G) == [members]


# ------------------------------------------------------------------------------------------------ index memory


def test_shards_and_score_blocks_are_bounded_in_bytes(tmp_path, monkeypatch):
    import gradian.store.index as I

    dim = 1000
    monkeypatch.setattr(I, "SCORE_BLOCK_BYTES", 4 * dim * 7)  # 7 rows at a time
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((40, dim)).astype(np.float32)
    keys = [f"r{i}" for i in range(40)]
    with I.GradientIndex.open(tmp_path / "ix", key="k", dim=dim, shard_rows=64) as ix:
        ix.add(keys, vecs)
        seen = []
        orig = ix._gather
        monkeypatch.setattr(ix, "_gather", lambda s, l, c: (seen.append(len(s)), orig(s, l, c))[1])
        q = rng.standard_normal((3, dim)).astype(np.float32)
        got = ix.score(q, keys)
    assert max(seen) == 7
    np.testing.assert_allclose(got, q @ vecs.T, rtol=1e-5, atol=1e-4)


def test_index_build_shards_hold_a_bounded_number_of_bytes(tmp_path, monkeypatch):
    import gradian.store.build as B
    from gradian.config import config_from_dict
    from gradian.setup.model import lora_sites
    from gradian.setup.tokenize import Tokenized

    model = make_random_lora_model()
    sites, _ = lora_sites(model)
    g = torch.Generator().manual_seed(0)
    toks = [Tokenized(torch.randint(3, 97, (8 + i % 3,), generator=g).tolist(), [False] * 4 + [True] * (4 + i % 3), "")
            for i in range(20)]
    exact = sum(s.numel for s in sites)
    monkeypatch.setattr(B, "SHARD_BYTES", 4 * exact * 5)  # 5 rows, rounded up to the batch of 4: 8
    cfg = config_from_dict({"model": {"base": "x"}, "data": {"train": "t"}, "output": str(tmp_path),
                            "grads": {"batch_size": 4, "projection_dim": None}})
    ix = B.open_index(cfg, model, sites, toks, str(tmp_path), 0)
    rows = [s["rows"] for s in json.loads((ix.index.root / "manifest.json").read_text())["shards"]]
    ix.close()
    assert rows == [8, 8, 4]
    assert ix.info.summary()["projection_choice"]["exact"] is True
