"""LoRA-aware projections: unbiased inner products, seeded determinism, block/sparse application, the
project-the-inputs identity, exactness, and the data-aware basis (fit, allocation, disk round trip, wiring)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import gradian.projection as P
from gradian.grads.capture import GradientCapture, per_example_site_grads
from gradian.grads.layout import site_shapes
from gradian.errors import ConfigError
from gradian.projection.data_aware import BASIS_FILE, fit_basis
from gradian.projection.projector import Projector
from gradian.grads.layout import SiteShape
from gradian.projection.random import SparseJL, random_matrix

torch.set_num_threads(1)

RANDOM = ["rademacher", "gaussian", "sjlt"]
SITES = [SiteShape("layers.0.q", 4, 96, 80), SiteShape("layers.0.down", 2, 160, 48), SiteShape("layers.1.v", 4, 48, 24)]


def _grads(sites, n, seed=0, rank=None):
    """Per-site (dA [n, r, d_in], dB [n, d_out, r]); with `rank`, the dA rows and dB columns of every seed lie in
    one fixed rank-dim subspace per site side."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j, s in enumerate(sites):
        if rank is None:
            dA, dB = torch.randn(n, s.r, s.d_in, generator=g), torch.randn(n, s.d_out, s.r, generator=g)
        else:
            sub = torch.Generator().manual_seed(1000 + j)
            ua, ub = torch.randn(rank, s.d_in, generator=sub), torch.randn(s.d_out, rank, generator=sub)
            dA = torch.randn(n, s.r, rank, generator=g) @ ua
            dB = ub @ torch.randn(n, rank, s.r, generator=g)
        out.append((dA, dB))
    return out


def _project(proj, per_site):
    return torch.cat([proj.project(i, a, b) for i, (a, b) in enumerate(per_site)], 1)


def _exact(per_site):
    return torch.cat([torch.cat([a.flatten(1), b.flatten(1)], 1) for a, b in per_site], 1)


# ------------------------------------------------------------------------------------------ random kinds


@pytest.mark.parametrize("kind", RANDOM)
def test_projected_inner_products_are_unbiased(kind):
    """Mean over 400 seeds of <Px, Py> is <x, y> within 4 standard errors, with the variance bound
    Var <= (|x|^2 |y|^2 + <x, y>^2) / k that holds for all three kinds (and is near tight)."""
    site = [SiteShape("s", 1, 256, 1)]  # r = 1, d_out = 1 <= k: only the A side is projected
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 256, generator=g)
    y = 0.6 * x + torch.randn(1, 1, 256, generator=g)
    zb = torch.zeros(1, 1, 1)
    exact = float((x * y).sum())
    vals = []
    for seed in range(400):
        pr = Projector(site, 32, kind, seed)  # k = 32 // 2 = 16
        assert pr.k == 16 and pr.dim == 17
        vals.append(float((pr.project(0, x, zb) * pr.project(0, y, zb)).sum()))
    vals = np.array(vals)
    var_bound = (float(x.square().sum() * y.square().sum()) + exact**2) / 16
    se = math.sqrt(var_bound / len(vals))
    assert abs(vals.mean() - exact) < 4 * se, (vals.mean(), exact, se)
    assert 0.5 * var_bound < vals.var() < 1.5 * var_bound  # a wrong scale or a degenerate matrix shows here


@pytest.mark.parametrize("kind", RANDOM)
def test_projection_is_the_matrix_on_the_wide_side_only(kind):
    pr = Projector(SITES, 160, kind, 3)  # k = 160 // 20 = 8
    per = _grads(SITES, 5)
    for i, (dA, dB) in enumerate(per):
        ma, mb = pr.matrix(i, "A"), pr.matrix(i, "B")
        ref = torch.cat([(dA @ ma).flatten(1), (mb.T @ dB).flatten(1)], 1)
        torch.testing.assert_close(pr.project(i, dA, dB), ref, rtol=1e-5, atol=1e-6)
    assert pr.dim == sum(s.r * 16 for s in SITES) == _project(pr, per).shape[1]


def test_same_seed_same_matrix_and_names_sides_seeds_differ():
    for kind in RANDOM:
        a = random_matrix(200, 12, kind=kind, seed=7, name="m.q", side="A")
        assert torch.equal(a, random_matrix(200, 12, kind=kind, seed=7, name="m.q", side="A"))
        for other in (dict(seed=8, name="m.q", side="A"), dict(seed=7, name="m.k", side="A"),
                      dict(seed=7, name="m.q", side="B")):
            assert not torch.equal(a, random_matrix(200, 12, kind=kind, **other)), (kind, other)
        p1, p2 = Projector(SITES, 160, kind, 5), Projector(SITES, 160, kind, 5)
        per = _grads(SITES, 3)
        assert torch.equal(_project(p1, per), _project(p2, per))
        assert not torch.equal(_project(p1, per), _project(Projector(SITES, 160, kind, 6), per))


def test_dense_matrices_come_in_seeded_blocks(monkeypatch):
    """Block b of a matrix depends on (seed, site, side, b) only: a taller matrix starts with the same rows, and
    streaming the blocks (nothing cached) gives the materialised product."""
    d = P.BLOCK_ROWS + 300
    for kind in ("rademacher", "gaussian"):
        tall = random_matrix(d, 8, kind=kind, seed=1, name="s", side="A")
        short = random_matrix(P.BLOCK_ROWS, 8, kind=kind, seed=1, name="s", side="A")
        assert torch.equal(tall[: P.BLOCK_ROWS], short)
        monkeypatch.setattr(P.projector, "DENSE_CACHE_BYTES", 0)
        site = [SiteShape("s", 2, d, 4)]
        pr = Projector(site, 32, kind, 1)  # k = 8
        assert pr._dense(site[0], "A", d, torch.device("cpu")) is None  # streamed, never held whole
        dA = torch.randn(3, 2, d)
        torch.testing.assert_close(pr.project(0, dA, torch.randn(3, 4, 2))[:, :16], (dA @ tall).flatten(1),
                                   rtol=1e-5, atol=1e-5)
        monkeypatch.undo()


def test_sjlt_is_sparse_and_its_sparse_product_matches_dense():
    s = SparseJL(1000, 256, seed=3)
    m = s.dense()
    assert ((m != 0).sum(1) == P.SJLT_NNZ).all()  # s nonzeros per input coordinate, in distinct buckets
    assert torch.allclose(m.square().sum(1), torch.ones(1000))  # each row has unit norm: E[P P^T] = I
    x = torch.randn(5, 3, 1000)
    torch.testing.assert_close(s.apply(x), x @ m, rtol=1e-5, atol=1e-5)
    # the projector uses the CSR product from SJLT_SPARSE_FROM_K on, and it is the same transform
    site = [SiteShape("s", 1, 1000, 2)]
    pr = Projector(site, 2 * P.random.SJLT_SPARSE_FROM_K, "sjlt", 0)
    assert pr.k == P.random.SJLT_SPARSE_FROM_K and pr._dense(site[0], "A", 1000, torch.device("cpu")) is None
    dA = torch.randn(4, 1, 1000)
    torch.testing.assert_close(pr.project(0, dA, torch.randn(4, 2, 1))[:, : pr.k], (dA @ pr.matrix(0, "A"))[:, 0],
                               rtol=1e-5, atol=1e-5)


def test_below_the_minimum_width_is_a_clear_error():
    min_width = sum(2 * s.r for s in SITES)
    with pytest.raises(ConfigError) as e:
        Projector(SITES, min_width - 1, "rademacher")
    assert "grads.projection_dim" in str(e.value) and str(min_width) in str(e.value)
    assert Projector(SITES, min_width, "sjlt").dim == min_width
    assert Projector(SITES, 7, "data-aware").dim == 7  # the data-aware budget has no minimum


def test_exact_when_dim_is_none_or_not_smaller():
    per = _grads(SITES, 4)
    exact_dim = sum(s.r * (s.d_in + s.d_out) for s in SITES)
    for pr in (Projector(SITES), Projector(SITES, exact_dim, "rademacher"), Projector(SITES, 10**6, "data-aware")):
        assert pr.exact and pr.dim == exact_dim and pr.spec() is None and not pr.needs_fit
        assert torch.equal(_project(pr, per), _exact(per))


# -------------------------------------------------------------------------------------- LoRA-aware identity


# ------------------------------------------------------------------------------------------------ data-aware


def test_data_aware_is_exact_on_gradients_inside_the_fitted_subspace():
    """Rows in a rank-3 subspace per side: stage 1 keeps it whole (k1 >= 3), stage 2 keeps every nonzero
    direction when the budget allows, so projected inner products equal exact ones."""
    fit = [_grads(SITES, 16, seed=s, rank=3) for s in range(2)]
    budget = sum(s.r * 3 * 2 for s in SITES)
    pr = Projector(SITES, budget, "data-aware", 0)
    fit_basis(pr, fit)
    test = _grads(SITES, 16, seed=9, rank=3)  # the same subspaces, rows the fit never saw
    e, p = _exact(test), _project(pr, test)
    torch.testing.assert_close(p @ p.T, e @ e.T, rtol=1e-4, atol=1e-3)
    assert p.shape[1] == pr.dim == budget and sum(pr.site_dims()) == budget


def test_data_aware_gives_the_budget_to_the_sites_with_energy():
    per = _grads(SITES, 12, seed=4)
    per[1] = (per[1][0] * 0, per[1][1] * 0)  # a site with no gradient at all
    pr = Projector(SITES, 40, "data-aware", 0)
    assert pr.site_dims() == [] and pr.needs_fit
    fit_basis(pr, [per])
    dims = pr.site_dims()
    assert sum(dims) == 40 and dims[1] == 0 and _project(pr, per).shape == (12, 40)
    # the rows' energy is kept far better than by a random projection of the same width
    e = _exact(per).square().sum()
    assert _project(pr, per).square().sum() / e > 0.5


def test_data_aware_fit_is_deterministic_and_round_trips_from_disk(tmp_path):
    batches = [_grads(SITES, 8, seed=s) for s in range(3)]
    a, b = Projector(SITES, 64, "data-aware", 0), Projector(SITES, 64, "data-aware", 0)
    fit_basis(a, batches)
    fit_basis(b, batches)
    sha_a, sha_b = a.save_basis(tmp_path / "a.safetensors"), b.save_basis(tmp_path / "b.safetensors")
    assert sha_a == sha_b and (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    c = Projector(SITES, 64, "data-aware", 0)
    assert c.load_basis(tmp_path / "a.safetensors", sha256=sha_a) == sha_a
    test = _grads(SITES, 5, seed=9)
    assert torch.equal(_project(a, test), _project(c, test))
    assert c.describe()["basis_sha256"] == sha_a and c.spec() == a.spec()
    with pytest.raises(ValueError, match="sha256"):
        Projector(SITES, 64, "data-aware", 0).load_basis(tmp_path / "a.safetensors", sha256="0" * 64)
    with pytest.raises(ValueError, match="other settings"):
        Projector(SITES, 32, "data-aware", 0).load_basis(tmp_path / "a.safetensors")
    bad = bytearray((tmp_path / "a.safetensors").read_bytes())
    bad[10:20] = b"\xff" * 10
    (tmp_path / "bad.safetensors").write_bytes(bytes(bad))
    with pytest.raises(ValueError):
        Projector(SITES, 64, "data-aware", 0).load_basis(tmp_path / "bad.safetensors")


def test_frequent_directions_sketch_finds_the_gram_directions(monkeypatch):
    """A wide side above GRAM_MAX_D is fitted with a sketch; on low-rank rows it finds the same subspace."""
    sites = [SiteShape("w", 2, 1200, 8)]  # k1 = 128, sketch of l = 512 rows: Gram only up to 1024
    fit = [_grads(sites, 40, seed=s, rank=5) for s in range(2)]
    gram = Projector(sites, 40, "data-aware", 0)
    fit_basis(gram, fit)
    monkeypatch.setattr(P.data_aware, "GRAM_MAX_D", 100)
    sketch = Projector(sites, 40, "data-aware", 0)
    fit_basis(sketch, fit)
    assert sketch.basis.stage1[("w", "A")].shape == (1200, P.STAGE2_WIDTH // 2)
    assert P.data_aware.SideFit(1200, 128).gram is None  # really the sketch path
    ug, us = gram.basis.stage1[("w", "A")][:, :5], sketch.basis.stage1[("w", "A")][:, :5]
    torch.testing.assert_close(ug @ ug.T, us @ us.T, rtol=0, atol=1e-4)


def test_build_index_fits_stores_and_reuses_the_basis(tmp_path, random_lora_model):
    from gradian.config import config_from_dict
    from gradian.setup.tokenize import Tokenized
    from gradian.setup.batches import collate
    from gradian.store.build import build_index
    from gradian.store.build import make_projector
    from gradian.setup.model import lora_sites

    cfg = config_from_dict({"model": {"base": "x"}, "data": {"train": "t.jsonl"}, "output": str(tmp_path),
                            "grads": {"projection_dim": 96, "projection_kind": "data-aware", "batch_size": 4}})
    sites, _ = lora_sites(random_lora_model)
    g = torch.Generator().manual_seed(0)
    toks = []
    for n in range(10):
        ids = torch.randint(3, 97, (6 + n % 5,), generator=g).tolist()
        toks.append(Tokenized(ids, [False] * 3 + [True] * (len(ids) - 3), "t"))

    def build():
        proj = make_projector(cfg, sites)
        cap = GradientCapture(random_lora_model, sites, proj)
        key = "k"  # cache_key needs model directories; the key's projection part is proj.spec()
        idx, keys, info = build_index(cfg, cap, toks, key=key, pad_id=0, meta={"projection": proj.spec()})
        vecs = idx.rows(keys)
        meta = idx.meta
        idx.close()
        return proj, vecs, meta, info

    p1, v1, meta1, info1 = build()
    path = cfg.index_dir / "k" / BASIS_FILE
    sha = meta1["projection_basis"]["sha256"]
    assert path.exists() and info1.built == 10 and v1.shape == (10, 96)
    assert meta1["projection"]["basis_sha256"] == sha and sum(meta1["block_dims"]) == 96
    p2, v2, _, info2 = build()  # reuse: the basis is loaded, not refitted, and every row comes from the index
    assert info2.built == 0 and p2.basis_sha256 == sha and np.array_equal(v1, v2)
    # the stored vectors are the projection of the exact gradients with the stored basis
    ids, attn, sup = collate(toks[:4], 0)
    per_site, _ = GradientCapture(random_lora_model, sites).site_grads(ids, attn, sup)
    want = torch.cat([p2.project(i, a, b) for i, (a, b) in enumerate(per_site)], 1).numpy()
    np.testing.assert_allclose(v2[:4], want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max()))
    # a lost basis means a refit and an index whose old rows are not reused with the new basis
    path.unlink()
    p3, v3, meta3, info3 = build()
    assert meta3["projection_basis"]["sha256"] == sha  # the fit is deterministic: same sample, same bits
    assert np.array_equal(v1, v3)
    assert json.loads((cfg.index_dir / "k" / "manifest.json").read_text())["key"].endswith(sha[:16])


def test_projection_fit_rows_setting_reaches_the_fit(random_lora_model):
    """grads.projection_fit_rows sets how many rows the data-aware basis is fitted on and is part of the cache key."""
    from gradian.config import config_from_dict
    from gradian.store.build import make_projector
    from gradian.setup.model import lora_sites

    sites, _ = lora_sites(random_lora_model)
    mk = lambda n: make_projector(config_from_dict({  # noqa: E731
        "model": {"base": "x"}, "data": {"train": "t.jsonl"},
        "grads": {"projection_dim": 96, "projection_fit_rows": n}}), sites)
    assert mk(7).fit_rows == 7 and mk(512).fit_rows == 512
    assert mk(7).spec() != mk(512).spec()  # a basis fitted on other rows never reuses an index
    with pytest.raises(Exception, match="projection_fit_rows"):
        mk(0)
