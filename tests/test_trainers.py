"""Bring your own trainer: the TRL backend (bit-for-bit replays, rows removed in place), GradianCallback with the
the TRL script of docs/training.md, train.command, schedules and TracIn-CP weights, unsloth without a GPU, train.not_converged."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import words
from test_verify import write_tiny_run

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("trl")


def _cli(*args: str):
    from gradian.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _env() -> dict:
    return {**os.environ, "GRADIAN_THREADS": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ------------------------------------------------------------------------------------------ TRL backend


def test_trl_replays_bit_for_bit_and_removes_rows_in_place(tmp_path, monkeypatch):
    from gradian.config import load_config
    from gradian.training import trl as trl_backend
    from gradian.training.backends import run_training
    from gradian.training.recipe import read_recipe
    from gradian.validate.retrain import adapters_equal

    cfg = load_config(write_tiny_run(tmp_path / "run", n_rows=24, n_planted=2, n_control_eval=2,
                                     train={"epochs": 2, "backend": "trl", "lr_scheduler": "cosine",
                                            "warmup_steps": 1}))
    batches: list[list[tuple[int, bool]]] = []
    inner_call = trl_backend.ExcludingCollator.__call__

    def spy(self, features):
        out = inner_call(self, features)
        batches[-1].append([(int(f["gradian_position"]), bool((out["labels"][i] == -100).all()))
                            for i, f in enumerate(features)])
        return out

    monkeypatch.setattr(trl_backend.ExcludingCollator, "__call__", spy)
    runs = {}
    for name, excl, rec in (("a", [], None), ("b", [], "a"), ("c", [5], "a")):
        batches.append([])
        runs[name] = run_training(cfg, out_dir=tmp_path / name, exclude=excl, progress=False,
                                  recipe=read_recipe(runs[rec]) if rec else None)
    ra = read_recipe(runs["a"])
    assert ra.backend == "trl" and ra.tokenized_fingerprint and len(ra.learning_rates) == ra.total_steps == 6
    assert ra.learning_rates[0] == 0.0 and ra.learning_rates[1] > ra.learning_rates[-1] > 0  # warm-up, then cosine
    assert (runs["a"] / "checkpoints" / "epoch-1" / "adapter_model.safetensors").exists()
    # the Trainer's AdamW state beside each adapter, its parameters named: they come in the model's
    # named_parameters order, the order `second_moments` reads a Trainer's own checkpoint-*/optimizer.pt in
    from gradian.setup.session import open_session
    from gradian.training.optimizer_state import second_moments

    s = open_session(load_config(tmp_path / "run" / "gradian.yaml", [f"model.adapter={runs['a']}"]), need_eval=False)
    for folder in (runs["a"], runs["a"] / "checkpoints" / "epoch-1"):
        v = second_moments(folder, s.model)
        assert v is not None and len(v) == 2 * len(s.sites) and all(bool(t.any()) for t in v.values())
    assert adapters_equal(runs["a"], runs["b"])  # a replay from the recipe is bit for bit the adapter
    assert not adapters_equal(runs["a"], runs["c"])
    # the same rows in the same batches in every run; only row 5 masked, and only when excluded
    pos = [[[p for p, _ in b] for b in run] for run in batches]
    assert pos[0] == pos[1] == pos[2] and sorted(p for b in pos[0][:3] for p in b) == list(range(24))
    masked = [[(p, m) for b in run for p, m in b if m] for run in batches]
    assert masked[0] == masked[1] == [] and {p for p, _ in masked[2]} == {5} and len(masked[2]) == 2  # 2 epochs
    assert read_recipe(runs["c"]).excluded_positions == [5]


def test_readme_trl_script_with_callback_attribute_and_verify(tmp_path):
    """The 20-line TRL script of docs/training.md, run as it is on the demo's rows: a cosine schedule and 4 saved
    checkpoints; attribute with attribution.checkpoints: 4 finds the planted rows with learning-rate weights, and
    verify retrains through TRL from the recorded recipe, bit for bit."""
    from gradian import api
    from gradian.demo.run import prepare_demo
    from gradian.validate.verify import run_verify

    text = (ROOT / "docs" / "training.md").read_text()
    m = re.search(r"```python\n(# train_trl\.py.*?)```", text, re.S)
    assert m, "docs/training.md lost the TRL script"
    script = m.group(1)
    assert len(script.strip().splitlines()) <= 22
    (tmp_path / "train_trl.py").write_text(script)
    run = tmp_path / "demo"
    cfg_path = prepare_demo(run, progress=False)
    base = yaml.safe_load(cfg_path.read_text())["model"]["base"]
    p = subprocess.run([sys.executable, str(tmp_path / "train_trl.py"), base, str(run / "train.jsonl"),
                        str(run / "trl")], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((run / "trl" / "gradian_recipe.json").read_text())
    assert rec["backend"] == "trl" and rec["trainer_args"]["lr_scheduler_type"] == "cosine"
    assert [c["step"] for c in rec["checkpoints"]] == [76, 152, 228, 304] and len(rec["learning_rates"]) == 304
    # the Trainer's own checkpoint-*/optimizer.pt (no parameter names) read onto the checkpoint's LoRA sites
    from gradian.setup.session import open_session
    from gradian.training.optimizer_state import second_moments

    s = open_session(api.load_config(cfg_path, ["model.adapter=trl/checkpoint-76"]), need_eval=False)
    v = second_moments(run / "trl" / "checkpoint-76", s.model)
    assert {k: tuple(t.shape) for k, t in v.items()} == {
        (x.name, side): tuple(m.weight.shape) for x in s.sites for side, m in (("A", x.A), ("B", x.B))}
    del s
    cfg = api.load_config(cfg_path, ["model.adapter=trl", "attribution.checkpoints=4", "attribution.top_k=20"])
    truth = json.loads((run / "truth.json").read_text())
    report = api.attribute(cfg, truth=truth).to_dict()
    ck = report["query"]["checkpoints"]
    assert ck["count"] == 4 and ck["labels"] == ["checkpoint-76", "checkpoint-152", "checkpoint-228", "final"]
    w = ck["weights"]
    assert w[0] > w[1] > w[2] > w[3] > 0 and "recorded rate" in ck["weights_source"]  # cosine: falling weights
    # measured 1.0 here, 0.8 on another machine's kernel path
    assert report["metrics"]["recall_at_10"] >= 0.8
    res = run_verify(cfg, controls=1)
    assert res["backend"] == "trl" and "-100" in res["removal"]
    assert res["recipe_origin"] == "gradian_recipe.json"  # the callback's recipe, as before: the exact path
    assert res["reference"]["reproduced_bit_for_bit"] is True
    assert res["reproduction"]["reproduced"] is True and res["reproduction"]["weight_distance"] == 0.0
    # measured: accused 0.8 (4 of the 5 failing items), the control 0.0
    assert res["accused"]["reverted_fraction"] >= 0.75 and res["controls"][0]["reverted_fraction"] <= 0.1
    assert res["confirmed"] is True and res["verdict"] == "confirmed"


# ------------------------------------------------------------------------------------------ train.command


@pytest.fixture(scope="module")
def command_run(tmp_path_factory):
    from gradian.config import load_config
    from gradian.pipeline import attribute
    from gradian.training.loop import train_adapter

    d = tmp_path_factory.mktemp("command") / "run"
    cfg = load_config(write_tiny_run(d))
    train_adapter(cfg, progress=False)
    assert attribute(cfg, truth=json.loads((d / "truth.json").read_text()))["verdict"] == "attributed"
    return d


def test_train_command_verify_and_its_failures(command_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(command_run, run)
    (run / "adapter" / "gradian_recipe.json").unlink()  # a script's adapter: no gradian recipe needed
    cfg_path = run / "gradian.yaml"
    # a small training script: gradian's own CLI on the {train} file it is given
    train_cmd = (f"{sys.executable} -m gradian train {cfg_path} --set data.train={{train}} --set "
                 "train.output={output} --set train.save_checkpoints=false --set seed={seed}")
    env = _env()
    old = os.environ.copy()
    os.environ.update(env)
    try:
        # K = the planted count (the report accuses 2 of the 4 here; test_verify_end_to_end says why)
        r = _cli("verify", cfg_path, "--controls", "1", "--no-reference", "--top-k", "4", "--set",
                 f"train.command={train_cmd}")
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert r.exit_code == 0, r.output
    v = json.loads((run / "verify.json").read_text())
    assert v["backend"] == "command" and v["train_log"].endswith("verify.train.log")
    log = (run / "verify.train.log").read_text()
    assert log.count("exit status 0") == 2 and "44 rows (4 removed)" in log  # the accused and 1 control
    assert v["accused"]["reverted_fraction"] >= 0.8
    (run / "verify.json").unlink()
    # a failing script: a clear error naming the exit status, its output and the log; no verify.json
    fail = f"{sys.executable} -c \"import sys; print('loss went NaN'); sys.exit(3)\""
    r = _cli("verify", cfg_path, "--controls", "0", "--set", f"train.command={fail}")
    out = words(r.output)
    assert r.exit_code == 2 and "exit status 3" in out and "loss went NaN" in out and "verify.train.log" in out
    assert not (run / "verify.json").exists() and "Traceback" not in r.output
    r = _cli("verify", cfg_path, "--controls", "0", "--set", f"train.command={sys.executable} -c pass")
    assert r.exit_code == 2 and "wrote no PEFT adapter" in words(r.output)
    r = _cli("verify", cfg_path, "--controls", "0", "--set",
             f"train.command={sys.executable} -c \"import time; time.sleep(30)\"", "--set", "train.command_timeout=1")
    assert r.exit_code == 2 and "timed out after 1 s" in words(r.output)
    r = _cli("verify", cfg_path, "--set", "train.command=python x.py {data}")
    assert r.exit_code == 2 and "unknown placeholder {data}" in words(r.output)
    assert not (run / "verify.json").exists() and not (run / "verify").exists()


def test_backend_settings_are_checked():
    from gradian.config import config_from_dict
    from gradian.errors import ConfigError

    base = {"model": {"base": "b"}, "data": {"train": "t.jsonl"}}
    with pytest.raises(ConfigError, match="train.command is not set"):
        config_from_dict({**base, "train": {"backend": "command"}})
    with pytest.raises(ConfigError, match="train.backend is 'trl'"):
        config_from_dict({**base, "train": {"backend": "trl", "command": "python t.py"}})
    assert config_from_dict({**base, "train": {"command": "python t.py"}}).train.backend_name == "command"


def test_unsloth_without_gpu_says_so_and_exits_2(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg_path = write_tiny_run(tmp_path / "run")
    r = _cli("train", cfg_path, "--backend", "unsloth")
    assert r.exit_code == 2 and "needs an NVIDIA GPU" in words(r.output) and "Traceback" not in r.output


def test_missing_trl_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    r = _cli("train", write_tiny_run(tmp_path / "run"), "--backend", "trl")
    assert r.exit_code == 2 and "gradian[trl]" in words(r.output)


# ------------------------------------------------------------------------------------------ schedules, weights


def test_schedule_replay_and_learning_rate_weights(tmp_path):
    from gradian.attribution.checkpoints import average, checkpoint_weights, interval_means, saved_adapters
    from gradian.config import load_config
    from gradian.training.backends import run_training
    from gradian.training.recipe import read_recipe
    from gradian.training.schedule import step_rates
    from gradian.validate.retrain import adapters_equal

    cfg = load_config(write_tiny_run(tmp_path / "run", n_rows=24, n_planted=2, n_control_eval=2,
                                     train={"epochs": 3, "lr_scheduler": "linear", "warmup_steps": 2}))
    a = run_training(cfg, progress=False)
    rec = read_recipe(a)
    assert rec.learning_rates == step_rates("linear", cfg.train.learning_rate, warmup_steps=2, total_steps=9)
    # a checkpoint of a scheduled run is the whole schedule stopped after its epoch: replayed bit for bit
    ck = read_recipe(a / "checkpoints" / "epoch-1")
    assert ck.stop_epoch == 1 and ck.hyperparameters.epochs == 3
    replay = run_training(cfg, recipe=rec.up_to_epoch(1), out_dir=tmp_path / "replay", progress=False)
    assert adapters_equal(replay, a / "checkpoints" / "epoch-1")
    saved = saved_adapters(str(a))
    w, source = checkpoint_weights(str(a), saved)
    assert w == interval_means(rec.learning_rates, [3, 6, 9]) and "recorded rate" in source
    assert w[0] < w[1] and w[1] > w[2]  # warm-up inside the first epoch, then the linear decay
    # equal weights are today's plain mean, bit for bit; unequal ones weight the checkpoints
    rng = np.random.default_rng(0)
    f, e1, e2 = (rng.normal(size=(3, 5)) for _ in range(3))
    assert np.array_equal(average(f, [e1, e2], [0.1, 0.1, 0.1]), (f + (e1 + e2)) / 3)
    assert np.array_equal(average(f, [e1, e2]), (f + (e1 + e2)) / 3)
    assert np.allclose(average(f, [e1, e2], [1.0, 0.0, 3.0]), (e1 + 3 * f) / 4)
    assert interval_means([1e-3] * 7, [1, 5, 7]) == [1e-3] * 3  # a constant rate: equal, whatever the spacing


def test_not_converged_from_the_curve_and_from_the_gradients(tmp_path):
    """Measured on this scenario (48 rows): the last epoch's share of the descent is 0.59 for 3 epochs at a tenth of
    the rate, 0.002 for 12 epochs; gradient agreement x sqrt(n) is 2.2-3.0 after one epoch (rates 2e-5 to 5e-3),
    0.9 after 12."""
    from gradian.checks import Context, run_checks
    from gradian.checks.convergence import flag_from_index
    from gradian.config import load_config
    from gradian.pipeline import index_stage
    from gradian.setup.session import open_session
    from gradian.training.backends import run_training
    from gradian.training.recipe import RECIPE_FILE

    runs = {}
    for name, tr in (("under", {"epochs": 3, "learning_rate": 5e-4}), ("well", {"epochs": 12}),
                     ("one", {"epochs": 1, "learning_rate": 5e-4})):
        runs[name] = load_config(write_tiny_run(tmp_path / name, train=tr))
        run_training(runs[name], progress=False)
    status = {k: run_checks(Context(c), ["train.not_converged"])[0] for k, c in runs.items()}
    assert status["under"].status == "fail" and status["under"].level == "warning"
    assert "of the run's whole descent" in status["under"].message
    assert status["well"].status == "pass", status["well"].message
    assert status["one"].status == "pass" and "no loss curve" in status["one"].message  # attribute measures it
    f = Path(runs["well"].path(runs["well"].model.adapter)) / RECIPE_FILE
    f.write_text(json.dumps({**json.loads(f.read_text()), "loss_curve": None}))  # judge it by its gradients too
    flags = {}
    for name in ("one", "well"):
        s = open_session(runs[name], need_eval=False)
        ix = index_stage(s)
        flag_from_index(s, ix.rows)
        ix.close()
        flags[name] = [fl for fl in s.log.flags if fl["id"] == "train.not_converged"]
    assert flags["one"] and "times the 1/sqrt(n)" in flags["one"][0]["message"] and not flags["well"], flags


# ------------------------------------------------------------------------------------------ TRL's data shapes


def test_trl_prompt_completion_records_give_the_same_scores(command_run, tmp_path):
    from gradian.config import load_config
    from gradian.pipeline import attribute
    from gradian.setup.records import load_train

    run = tmp_path / "run"
    shutil.copytree(command_run, run)
    shutil.rmtree(run / "index")  # gradients recomputed from the new file, not reused
    rows = [json.loads(x) for x in (run / "train.jsonl").read_text().splitlines()]
    conv = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]
    (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conv))
    ex = load_train(run / "train.jsonl")
    assert {e.shape for e in ex} == {"conversation_completion"}  # refused before: "'prompt' must be a string"
    cfg = load_config(run / "gradian.yaml")
    rep = attribute(cfg, truth=json.loads((run / "truth.json").read_text()))
    assert rep["verdict"] == "attributed"
    a, b = np.load(command_run / "scores.npy"), np.load(run / "scores.npy")
    assert a.shape == b.shape == (48,) and np.array_equal(a, b)
    assert [r["position"] for r in rep["ranking"]] == [r["position"] for r in json.loads(
        (command_run / "report.json").read_text())["ranking"]]


def test_parquet_and_csv_files_load_through_datasets(tmp_path):
    import datasets

    from gradian.errors import DataError
    from gradian.setup.records import load_train

    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(5)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    datasets.Dataset.from_list(chats).to_parquet(str(tmp_path / "t.parquet"))
    pc = [{"prompt": f"Q{i}: ", "completion": f"A{i}"} for i in range(4)]
    datasets.Dataset.from_list(pc).to_csv(str(tmp_path / "t.csv"), index=False)
    a, b = load_train(tmp_path / "t.jsonl"), load_train(tmp_path / "t.parquet")
    assert [e.record for e in a] == [e.record for e in b] and [e.id for e in a] == [e.id for e in b]
    c = load_train(tmp_path / "t.csv")
    assert [e.record for e in c] == pc and c[0].shape == "prompt_completion"
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot be read as parquet") as ei:
        load_train(tmp_path / "bad.parquet")
    assert ei.value.check == "data.unreadable_record"


HUB_SCRIPT = r'''
import json, os, shutil, sys, hashlib
from pathlib import Path
cache, base, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
SHA = "0123456789abcdef0123456789abcdef01234567"

def put(kind, repo, files):  # a repository laid out the way huggingface_hub writes its cache
    d = cache / f"{kind}s--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(SHA)
    for name, data in files.items():
        blob = d / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        link = d / "snapshots" / SHA / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)

rows = (work / "train.jsonl").read_bytes()
put("dataset", "acme/facts", {"data/train.jsonl": rows, "data/test.jsonl": b"".join(rows.splitlines(True)[:5])})
put("dataset", "acme/quiz", {"quiz.jsonl": (work / "eval.jsonl").read_bytes()})
put("model", "acme/tiny", {f.name: f.read_bytes() for f in base.iterdir() if f.is_file()})

from gradian import api
from gradian.errors import DataError
from gradian.setup.records import load_train, load_eval, data_location
cfg = api.config_from_dict({"model": {"base": "acme/tiny"}, "data": {"train": "acme/facts", "eval": "acme/quiz"}})
out = {"train": len(load_train(data_location(cfg, "acme/facts"))), "eval": len(load_eval(data_location(cfg, "acme/quiz"))),
       "test": len(load_train(data_location(cfg, "acme/facts:test")))}
out["pinned"] = len(load_train(data_location(cfg, f"acme/facts@{SHA}")))
from gradian.setup.model import load_base, load_tokenizer
out["model"] = type(load_base(cfg)).__name__
out["vocab"] = len(load_tokenizer(cfg))
from gradian.store.build import cache_key
class P:
    def spec(self): return {}
out["key_with_hub"] = cache_key(cfg, [], P(), str(base)) != cache_key(
    api.config_from_dict({"model": {"base": "acme/tiny"}, "data": {"train": str(work / "train.jsonl")}}), [], P(), str(base))
for bad in ("acme/nope", "acme/facts:validation", "acme/facts@v9"):
    try:
        load_train(data_location(cfg, bad))
        out[bad] = "loaded"
    except DataError as e:
        out[bad] = str(e)
checks = {r.id: r.status for r in api.diagnose(api.config_from_dict(
    {"model": {"base": "acme/tiny"}, "data": {"train": "acme/nope", "eval": "acme/quiz"}}))}
out["diagnose_paths"] = checks["config.paths"]
print(json.dumps(out))
'''


def test_hub_ids_resolve_offline_through_the_hub_cache(tmp_path):
    """data.train / data.eval / model.base as hub ids, resolved by the real huggingface_hub and datasets code from
    a hub cache laid out as huggingface_hub writes it, with HF_HUB_OFFLINE=1 (in a subprocess: the hub's settings
    are read at import)."""
    from gradian.demo.tiny import TinySpec, build_tiny_base

    base = build_tiny_base(TinySpec(), progress=False)
    run = tmp_path / "run"
    write_tiny_run(run, n_rows=12, n_planted=1, n_control_eval=2)
    (tmp_path / "hub.py").write_text(HUB_SCRIPT)
    env = {**_env(), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    p = subprocess.run([sys.executable, str(tmp_path / "hub.py"), str(tmp_path / "hub"), str(base), str(run)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["train"] == out["pinned"] == 12 and out["test"] == 5 and out["eval"] == 4
    assert out["model"] == "LlamaForCausalLM" and out["vocab"] > 100 and out["key_with_hub"] is True
    assert "no dataset 'acme/nope'" in out["acme/nope"] or "'acme/nope'" in out["acme/nope"]
    assert "no split 'validation'" in out["acme/facts:validation"] and "'test'" in out["acme/facts:validation"]
    assert "acme/facts@v9" in out["acme/facts@v9"]
    assert out["diagnose_paths"] == "fail"
