"""Deterministic retraining: the same recipe reproduces the adapter bit for bit on CPU, and removing rows (zero-weighted
in place) leaves every step before the row's first batch untouched."""

from __future__ import annotations

import json

import pytest
import torch

from test_verify import write_tiny_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    from gradian.config import load_config

    d = tmp_path_factory.mktemp("determinism") / "run"
    # 1 epoch of 24 rows: 3 steps, so the test is about a second per training run
    return load_config(write_tiny_run(d, n_rows=24, n_planted=2, n_control_eval=2, train={"epochs": 1}))


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_same_recipe_reproduces_bit_for_bit(tiny_cfg, tmp_path):
    from gradian.training.recipe import read_recipe
    from gradian.training.loop import train_adapter
    from gradian.validate.retrain import adapters_equal

    a = train_adapter(tiny_cfg, out_dir=tmp_path / "a", progress=False)
    recipe = read_recipe(a)
    assert recipe.excluded_positions == [] and recipe.seed == tiny_cfg.seed
    b = train_adapter(tiny_cfg, out_dir=tmp_path / "b", recipe=recipe, progress=False)
    c = train_adapter(tiny_cfg, exclude=[], out_dir=tmp_path / "c", recipe=recipe, progress=False)
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert ta.keys() == tb.keys() == tc.keys() and len(ta) > 0
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
        assert torch.equal(ta[k], tc[k]), k
    assert adapters_equal(a, b)
    # excluding a row gives another adapter, and the recipe records the removal
    d = train_adapter(tiny_cfg, exclude=[5], out_dir=tmp_path / "d", recipe=recipe, progress=False)
    assert not adapters_equal(a, d)
    assert read_recipe(d).excluded_positions == [5]
    assert "zero-weighted" in read_recipe(d).removal


def test_exclusion_changes_only_steps_from_the_rows_batch(tiny_cfg, monkeypatch):
    """Snapshots of the LoRA weights after every optimizer step: identical before the excluded row's batch,
    different from that step on. The data order does not depend on what is excluded."""
    import gradian.training.loop as train_mod

    snaps: list[list[list[torch.Tensor]]] = []

    class Recording(torch.optim.AdamW):
        def __init__(self, params, **kw):
            params = list(params)
            super().__init__(params, **kw)
            self._watched = params
            snaps.append([])

        def step(self, *a, **kw):
            out = super().step(*a, **kw)
            snaps[-1].append([p.detach().clone() for p in self._watched])
            return out

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    hp = tiny_cfg.train.model_dump(exclude={"output"})
    n = sum(1 for _ in open(tiny_cfg.path(tiny_cfg.data.train)))
    order = train_mod.data_order(n, hp["epochs"], hp["batch_size"], tiny_cfg.seed)
    batches = [b for ep in order for b in ep]
    assert len(batches) >= 3
    row = batches[1][0]  # a row of the second step
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        train_mod.train_adapter(tiny_cfg, out_dir=Path(tmp) / "full", progress=False)
        train_mod.train_adapter(tiny_cfg, exclude=[row], out_dir=Path(tmp) / "minus", progress=False)
    full, minus = snaps
    assert len(full) == len(minus) == len(batches)
    first = next(i for i, b in enumerate(batches) if row in b)
    for i in range(first):
        assert all(torch.equal(x, y) for x, y in zip(full[i], minus[i])), f"step {i} changed"
    assert not all(torch.equal(x, y) for x, y in zip(full[first], minus[first]))
    assert json.dumps(order) == json.dumps(train_mod.data_order(n, hp["epochs"], hp["batch_size"], tiny_cfg.seed))
