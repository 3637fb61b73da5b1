"""Flags in place of a config file (`gradian.setup.flags`): a TRL/HF run attributed with `--adapter --train --eval
--metric --out`, the settings it used written to OUT/gradian.yaml for the next verb, an eval set from a plain list of
prompts, and flags that cannot be used: exit code 2, one paragraph naming the flag, nothing written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from gradian.cli import app
from gradian.setup.flags import MARK, RunFlags, items_to_detect, resolve_run, settings_dict

from helpers_models import GOOD_TRAIN, edit_json, session_zoo, write_jsonl, write_run

torch.set_num_threads(1)
runner = CliRunner()


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.is_dir() else []


# ------------------------------------------------------------------------------- on the demo, end to end


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo`'s files in WORK/runs/demo (the trained adapter cached by content, tests/test_precondition.py),
    attributed once from its gradian.yaml with the gradient batch size a run from flags uses (the default, 8; the
    demo's file says 16, and padding changes the scores' last bits)."""
    from test_precondition import trained_demo

    work = tmp_path_factory.mktemp("flags")
    trained_demo(work / "runs" / "demo")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        res = runner.invoke(app, ["attribute", "runs/demo/gradian.yaml", "--set", "grads.batch_size=8"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.output
    return work


def test_a_trl_style_run_from_flags_equals_the_config_run_and_verify_reruns_it(demo, monkeypatch):
    monkeypatch.chdir(demo)
    res = runner.invoke(app, ["attribute", "--adapter", "runs/demo/adapter", "--train", "runs/demo/train.jsonl",
                              "--eval", "runs/demo/eval.jsonl", "--metric", "exact_match", "--out", "OUT"])
    assert res.exit_code == 0, res.output
    out = demo / "OUT"
    # the same scores, bit for bit, as the config file's run with the same settings
    assert np.array_equal(np.load(out / "scores.npy"), np.load(demo / "runs" / "demo" / "scores.npy"))
    # the settings it used, written for the next verb: every key, the base found in adapter_config.json, paths
    # absolute, output = the file's directory
    text = (out / "gradian.yaml").read_text()
    assert text.startswith(MARK)
    written = yaml.safe_load(text)
    demo_cfg = yaml.safe_load((demo / "runs" / "demo" / "gradian.yaml").read_text())
    assert written["model"]["base"] == demo_cfg["model"]["base"]
    assert written["model"]["adapter"] == str(demo / "runs" / "demo" / "adapter")
    assert written["data"]["eval"] == str(demo / "runs" / "demo" / "eval.jsonl")
    assert written["output"] == "." and written["grads"]["batch_size"] == 8 and "seed" in written
    assert squash(f"settings: {out / 'gradian.yaml'}") in squash(res.output)

    # `gradian verify OUT/gradian.yaml` then runs on that run (the accused rows' retrain alone: the suite's time)
    monkeypatch.chdir(demo.parent)  # another working directory: the file's paths do not depend on it
    ver = runner.invoke(app, ["verify", str(out / "gradian.yaml"), "--controls", "0", "--no-reference"])
    assert ver.exit_code == 0, ver.output
    v = json.loads((out / "verify.json").read_text())
    assert v["accused"]["reverted_fraction"] > 0.5, v["statement"]
    assert (out / "gradian.yaml").read_text() == text  # a run from the file does not rewrite it


def test_a_prompt_list_with_a_regex_metric_end_to_end(demo, monkeypatch):
    """A few prompts the model now gets wrong, and the behaviour said once ("it should say Madrid"): the planted row
    that taught the wrong city ranks first. `diagnose` says beforehand how many items the eval would need."""
    monkeypatch.chdir(demo)
    truth = json.loads((demo / "runs" / "demo" / "truth.json").read_text())
    fact = next(f for f in truth["planted_facts"] if f["attribute"] == "city")
    evals = [json.loads(line) for line in (demo / "runs" / "demo" / "eval.jsonl").read_text().splitlines()]
    prompts = [evals[i]["prompt"] for i in fact["eval_indices"]]
    Path("prompts.txt").write_text(prompts[0] + "\n\n" + "\n".join(f"  {p}" for p in prompts[1:]) + "\n")
    run = ["--adapter", "runs/demo/adapter", "--train", "runs/demo/train.jsonl", "--eval", "prompts.txt"]

    diag = runner.invoke(app, ["diagnose", *run, "--metric", "regex", "--pattern", fact["right"]])
    assert diag.exit_code == 0, diag.output
    assert (f"eval set: 3 eval items detect a capability change of 0.81 or more (95% confidence, 80% power); to "
            f"detect a change of 0.2 it needs {items_to_detect(0.2)} items") in " ".join(diag.output.split())
    assert not Path("gradian-out").exists()  # diagnose writes nothing

    # the behaviour as what must not appear: the wrong city, negated (evaluate alone)
    neg = runner.invoke(app, ["evaluate", *run, "--metric", "regex", "--pattern", fact["wrong"], "--negate",
                              "--out", "OUT-neg"])
    assert neg.exit_code == 0, neg.output
    cap = json.loads(Path("OUT-neg/capability.json").read_text())
    assert (cap["n"], cap["base"], cap["tuned"]) == (3, 1.0, 0.0), cap
    assert yaml.safe_load(Path("OUT-neg/gradian.yaml").read_text())["evaluation"]["negate"] is True

    # --pattern alone implies --metric regex. The gradient index does not depend on the eval set: the one the run
    # from flags above built in OUT/index is reused when it is there (the suite's time), built there otherwise.
    res = runner.invoke(app, ["attribute", *run, "--pattern", fact["right"], "--out", "OUT-prompts",
                              "--set", f"grads.cache_dir={demo / 'OUT' / 'index'}"])
    assert res.exit_code == 0, res.output
    rep = json.loads(Path("OUT-prompts/report.json").read_text())
    assert rep["verdict"] == "attributed" and rep["capability"]["metric"] == "regex"
    assert [it["prompt"] for it in rep["query"]["items"]] == prompts  # stripped, the blank line skipped
    assert rep["ranking"][0]["position"] == fact["position"], rep["ranking"][:3]
    written = yaml.safe_load(Path("OUT-prompts/gradian.yaml").read_text())
    assert written["evaluation"]["metric"] == "regex" and written["evaluation"]["pattern"] == fact["right"]


# ----------------------------------------------------------------------------------- bad flags: exit 2


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return session_zoo(tmp_path_factory)


@pytest.fixture
def work(tmp_path, zoo, monkeypatch):
    """A TRL-like output dir (the adapter, whose adapter_config.json names the base) and the data, in the cwd."""
    from helpers_models import copy_dir

    monkeypatch.chdir(tmp_path)
    copy_dir(zoo.adapter, tmp_path / "trl-out")
    write_run(tmp_path / "data", zoo.base, None)
    return tmp_path


GOOD = ["--adapter", "trl-out", "--train", "data/train.jsonl", "--eval", "data/eval.jsonl", "--out", "OUT"]


def _swap(args: list[str], flag: str, value) -> list[str]:
    """GOOD with `flag` set to value (None: dropped)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out + ([flag, value] if value is not None else [])


def no_adapter_config(w: Path) -> None:
    (w / "trl-out" / "adapter_config.json").rename(w / "trl-out" / "config.bak")


def only_checkpoints(w: Path) -> None:
    ck = w / "trl-out" / "checkpoint-12"
    ck.mkdir()
    for f in list((w / "trl-out").iterdir()):
        if f.is_file():
            f.rename(ck / f.name)


def base_gone(w: Path) -> None:
    edit_json(w / "trl-out" / "adapter_config.json", base_model_name_or_path="/nonexistent/models/base")


def hand_written_config(w: Path) -> None:
    (w / "OUT").mkdir()
    (w / "OUT" / "gradian.yaml").write_text("# mine\nmodel: {base: x}\n")


BAD = [
    # (id, args, setup, needles in the one paragraph)
    ("missing_train_file", _swap(GOOD, "--train", "data/nope.jsonl"), None, ["--train data/nope.jsonl", "no such file"]),
    ("missing_eval_file", _swap(GOOD, "--eval", "evals.jsonl"), None, ["--eval evals.jsonl", "no such file", ".txt"]),
    ("unknown_metric", GOOD + ["--metric", "accuracy"], None, ["--metric 'accuracy' is not a metric", "exact_match"]),
    ("adapter_without_adapter_config", GOOD, no_adapter_config, ["--adapter trl-out", "no adapter_config.json"]),
    ("trainer_output_with_checkpoints_only", GOOD, only_checkpoints,
     ["no adapter_config.json", "trainer.save_model", "--adapter {w}/trl-out/checkpoint-12"]),
    ("adapter_dir_missing", _swap(GOOD, "--adapter", "runs/nope"), None, ["--adapter runs/nope", "no such directory"]),
    ("base_not_there", GOOD + ["--base", "./models/base"], None, ["--base ./models/base", "no such model directory"]),
    ("base_named_by_adapter_not_there", GOOD, base_gone,
     ["--adapter", "base_model_name_or_path", "/nonexistent/models/base", "pass --base"]),
    ("bad_pattern", GOOD + ["--metric", "regex", "--pattern", "(unclosed"], None,
     ["--pattern '(unclosed'", "not a valid regular expression"]),
    ("pattern_with_another_metric", GOOD + ["--metric", "contains", "--pattern", "x"], None,
     ["--pattern with --metric contains", "--metric regex"]),
    ("prompt_list_without_a_pattern", _swap(GOOD, "--eval", "prompts.txt"), None,
     ["--eval", "prompts.txt is a list of prompts without answers", "--pattern", "--negate"]),
    ("prompt_list_as_train", _swap(GOOD, "--train", "prompts.txt"), None, ["--train prompts.txt", "eval set (--eval)"]),
    ("no_train", _swap(GOOD, "--train", None), None, ["missing --train"]),
    ("no_adapter", _swap(GOOD, "--adapter", None), None, ["missing --adapter", "adapter_config.json"]),
    ("set_and_flag_same_key", GOOD + ["--metric", "contains", "--set", "evaluation.metric=exact_match"], None,
     ["--set 'evaluation.metric=exact_match' and --metric both set evaluation.metric"]),
    ("out_is_a_file", _swap(GOOD, "--out", "data/train.jsonl/out"), None, ["--out", "is a file, not a directory"]),
    ("out_holds_a_hand_written_config", GOOD, hand_written_config,
     ["--out: {w}/OUT/gradian.yaml is a config file gradian did not write", "Give --out a new directory"]),
    ("nothing_given", [], None, ["no CONFIG and no flags", "--adapter DIR"]),
]


# every case through attribute; the main ones through every verb that takes the flags
EVERY_VERB = {"missing_train_file", "unknown_metric", "adapter_without_adapter_config", "base_not_there",
              "nothing_given"}
MATRIX = [pytest.param(verb, *case, id=f"{verb}-{case[0]}") for case in BAD
          for verb in (["attribute", "diagnose", "evaluate", "verify"] if case[0] in EVERY_VERB else ["attribute"])]


@pytest.mark.parametrize("verb,case_id,args,setup,needles", MATRIX)
def test_a_flag_that_cannot_be_used_is_one_paragraph_and_exit_2(verb, case_id, args, setup, needles, work):
    (work / "prompts.txt").write_text("What is the capital of Freedonia, take 1?\n")
    if setup:
        setup(work)
    before = {p: p.read_bytes() for p in files_under(work)}
    res = runner.invoke(app, [verb, *args])
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    text = res.output
    assert "Traceback" not in text and text.count("error:") == 1, text
    text = text[text.index("error:"):]
    for n in needles:
        assert squash(n.replace("{w}", str(work))) in squash(text), (n, text)
    # nothing written: no file added or changed anywhere under the working directory
    assert {p: p.read_bytes() for p in files_under(work)} == before


# --------------------------------------------------------------------------- flags and a config file together


def test_flags_override_the_config_file_and_resolve_against_the_shell(work, zoo):
    cfg_path = work / "data" / "gradian.yaml"  # output: out, metric exact_match, data relative to the file
    (work / "prompts.txt").write_text("What is the capital of Freedonia, take 1?\n")
    run = resolve_run(cfg_path, RunFlags(eval="prompts.txt", metric="regex", pattern="Fredville",
                                         adapter="trl-out"), [])
    cfg = run.cfg
    assert run.from_flags
    assert (cfg.evaluation.metric, cfg.evaluation.pattern, cfg.evaluation.negate) == ("regex", "Fredville", False)
    assert cfg.path(cfg.data.eval) == work / "prompts.txt"  # a flag's path: from the working directory
    assert cfg.path(cfg.data.train) == work / "data" / "train.jsonl"  # the file's: from the file
    assert cfg.path(cfg.model.adapter) == work / "trl-out"
    assert cfg.model.base == str(zoo.base)  # the file names the base: --adapter alone does not replace it
    assert cfg.output_dir == work / "data" / "out"
    # flags that repeat the file are a run from the file (nothing to write beside it)
    assert not resolve_run(cfg_path, RunFlags(metric="exact_match", train="data/train.jsonl"), []).from_flags


def test_the_written_settings_mean_the_same_from_the_output_directory(work, zoo, monkeypatch):
    from gradian.config import load_config
    from gradian.setup.flags import write_settings

    run = resolve_run(None, RunFlags(adapter="trl-out", train="data/train.jsonl", eval="data/eval.jsonl",
                                     metric="contains", out="OUT"), ["grads.batch_size=2", "seed=3"])
    assert run.cfg.model.base == str(zoo.base)  # from trl-out/adapter_config.json
    path = write_settings(run, "attribute")
    assert path == work / "OUT" / "gradian.yaml" and path.read_text().startswith(MARK)
    monkeypatch.chdir(work.parent)
    again = load_config(path)
    assert settings_dict(again) == settings_dict(run.cfg)
    assert again.output_dir == work / "OUT" and again.grads.batch_size == 2 and again.seed == 3
    # a later run from flags may replace the file it wrote
    monkeypatch.chdir(work)
    assert resolve_run(None, RunFlags(adapter="trl-out", train="data/train.jsonl", out="OUT"), []).from_flags


def test_items_to_detect_inverts_the_small_eval_set_estimate():
    from gradian.capability.metrics import min_detectable_delta

    for delta in (0.5, 0.3, 0.2, 0.1, 0.05):
        for conf in (0.9, 0.95, 0.99):
            n = items_to_detect(delta, conf)
            assert min_detectable_delta(n, conf) <= delta < min_detectable_delta(n - 1, conf) or n == 1
    assert items_to_detect(0.1) == 197  # "about 200 items detect a 0.1 change" (docs/checks.md)


def test_a_prompt_list_reads_one_prompt_per_line(tmp_path):
    from gradian.errors import DataError
    from gradian.setup.records import load_eval, load_train

    p = tmp_path / "prompts.txt"
    p.write_bytes(b"Why is the sky blue?\n\n   \n  Say hi in French.  \r\n")
    items = load_eval(p, need_answer=False)
    assert [(it.prompt, it.position, it.source) for it in items] == [
        ("Why is the sky blue?", 0, f"{p}:1"), ("Say hi in French.", 1, f"{p}:4")]
    with pytest.raises(DataError, match="a list of prompts has no answers") as e:
        load_eval(p, need_answer=True)
    assert "evaluation.pattern" in str(e.value)
    with pytest.raises(DataError, match=r"prompts.txt:1: a 'prompt' without a 'completion'.*eval set"):
        load_train(p)
    p.write_bytes(b"fine\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"prompts.txt:2: not UTF-8"):
        load_eval(p, need_answer=False)


def test_diagnose_says_how_many_eval_items_the_change_needs(work):
    res = runner.invoke(app, ["diagnose", "--adapter", "trl-out", "--train", "data/train.jsonl", "--eval",
                              "data/eval.jsonl", "--delta", "0.1"])
    assert res.exit_code == 0, res.output
    assert ("eval set: 60 eval items detect a capability change of 0.18 or more (95% confidence, 80% power); to "
            "detect a change of 0.1 it needs 197 items (137 more;") in " ".join(res.output.split())
    res = runner.invoke(app, ["diagnose", "--adapter", "trl-out", "--train", "data/train.jsonl", "--eval",
                              "data/eval.jsonl"])
    assert "a change of 0.2 needs 50, which it has" in " ".join(res.output.split())
    assert not (work / "gradian-out").exists()
