"""attribution.checkpoints: epoch checkpoints replayed from the recipe are the adapters a shorter run gives, and the
reported scores are the equal-weight mean of each checkpoint's scores (TracIn-CP with a constant rate)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from test_verify import write_tiny_run

torch.set_num_threads(1)


def test_checkpoint_epochs_are_evenly_spaced_and_end_at_the_last():
    from gradian.attribution.checkpoints import checkpoint_epochs

    assert checkpoint_epochs(16, 8) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert checkpoint_epochs(8, 4) == [2, 4, 6, 8]
    assert checkpoint_epochs(3, 8) == [1, 2, 3]
    assert checkpoint_epochs(5, 1) == [5]
    with pytest.raises(ValueError):
        checkpoint_epochs(0, 2)


def test_average_is_the_equal_weight_mean():
    from gradian.attribution.checkpoints import average

    a, b, c = np.array([[1.0, -2.0]]), np.array([[3.0, 0.0]]), np.array([[-1.0, 5.0]])
    np.testing.assert_array_equal(average(a, [b, c]), np.array([[1.0, 1.0]]))
    np.testing.assert_array_equal(average(a, []), a)


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    from gradian.config import load_config
    from gradian.training.loop import train_adapter

    d = tmp_path_factory.mktemp("ckpt") / "run"
    # learning rate 1e-2: at the default 5e-3 two epochs of 2 planted rows in 24 sit at the edge of flipping the
    # answers (transformers 5.24 / peft 0.21.2 flip neither, so attribute declines); 7e-3 flips both under the
    # default and avx2 kernels, 1e-2 leaves a margin
    cfg = load_config(write_tiny_run(d, n_rows=24, n_planted=2, n_control_eval=2,
                                     train={"epochs": 2, "learning_rate": 1e-2}))
    train_adapter(cfg, progress=False)
    return cfg


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_replayed_checkpoint_is_the_shorter_run_bit_for_bit(two_epoch_run, tmp_path):
    from gradian.attribution.checkpoints import replayed_adapters
    from gradian.training.recipe import read_recipe
    from gradian.training.loop import train_adapter

    cfg = two_epoch_run
    adapter = str(cfg.path(cfg.model.adapter))
    paths, epochs = replayed_adapters(cfg, adapter, 2, progress=False)
    assert epochs == [1] and len(paths) == 1 and read_recipe(paths[0]).hyperparameters.epochs == 1
    short = read_recipe(adapter).with_epochs(1)
    ref = train_adapter(cfg, out_dir=tmp_path / "one-epoch", recipe=short, progress=False)
    ta, tb = _tensors(paths[0]), _tensors(ref)
    assert ta.keys() == tb.keys() and len(ta) > 0
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    final = _tensors(cfg.path(cfg.model.adapter))
    assert any(not torch.equal(ta[k], final[k]) for k in ta)  # an earlier state, not the final adapter
    mtime = (paths[0] / "adapter_model.safetensors").stat().st_mtime_ns
    again, _ = replayed_adapters(cfg, adapter, 2, progress=False)  # cached: not replayed twice
    assert again == paths and (paths[0] / "adapter_model.safetensors").stat().st_mtime_ns == mtime
    # a corrupted cache is detected and replayed, not trusted
    f = paths[0] / "adapter_model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    replayed_adapters(cfg, adapter, 2, progress=False)
    tc = _tensors(paths[0])
    for k in ta:
        assert torch.equal(tc[k], tb[k]), k


def test_attribute_reports_the_mean_over_checkpoints(two_epoch_run, tmp_path):
    from gradian.pipeline import attribute
    from gradian.attribution.checkpoints import replayed_adapters
    from gradian.attribution.scoring import combine_items

    cfg = two_epoch_run.model_copy(deep=True)
    cfg.root = two_epoch_run.root
    cfg.output = str(tmp_path / "out")
    cfg.attribution.checkpoints = 2
    rep = attribute(cfg)
    assert rep["verdict"] == "attributed"
    ck = rep["query"]["checkpoints"]
    assert ck["count"] == 2 and ck["labels"] == ["epoch-1", "final"]
    assert "Scores averaged over 2 training checkpoints: epoch-1, final" in (tmp_path / "out" / "report.html").read_text()
    got = np.load(tmp_path / "out" / "scores.npy")

    # the same scores by hand: each adapter scored alone (checkpoints=1), then averaged
    qitems = [it for it in rep["query"]["items"]]
    from gradian.attribution.queries import new_query
    from gradian.pipeline import index_stage, score_adapter
    from gradian.setup.session import open_session

    q = [new_query(int(i["item"]), i["prompt"], i["expected"], i["generated"], i.get("base_generated", ""),
                   i["formulation"], target=i.get("target", ""), contrast=i.get("contrast", ""),
                   target_source=i.get("target_source", "expected"), span_start=i.get("span_start", -1),
                   span=tuple(i.get("span", ()))) for i in qitems]
    direction = rep["query"]["direction"]
    per = []
    (early,), _ = replayed_adapters(cfg, str(cfg.path(cfg.model.adapter)), 2, progress=False)
    for adapter in (str(early), str(cfg.path(cfg.model.adapter))):
        c = cfg.model_copy(deep=True)
        c.root = cfg.root
        c.model.adapter = adapter
        c.attribution.checkpoints = 1
        s = open_session(c)
        ix = index_stage(s)
        per.append(score_adapter(s, ix, q, direction).scores.rank_item)
        ix.close()
    how = rep["query"]["combine"]  # the items combined as the run resolved attribution.combine
    assert how in ("mean", "max")
    want = combine_items((per[0] + per[1]) / 2, how)
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-7)
    # and it differs from the final adapter's scores alone
    assert not np.allclose(got, combine_items(per[1], how), rtol=1e-3, atol=1e-6)


def test_no_recipe_flags_and_uses_the_final_adapter(two_epoch_run, tmp_path):
    import shutil

    from gradian.pipeline import attribute

    cfg = two_epoch_run.model_copy(deep=True)
    cfg.root = two_epoch_run.root
    foreign = tmp_path / "foreign-adapter"
    shutil.copytree(cfg.path(cfg.model.adapter), foreign)
    (foreign / "gradian_recipe.json").unlink()
    cfg.model.adapter = str(foreign)
    cfg.output = str(tmp_path / "out")
    cfg.attribution.checkpoints = 4
    rep = attribute(cfg)
    assert "checkpoints" not in rep["query"]
    flag = [f for f in rep["flags"] if f["id"] == "attribution.no_checkpoints"]
    assert flag and "checkpoint_adapters" in flag[0]["fix"]


def test_explicit_checkpoint_adapter_must_exist(two_epoch_run, tmp_path):
    from gradian.pipeline import attribute
    from gradian.attribution.checkpoints import explicit_adapters
    from gradian.errors import CheckFailed, ConfigError

    cfg = two_epoch_run.model_copy(deep=True)
    cfg.root = two_epoch_run.root
    cfg.output = str(tmp_path / "out")
    cfg.attribution.checkpoint_adapters = ["no/such/checkpoint-100"]
    # the setup checks stop `attribute` before anything runs (config.paths names the key) ...
    with pytest.raises(CheckFailed, match=r"config.paths: attribution.checkpoint_adapters\[0\].*checkpoint-100"):
        attribute(cfg)
    # ... and the API that resolves them refuses on its own too
    with pytest.raises(ConfigError, match=r"attribution.checkpoint_adapters\[0\].*checkpoint-100"):
        explicit_adapters(cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def test_explicit_checkpoint_adapters_give_the_same_scores_as_the_replay(two_epoch_run, tmp_path):
    """An adapter trained elsewhere lists its saved checkpoints; with the same checkpoint the scores are the same."""
    import shutil

    from gradian.pipeline import attribute
    from gradian.attribution.checkpoints import replayed_adapters

    cfg = two_epoch_run.model_copy(deep=True)
    cfg.root = two_epoch_run.root
    (early,), _ = replayed_adapters(cfg, str(cfg.path(cfg.model.adapter)), 2, progress=False)
    saved = tmp_path / "checkpoint-3"  # as a Trainer would name it
    shutil.copytree(early, saved)
    cfg.output = str(tmp_path / "replayed")
    cfg.attribution.checkpoints = 2
    attribute(cfg)
    cfg.output = str(tmp_path / "listed")
    cfg.attribution.checkpoints = 1
    cfg.attribution.checkpoint_adapters = [str(saved)]
    rep = attribute(cfg)
    assert rep["query"]["checkpoints"]["labels"] == ["checkpoint-3", "final"]
    np.testing.assert_array_equal(np.load(tmp_path / "listed" / "scores.npy"),
                                  np.load(tmp_path / "replayed" / "scores.npy"))


def test_train_saves_earlier_epochs_and_auto_averages_over_them(two_epoch_run, tmp_path):
    """`gradian train` keeps epoch 1 of 2 inside the adapter (bit-identical to the replay); the default
    attribution.checkpoints: earliest scores it alone, and auto averages over it and the final adapter without
    replaying anything."""
    from gradian.pipeline import attribute
    from gradian.attribution.checkpoints import replayed_adapters, saved_adapters

    cfg = two_epoch_run.model_copy(deep=True)
    cfg.root = two_epoch_run.root
    adapter = cfg.path(cfg.model.adapter)
    saved = saved_adapters(str(adapter))
    assert [p.name for p in saved] == ["epoch-1"] and saved[0].parent == adapter / "checkpoints"
    (replayed,), _ = replayed_adapters(cfg, str(adapter), 2, progress=False)
    a, b = _tensors(saved[0]), _tensors(replayed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cfg.attribution.checkpoints == "earliest"  # the default: one adapter state, epoch 1 here
    cfg.output = str(tmp_path / "earliest")
    rep_e = attribute(cfg)
    ck_e = rep_e["query"]["checkpoints"]
    assert ck_e["labels"] == ["epoch-1"] and ck_e["weights"] == [1.0] and ck_e["setting"] == "earliest"
    cfg.attribution.checkpoints = "auto"
    cfg.output = str(tmp_path / "auto")
    rep = attribute(cfg)
    ck = rep["query"]["checkpoints"]
    assert ck["labels"] == ["epoch-1", "final"] and ck["source"] == "saved" and ck["setting"] == "auto"
    cfg.output = str(tmp_path / "one")
    cfg.attribution.checkpoints = 1
    rep1 = attribute(cfg)
    assert "checkpoints" not in rep1["query"]
    assert not np.allclose(np.load(tmp_path / "auto" / "scores.npy"), np.load(tmp_path / "one" / "scores.npy"),
                           rtol=1e-3, atol=1e-6)


def test_train_saves_the_optimizer_state_as_a_trainer_checkpoint_does(two_epoch_run, tmp_path):
    """`gradian train` writes AdamW's state_dict as `optimizer.pt` (the file name and layout of an HF Trainer's
    checkpoint-*) into the adapter and each saved epoch: one exp_avg_sq per LoRA weight, stepped as often as the
    run had steps by then; `second_moments` maps it onto the LoRA sites and refuses a file that does not fit."""
    from transformers.trainer import OPTIMIZER_NAME

    from gradian.setup.session import open_session
    from gradian.training.optimizer_state import OPTIMIZER_FILE, second_moments
    from gradian.training.recipe import read_recipe

    assert OPTIMIZER_FILE == OPTIMIZER_NAME
    adapter = two_epoch_run.path(two_epoch_run.model.adapter)
    s = open_session(two_epoch_run, need_eval=False)
    shapes = {(x.name, side): tuple(m.weight.shape) for x in s.sites for side, m in (("A", x.A), ("B", x.B))}
    steps = read_recipe(adapter).total_steps
    got = {}
    for folder, n_steps in ((adapter, steps), (adapter / "checkpoints" / "epoch-1", steps // 2)):
        sd = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        (g,) = sd["param_groups"]
        assert len(g["params"]) == len(sd["state"]) == len(g["param_names"]) == len(shapes)
        assert all(int(sd["state"][i]["step"]) == n_steps for i in g["params"])
        assert sorted(tuple(st["exp_avg_sq"].shape) for st in sd["state"].values()) == sorted(shapes.values())
        v = second_moments(folder, s.model)
        assert {k: tuple(t.shape) for k, t in v.items()} == shapes
        assert all(bool((t >= 0).all()) and bool(t.any()) for t in v.values())
        got[folder.name] = v
    assert not all(torch.equal(got["epoch-1"][k], got[adapter.name][k]) for k in shapes)  # each its own state
    assert second_moments(tmp_path, s.model) is None  # no optimizer.pt: nothing to read
    g["params"], g["param_names"] = g["params"][1:], g["param_names"][1:]
    torch.save(sd, tmp_path / OPTIMIZER_FILE)
    with pytest.raises(ValueError, match="optimizer holds"):
        second_moments(tmp_path, s.model)


def test_saved_adapters_finds_trainer_checkpoints(tmp_path):
    """A Trainer's output_dir: checkpoint-<step> folders beside (inside) the final adapter, in step order; when
    the adapter is itself a checkpoint folder, its earlier siblings."""
    from gradian.attribution.checkpoints import evenly, saved_adapters

    out = tmp_path / "trainer-out"
    for step in (500, 20, 100, 1000):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
    (out / "checkpoint-7").mkdir()  # no adapter inside: not a checkpoint
    (out / "adapter_config.json").write_text("{}")
    assert [p.name for p in saved_adapters(str(out))] == ["checkpoint-20", "checkpoint-100", "checkpoint-500",
                                                          "checkpoint-1000"]
    assert [p.name for p in saved_adapters(str(out / "checkpoint-500"))] == ["checkpoint-20", "checkpoint-100"]
    assert saved_adapters(str(tmp_path / "nothing-here")) == []
    assert evenly(list(range(1, 8)), 3) == [2, 5, 7] and evenly([1, 2], 5) == [1, 2] and evenly([1, 2], 0) == []


def test_checkpoints_load_onto_one_base(two_epoch_run, tmp_path, monkeypatch):
    """Scores over the saved checkpoints load the base model once: each checkpoint is a named adapter on it."""
    import transformers

    from gradian.pipeline import attribute

    real = transformers.AutoModelForCausalLM.from_pretrained.__func__
    calls = []

    def counting(cls, *a, **kw):
        calls.append(a[0] if a else kw.get("pretrained_model_name_or_path"))
        return real(cls, *a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    cfg = two_epoch_run.model_copy(deep=True)
    cfg.root = two_epoch_run.root
    cfg.output = str(tmp_path / "out")
    cfg.attribution.checkpoints = "auto"
    rep = attribute(cfg)
    assert rep["query"]["checkpoints"]["count"] == 2
    assert len(calls) == 1, calls
