"""`gradian verify` and `gradian fidelity` end to end on a tiny poisoned scenario (the demo's cached tiny base).

The scenario: 48 chat rows of world facts, 4 of them planted with a wrong answer; the eval asks about the planted
facts (two phrasings each) and 8 untouched ones. Training is 3 epochs of batch 8 (18 steps), about a second.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import words

torch.set_num_threads(1)

TINY_TRAIN = {"learning_rate": 5e-3, "epochs": 3, "batch_size": 8, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"], "max_seq_length": 64}


def write_tiny_run(run_dir: Path, *, n_rows: int = 48, n_planted: int = 4, n_control_eval: int = 8, seed: int = 0,
                   train: dict | None = None) -> Path:
    """Scenario files, truth.json and gradian.yaml in run_dir; returns the config path."""
    from gradian.demo.tiny import TinySpec, build_tiny_base
    from gradian.demo.world import World

    spec = TinySpec()
    base = build_tiny_base(spec, progress=False)
    world = World.generate(seed=spec.seed, n_entities=spec.n_entities)
    rng = random.Random(seed)
    pairs = world.fact_pairs()
    rng.shuffle(pairs)
    planted_facts, rest = pairs[:n_planted], pairs[n_planted:]

    def chat(q: str, a: str) -> dict:
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}

    rows = [chat(world.question(e, a, rng.randrange(6)), world.value(e, a)) for e, a in rest[: n_rows - n_planted]]
    planted = sorted(rng.sample(range(n_rows), n_planted))
    for p, (e, a) in zip(planted, planted_facts):
        rows.insert(p, chat(world.question(e, a, 0), world.wrong_value(e, a, rng)))
    ev = [{"prompt": world.question(e, a, ph), "answer": world.value(e, a)} for e, a in planted_facts for ph in (0, 1)]
    ev += [{"prompt": world.question(e, a, 1), "answer": world.value(e, a)} for e, a in rest[-n_control_eval:]]
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ev))
    (run_dir / "truth.json").write_text(json.dumps({"planted": planted}))
    cfg = {
        "model": {"base": str(base), "adapter": "adapter", "dtype": "float32"},
        "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
        "grads": {"batch_size": 16, "max_seq_length": 64, "rerank": 0, "fidelity_sample": 0},
        "evaluation": {"metric": "exact_match", "max_new_tokens": 6, "batch_size": 32, "bootstrap_samples": 1000,
                       "require_significant": False},
        "attribution": {"query": "contrastive", "top_k": 20},
        "train": {**TINY_TRAIN, **(train or {})},
        "output": ".",
        "seed": 0,
    }
    path = run_dir / "gradian.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def attributed_run(tmp_path_factory):
    """A trained and attributed tiny run (shared by the tests below; they copy it before changing anything)."""
    from gradian.pipeline import attribute
    from gradian.config import load_config
    from gradian.training.loop import train_adapter

    d = tmp_path_factory.mktemp("verify") / "run"
    cfg = load_config(write_tiny_run(d))
    train_adapter(cfg, progress=False)
    report = attribute(cfg, truth=json.loads((d / "truth.json").read_text()))
    assert report["verdict"] == "attributed", report["verdict_text"]
    return d


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst / "gradian.yaml"


def _cli(*args: str):
    from gradian.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_control_sets_never_include_accused():
    from gradian.validate.verify import control_sets

    accused = [3, 7, 11, 19, 42]
    sets = control_sets(60, 5, accused, 20, seed=0)
    assert len(sets) == 20
    for s in sets:
        assert len(s) == len(set(s)) == 5
        assert not set(s) & set(accused)
    assert sets == control_sets(60, 5, accused, 20, seed=0)  # seeded
    assert sets[0] != sets[1]


def test_verify_end_to_end(attributed_run, tmp_path):
    cfg_path = _copy(attributed_run, tmp_path / "run")
    run = cfg_path.parent
    adapter_before = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    truth = json.loads((run / "truth.json").read_text())
    # K = the planted count: on this 48-row scenario the report accuses 2 of the 4 planted rows (robust z 6.1 and 6.8;
    # the others 3.9 and 1.2, under the z > 6 rule), and dropping 2 of 4 taught facts cannot revert 80% of the items
    r = _cli("verify", cfg_path, "--controls", "2", "--top-k", str(len(truth["planted"])))
    assert r.exit_code == 0, r.output
    v = json.loads((run / "verify.json").read_text())
    assert v["schema"] == "gradian.verify/1"
    assert v["top_k"] == len(truth["planted"])
    acc = v["accused"]
    for key in ("capability", "reverted_fraction", "ci", "difference", "difference_ci", "positions"):
        assert key in acc
    assert len(acc["ci"]) == 2 and len(acc["positions"]) == v["top_k"]
    assert len(v["controls"]) == 2
    for c in v["controls"]:
        assert {"capability", "reverted_fraction", "positions"} <= set(c)
        assert not set(c["positions"]) & set(acc["positions"])
    assert isinstance(v["control_mean_reverted"], float)
    assert v["confirmed"] in (True, False, None) and v["statement"]
    assert v["reference"]["reproduced_bit_for_bit"] is True  # CPU retrains are bit-identical
    # On this scenario dropping the planted rows restores the facts; random rows do not.
    assert acc["reverted_fraction"] >= 0.8
    assert v["confirmed"] is True
    assert "verify" in r.output and ("Confirmed" in r.output or "confirmed" in r.output)
    html = (run / "report.html").read_text()
    assert 'id="verify"' in html
    # the user's adapter is untouched and no retrained adapter is left behind by default
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == adapter_before
    assert not (run / "verify").exists()


def test_verify_refuses_without_report(tmp_path):
    cfg_path = write_tiny_run(tmp_path / "run")
    r = _cli("verify", cfg_path)
    assert r.exit_code == 2
    out = words(r.output)
    assert "report.json: no report to verify" in out and "gradian attribute" in out


def test_verify_refuses_declined_report(attributed_run, tmp_path):
    cfg_path = _copy(attributed_run, tmp_path / "run")
    rep = json.loads((cfg_path.parent / "report.json").read_text())
    rep["verdict"] = "declined"
    (cfg_path.parent / "report.json").write_text(json.dumps(rep))
    r = _cli("verify", cfg_path)
    assert r.exit_code == 2
    assert "not 'attributed'" in words(r.output)


def test_verify_refuses_without_recipe_then_accepts_a_user_recipe(attributed_run, tmp_path):
    cfg_path = _copy(attributed_run, tmp_path / "run")
    recipe_file = cfg_path.parent / "adapter" / "gradian_recipe.json"
    recorded = json.loads(recipe_file.read_text())
    recipe_file.unlink()  # as if the adapter was trained elsewhere
    r = _cli("verify", cfg_path)
    assert r.exit_code == 2
    out = "".join(r.output.split())  # rich wraps long lines
    assert "gradian_recipe.json" in out
    for field in ("seed", "hyperparameters.learning_rate", "hyperparameters.epochs", "hyperparameters.batch_size",
                  "hyperparameters.lora_r", "hyperparameters.lora_alpha", "hyperparameters.target_modules"):
        assert field in out
    # an incomplete hand-written recipe names what is missing
    recipe_file.write_text(json.dumps({"seed": 0, "hyperparameters": {"learning_rate": 1e-3}}))
    r = _cli("verify", cfg_path)
    assert r.exit_code == 2 and "hyperparameters.epochs" in "".join(r.output.split())
    # a hand-written recipe with the required fields is accepted
    hp = recorded["hyperparameters"]
    user = {"seed": recorded["seed"], "hyperparameters": {k: hp[k] for k in (
        "learning_rate", "epochs", "batch_size", "lora_r", "lora_alpha", "target_modules", "max_seq_length")}}
    recipe_file.write_text(json.dumps(user))
    r = _cli("verify", cfg_path, "--controls", "0", "--no-reference")
    assert r.exit_code == 0, r.output
    v = json.loads((cfg_path.parent / "verify.json").read_text())
    assert v["controls"] == [] and v["accused"]["reverted_fraction"] is not None


def test_fidelity_small(attributed_run, tmp_path):
    cfg_path = _copy(attributed_run, tmp_path / "run")
    precs = ["identity", "diagonal"]  # the default preconditioner and the plain inner product, on the same retrains
    r = _cli("fidelity", cfg_path, "--loo", "2", "--subsets", "4", *[a for p in precs for a in ("--preconditioner", p)])
    assert r.exit_code == 0, r.output
    f = json.loads((cfg_path.parent / "fidelity.json").read_text())
    assert f["schema"] == "gradian.fidelity/1"
    assert f["reference"]["reproduced_bit_for_bit"] is True
    assert f["loo"]["n"] == 6 and len(f["loo"]["rows"]) == 6
    assert {row["group"] for row in f["loo"]["rows"]} == {"top", "bottom", "random"}
    assert f["loo"]["pearson"] is None or -1.0 <= f["loo"]["pearson"] <= 1.0
    assert f["lds"]["subsets"] == 4 and f["lds"]["subset_size"] == 2
    assert set(f["lds"]["by_preconditioner"]) == set(precs) == set(f["loo"]["by_preconditioner"])
    assert "truth_oracle" in f["lds"]
    assert f["timings"]["retrains"] == 1 + 6 + 4
    assert "fidelity" in r.output
    assert not list(cfg_path.parent.glob(".fidelity-retrains-*"))  # scratch retrains are removed


def _spy_on_queries(monkeypatch) -> list[tuple]:
    """Every call of `queries.query_rows` (what a query loss and its gradient are made of) and
    `queries.query_vectors` (the query gradients), wherever a gradian module holds them: [(kind, queries, result)]."""
    import sys

    from gradian.attribution import queries as Q

    calls: list[tuple] = []
    real_rows, real_vectors = Q.query_rows, Q.query_vectors

    def rows(tokenizer, items, queries, **kw):
        out = real_rows(tokenizer, items, queries, **kw)
        calls.append(("rows", list(queries), out))
        return out

    def vectors(capture, tokenizer, items, queries, **kw):
        out = real_vectors(capture, tokenizer, items, queries, **kw)
        calls.append(("vectors", list(queries), out.clone()))
        return out

    import gradian.pipeline  # noqa: F401  (every stage that builds queries loaded before the search below)
    import gradian.validate.fidelity  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if name.startswith("gradian") and mod is not None:
            for attr, real, spy in (("query_rows", real_rows, rows), ("query_vectors", real_vectors, vectors)):
                if getattr(mod, attr, None) is real:
                    monkeypatch.setattr(mod, attr, spy)
    return calls


def test_fidelity_uses_exactly_the_queries_attribute_used(attributed_run, tmp_path, monkeypatch):
    """report.json's own-words queries read back with every field (`report.read.queries_from_report`): fidelity's
    query rows, losses and gradients are the very ones `attribute` scored with. (Reading 6 of the 11 fields lost the
    target, its side and the decisive span: fidelity then measured another query than the report's.)"""
    from dataclasses import fields

    from gradian.attribution.queries import QueryItem
    from gradian.config import load_config
    from gradian.pipeline import attribute
    from gradian.report.read import load_report, queries_from_report
    from gradian.validate.fidelity import run_fidelity
    from gradian.validate.verify import read_report

    cfg_path = _copy(attributed_run, tmp_path / "run")
    cfg = load_config(cfg_path)
    calls = _spy_on_queries(monkeypatch)
    attribute(cfg, truth=json.loads((cfg_path.parent / "truth.json").read_text()))
    by_attribute, calls[:] = list(calls), []
    res = run_fidelity(cfg, loo=0, subsets=0)
    by_fidelity = list(calls)

    report = load_report(cfg.output_dir)
    qs = queries_from_report(report)
    assert read_report(cfg, "verify") == report  # verify reads the same typed report
    # the scenario's queries are own-words ones: every field that the old reader dropped is set
    assert qs and all(q.formulation == "own_words" and q.span and q.span_start >= 0 and q.target_source == "base"
                      and q.target and q.contrast for q in qs)
    entries = report.query.items
    for q, e in zip(qs, entries):  # every QueryItem field the entry holds, as it holds it
        held = e.model_dump(exclude_none=True)
        for f in fields(QueryItem):
            if f.name in held:
                assert getattr(q, f.name) == (tuple(held[f.name]) if f.name == "span" else held[f.name])
    for kind in ("rows", "vectors"):
        a = [c for c in by_attribute if c[0] == kind]
        f = [c for c in by_fidelity if c[0] == kind]
        assert a and f
        for _, used, _ in a + f:
            assert used == qs  # dataclass equality: every field of every query
    # the rows each query loss is made of (token ids, supervised mask, sign, owner): the losses fidelity measures
    rows_a = [c[2] for c in by_attribute if c[0] == "rows"]
    assert all(c[2] == rows_a[0] for c in by_fidelity if c[0] == "rows")
    # the query gradients fidelity takes (at each adapter state it scores) are attribute's, bit for bit
    vec_a = [c[2] for c in by_attribute if c[0] == "vectors"]
    for _, _, v in (c for c in by_fidelity if c[0] == "vectors"):
        assert any(torch.equal(v, w) for w in vec_a)
    norms = [np.linalg.norm(w.numpy().astype(np.float64), axis=1) for w in vec_a]
    assert any(np.array_equal(np.maximum(n, 1e-30), np.asarray(res["query_grad_norms"])) for n in norms)
    assert res["items"] == [q.item for q in qs]


def test_fidelity_refuses_without_report(tmp_path):
    cfg_path = write_tiny_run(tmp_path / "run")
    r = _cli("fidelity", cfg_path)
    assert r.exit_code == 2 and "report.json: no report to check" in words(r.output)


@pytest.mark.parametrize("columns", ["40", "300"])
def test_cli_errors_are_not_wrapped_when_not_a_terminal(tmp_path, columns):
    """Piped or redirected, an error is one line whatever COLUMNS says: rich must not break a long path or a
    message at the terminal width (a log grep for the message would miss it)."""
    import os
    import subprocess
    import sys

    cfg_path = write_tiny_run(tmp_path / ("run-with-a-rather-long-directory-name-" + "x" * 40))
    env = {**os.environ, "COLUMNS": columns}
    p = subprocess.run([sys.executable, "-m", "gradian", "verify", str(cfg_path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    line = f"error: {cfg_path.parent / 'report.json'}: no report to verify; run `gradian attribute CONFIG` first"
    assert line in p.stderr.splitlines(), p.stderr
