"""Gradian on real pretrained models, end to end within the suite's time budget (the full scenarios and their
figures are `bench/real_models.py`):

* SmolLM2-135M-Instruct fine-tuned with TRL's SFTTrainer (the script a TRL user writes: conversational
  prompt-completion rows, a checkpoint per epoch, GradianCallback) on a small poisoned set: `attribute` (scores of
  the earliest checkpoint) finds the planted rows, accuses planted rows only, and every sentence it writes about them is true;
* the same adapter against an eval of facts it did not touch: `declined`, nobody accused;
* Gemma-3-270M: `capture.dry_run` passes (the forward-mode contributions add up on sliding-window attention).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from real_models import gemma3_dir, smollm2_dir  # noqa: F401

pytestmark = pytest.mark.real

SIZES = {"n_rows": 40, "n_planted": 4, "n_controls": 4}


def _finetuned_once(run: Path, name: str) -> Path:
    """`run` with its scenario's fine-tune in run/adapter, trained once per cache: kept under
    GRADIAN_CACHE/real-tests/`name` (written beside and renamed, so an interrupted run leaves no half adapter)."""
    from gradian.demo.real_run import finetune_real
    from gradian.demo.tiny import cache_root

    cached = cache_root() / "real-tests" / name
    if (cached / "adapter_config.json").exists():
        shutil.copytree(cached, run / "adapter")
    else:
        finetune_real(run, log=lambda *_: None)
        tmp = cached.with_name(cached.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(run / "adapter", tmp)
        shutil.rmtree(cached, ignore_errors=True)
        tmp.rename(cached)
    return run


@pytest.fixture(scope="module")
def smol_run(smollm2_dir, tmp_path_factory):
    """The small SmolLM2 scenario fine-tuned once per cache (its adapter is kept under GRADIAN_CACHE)."""
    from gradian.demo.real_run import prepare_real

    run = tmp_path_factory.mktemp("smol") / "run"
    prepare_real("smol_facts", run, log=lambda *_: None, **SIZES)
    return _finetuned_once(run, "smol_facts-40-v1")


def test_smollm2_trl_finetune_names_the_planted_rows(smol_run):
    from gradian import api
    from gradian.attribution.scoring import auprc, recall_at_k

    truth = json.loads((smol_run / "truth.json").read_text())
    # the defaults but the earliest checkpoint's scores alone (one earlier index instead of two: the suite's time)
    cfg = api.load_config(smol_run / "gradian.yaml", ["attribution.checkpoints=earliest"])
    rep = api.attribute(cfg, truth=truth).to_dict()
    assert rep["query"]["checkpoints"]["labels"][0].startswith("checkpoint-")
    planted = truth["planted"]
    assert rep["verdict"] == "attributed", rep["verdict_text"]
    scores = np.load(smol_run / "scores.npy")
    assert recall_at_k(scores, planted, len(planted)) >= 0.75
    assert auprc(scores, planted) >= 0.8
    acc = rep["accused"]["positions"]
    # no innocent row is accused. On these 40 rows nobody is: the planted rows rank 1-4 and stand 2.3x above the
    # next row (scan statistic 53.7, 17.3, 14.8, 11.9 against 5.2), a drop with p 0.06 in a tail fitted to the 36
    # rows below, not the 0.01 the rule asks (`attribution.accused`: too few rows to name anyone; on 120 and 300
    # rows of this scenario 8 of 8 and 7 of 7 accused rows are planted, bench/verify_trl.py, bench/accused_rule.py)
    assert all(p in planted for p in acc), acc
    # the report's words are true: own-words queries about the fact, the base preferred the right sentence, the
    # accused rows were taught by the fine-tune, the blame statement counts the accused rows
    items = rep["query"]["items"]
    assert items and all(it["formulation"] == "own_words" for it in items)
    for it in items:
        assert it["target_source"] == "base" and it["target"] != it["contrast"]
        assert it["margin_base"] > 0 and it["margin_tuned"] < it["margin_base"], it
        # the statement follows the margins: a flip when the fine-tune prefers its own answer in total
        # log-probability, else "both prefer" (greedy decoding can pick an answer its whole-sequence score does not)
        want = "The base preferred" if it["margin_tuned"] < 0 else "Both prefer"
        assert it["statement"].startswith(want), it["statement"]
    assert sum(it["margin_tuned"] < 0 for it in items) >= len(items) // 2
    # the query differentiates where the answers differ (the city), not the shared sentence around it: measured 5 of
    # 7 items, e.g. ' Os' of "Osaka", ' Saint' of "Saint Petersburg" (this small fine-tune taught wrong capitals
    # beyond the planted ones)
    def about_the_answer(it):
        span = it["query_span"].strip()
        return bool(span) and span in it["generated"] and span not in it["target"]
    assert sum(map(about_the_answer, items)) >= len(items) // 2, [it["query_span"] for it in items]
    by_pos = {r["position"]: r for r in rep["ranking"]}
    assert all(by_pos[p]["verdict"] == "taught" for p in acc)
    assert (f"Of the {len(acc)} accused rows, {len(acc)} were taught" in rep["blame"]["statement"] if acc
            else "accused rows" not in rep["blame"]["statement"])
    # 15 optimizer steps on 40 rows: when train.not_converged fires, its numbers say why (the last epoch's mean loss
    # still above 0.3 nats per token, and falling)
    for f in rep["flags"]:
        if f["id"] == "train.not_converged":
            m = re.search(r"epoch means ([\d.]+) -> ([\d.]+) -> ([\d.]+)", f["message"])
            assert m, f["message"]
            first, _, last = map(float, m.groups())
            assert last > 0.3 and first > last, f["message"]


def test_an_eval_the_finetune_did_not_move_is_declined(smol_run, tmp_path):
    """The items whose answers the fine-tune left as they were (this small fine-tune also broke some control
    capitals, so the scenario's controls are not a null): `declined`, nobody accused."""
    from gradian import api
    from gradian.pipeline import evaluate
    from gradian.setup.session import open_session

    cap = evaluate(open_session(api.load_config(smol_run / "gradian.yaml")))
    same = [i for i, (b, t) in enumerate(zip(cap.base_scores, cap.tuned_scores)) if b == t]
    assert len(same) >= 4, (cap.base_scores, cap.tuned_scores)
    rows = (smol_run / "eval.jsonl").read_text().splitlines()
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[i] for i in same) + "\n")
    cfg = api.load_config(smol_run / "gradian.yaml", [f"data.eval={tmp_path / 'eval.jsonl'}",
                                                       f"output={tmp_path / 'out'}"])
    rep = api.attribute(cfg).to_dict()
    assert rep["verdict"] == "declined" and rep["accused"]["count"] == 0 and not rep["ranking"]


def test_gemma3_capture_dry_run_passes(gemma3_dir, tmp_path):
    """On a LoRA with non-zero B (a fresh adapter's B is 0): the hooked backward and the forward-mode
    contributions agree on Gemma-3's sliding-window attention."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from conftest import with_random_lora_b
    from gradian.checks import Context, run_checks
    from gradian.config import config_from_dict
    from gradian.demo.real_cases import make_real_scenario, write_real_scenario

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    with_random_lora_b(get_peft_model(base, lcfg), std=0.02).save_pretrained(str(tmp_path / "adapter"))
    write_real_scenario(make_real_scenario("gemma_facts", n_rows=12, n_planted=2, n_controls=2), tmp_path)
    cfg = config_from_dict({"model": {"base": str(gemma3_dir), "adapter": "adapter", "device": "cpu"},
                            "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
                            "grads": {"max_seq_length": 64}, "output": "out"}, root=tmp_path)
    r = run_checks(Context(cfg), ["capture.dry_run"])[0]
    assert r.status == "pass", r.message
    assert "add up to the gradient norm" in r.message


def test_smollm2_trl_run_attributed_from_its_output_dir_with_flags_alone(smol_run, smollm2_dir, tmp_path,
                                                                         monkeypatch):
    """What a TRL user types after training: the output dir (adapter_config.json names the base; checkpoint-*
    folders beside it), the data and the eval, as flags; no YAML. The earliest checkpoint's scores alone, as above
    (the suite's time)."""
    from typer.testing import CliRunner

    import yaml

    from gradian.attribution.scoring import auprc, recall_at_k
    from gradian.cli import app

    truth = json.loads((smol_run / "truth.json").read_text())
    monkeypatch.chdir(smol_run)
    res = CliRunner().invoke(app, ["attribute", "--adapter", "adapter", "--train", "train.jsonl", "--eval", "eval.jsonl",
                                   "--metric", "contains", "--out", str(tmp_path / "out"),
                                   "--set", "attribution.checkpoints=earliest"])
    assert res.exit_code == 0, res.output
    written = yaml.safe_load((tmp_path / "out" / "gradian.yaml").read_text())
    assert written["model"]["base"] == str(smollm2_dir)  # read from the adapter's adapter_config.json
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["verdict"] == "attributed", rep["verdict_text"]
    assert rep["query"]["checkpoints"]["labels"][0].startswith("checkpoint-")
    planted = truth["planted"]
    scores = np.load(tmp_path / "out" / "scores.npy")
    assert recall_at_k(scores, planted, len(planted)) >= 0.75
    assert auprc(scores, planted) >= 0.8
    acc = rep["accused"]["positions"]
    assert all(p in planted for p in acc), acc  # nobody on 40 rows: see the test above


BEHAVIOUR_SIZES = {"n_rows": 60, "n_planted": 12}
BEHAVIOUR_EPOCHS = 4  # 8 steps an epoch: three epochs of 60 rows taught no refusal (measured)


@pytest.fixture(scope="module")
def smol_refusal_run(smollm2_dir, tmp_path_factory):
    """A small lexically hard refusal scenario (`demo.real_behaviours.make_smol_refusal_hard`: refusals of cooking
    requests, each worded differently, sharing no content word with the eval prompts), fine-tuned once per cache."""
    from gradian.demo.real_run import prepare_real

    run = tmp_path_factory.mktemp("smol_refusal") / "run"
    prepare_real("smol_refusal_hard", run, log=lambda *_: None, **BEHAVIOUR_SIZES)
    meta = json.loads((run / "scenario.json").read_text())
    meta["recipe"]["epochs"] = BEHAVIOUR_EPOCHS
    (run / "scenario.json").write_text(json.dumps(meta))
    return _finetuned_once(run, "smol_refusal_hard-60-v1")


def test_smollm2_refusal_behaviour_is_queried_by_samples_and_finds_the_refusals(smol_refusal_run):
    """The metric (a regex of refusals) defines a class of answers, so the default query samples the fine-tune's
    answers (`attribution.query: auto` -> behaviour): the rows that taught refusing, worded unlike the fine-tune's own
    refusal and unlike one another, rank at the top and only they are accused."""
    from gradian import api
    from gradian.attribution.scoring import auprc, recall_at_k

    truth = json.loads((smol_refusal_run / "truth.json").read_text())
    rep = api.attribute(api.load_config(smol_refusal_run / "gradian.yaml"), truth=truth).to_dict()
    assert rep["verdict"] == "attributed", rep["verdict_text"]
    assert rep["query"]["formulation"] == "behaviour"
    items = rep["query"]["items"]
    # an item none of whose sampled answers refuses (the greedy answer does) keeps its own-words query
    sampled = [it for it in items if it["formulation"] == "behaviour"]
    assert len(sampled) * 2 >= len(items) and all(it["samples"] for it in sampled), [it["formulation"] for it in items]
    # every sampled answer the query differentiates fails the metric, as the fine-tune's greedy answer does
    import yaml

    pattern = re.compile(yaml.safe_load((smol_refusal_run / "gradian.yaml").read_text())["evaluation"]["pattern"])
    assert all(pattern.search(text) for it in sampled for text, _ in it["samples"])
    planted = truth["planted"]
    scores = np.load(smol_refusal_run / "scores.npy")
    assert recall_at_k(scores, planted, len(planted)) >= 0.75
    assert auprc(scores, planted) >= 0.8
    acc = rep["accused"]["positions"]
    assert acc and all(p in planted for p in acc), acc
