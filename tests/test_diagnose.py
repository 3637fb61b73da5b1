"""`gradian diagnose`: every check fails on a setup made to trigger it and passes on a good one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradian import checks
from gradian.checks import estimates, resources, setup_checks
from gradian.checks.estimates import human
from gradian.checks import ORDER, REGISTRY, CheckResult, Context, flags_from_checks, run_checks, run_checks_for_session
from gradian.cli import app
from gradian.config import load_config
from gradian.errors import CheckFailed

from helpers_models import GOOD_EVAL, GOOD_TRAIN, chat, session_zoo, write_jsonl, write_run

torch.set_num_threads(1)
runner = CliRunner()
KEYS = {"id", "level", "status", "message", "fix"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return session_zoo(tmp_path_factory)


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def diagnose(cfg_path: Path, *sets: str) -> tuple[int, dict[str, dict], list[dict]]:
    args = ["diagnose", str(cfg_path), "--json"]
    for s in sets:
        args += ["--set", s]
    res = runner.invoke(app, args)
    assert res.exit_code in (0, 1), (res.exit_code, res.output, res.exception)
    rows = json.loads(res.stdout)
    return res.exit_code, {r["id"]: r for r in rows}, rows


def assert_fails(by_id: dict, cid: str, level: str, *needles: str) -> dict:
    r = by_id[cid]
    assert r["status"] == "fail", r
    assert r["level"] == level, r
    for n in needles:
        assert squash(n) in squash(r["message"]), (n, r["message"])
    assert r["fix"], r
    return r


def run(tmp_path, zoo, **kw) -> Path:
    base = kw.pop("base", None) or zoo.base
    adapter = kw.pop("adapter", "default")
    return write_run(tmp_path / "run", base, zoo.adapter if adapter == "default" else adapter, **kw)


# ----------------------------------------------------------------------------------------------- good setup


def test_good_setup_passes_every_check_and_json_format(tmp_path, zoo):
    code, by_id, rows = diagnose(run(tmp_path, zoo))
    assert code == 0
    assert [r["id"] for r in rows] == list(ORDER) and set(ORDER) == set(REGISTRY), \
        "every registered check is reported, in order"
    for r in rows:
        assert set(r) == KEYS
        assert r["level"] in ("error", "warning", "info") and r["status"] in ("pass", "fail", "skip")
        assert isinstance(r["message"], str) and r["message"]
    bad = [r for r in rows if r["status"] != "pass"]
    assert not bad, bad
    assert all(r["fix"] == "" for r in rows)
    # nothing is written by diagnose
    assert not (tmp_path / "run" / "out").exists()


def test_table_output_and_exit_codes(tmp_path, zoo):
    cfg = run(tmp_path, zoo)
    res = runner.invoke(app, ["diagnose", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "config.paths" in res.output and "index.size" in res.output
    # an error-level failure: exit 1, and the table names the check and the fix
    write_jsonl(tmp_path / "run" / "train.jsonl", ["{oops"])
    res = runner.invoke(app, ["diagnose", str(cfg)])
    assert res.exit_code == 1
    assert "data.unreadable_record" in res.output and "FAIL" in res.output and "fix:" in res.output


def test_warnings_only_exit_zero(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, eval=None))
    assert code == 0
    assert_fails(by_id, "evaluation.no_eval_set", "warning", "data.eval")
    assert_fails(by_id, "attribution.no_capability_target", "warning", "smoke test")
    assert by_id["evaluation.small_eval_set"]["status"] == "skip"


def test_config_errors_are_exit_2(tmp_path, zoo):
    cfg = run(tmp_path, zoo)
    res = runner.invoke(app, ["diagnose", str(cfg), "--set", "grads.batch_size=-1"])
    assert res.exit_code == 2 and "grads.batch_size" in squash(res.output)


# ----------------------------------------------------------------------------------------------- config, runtime


def test_config_paths(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo), "data.eval=nope.jsonl", "model.adapter=./no_adapter")
    assert code == 1
    assert_fails(by_id, "config.paths", "error", "data.eval", "nope.jsonl", "model.adapter")
    # what needs the missing files is skipped with a reason, not failed
    assert by_id["model.full_finetune"]["status"] == "skip"
    assert by_id["adapter.not_lora"]["status"] == "skip"
    assert "config.paths" in by_id["adapter.not_lora"]["message"]
    assert by_id["evaluation.small_eval_set"]["status"] == "skip"


def test_missing_train_skips_data_checks(tmp_path, zoo):
    cfg = run(tmp_path, zoo)
    (tmp_path / "run" / "train.jsonl").unlink()
    code, by_id, _ = diagnose(cfg)
    assert code == 1
    assert_fails(by_id, "config.paths", "error", "data.train", "train.jsonl")
    for cid in ("data.unknown_record_shape", "data.duplicate_rows", "data.no_supervised_tokens", "index.size"):
        assert by_id[cid]["status"] == "skip", by_id[cid]
        assert by_id[cid]["message"].startswith("skipped")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_unavailable(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo), "model.device=cuda")
    assert code == 1
    assert_fails(by_id, "device.unavailable", "error", "model.device", "cuda")
    assert by_id["memory.logit_upcast"]["status"] == "skip"


def test_device_mps_not_auto(tmp_path, zoo, monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(run(tmp_path, zoo), ["model.device=auto"])
    (r,) = run_checks(Context(cfg), ["device.mps_not_auto"])
    assert (r.status, r.level) == ("fail", "info") and "model.device" in r.message
    cfg = load_config(run(tmp_path, zoo), ["model.device=cpu"])
    (r,) = run_checks(Context(cfg), ["device.mps_not_auto"])
    assert r.status == "pass"


def test_runtime_threads(tmp_path, zoo, monkeypatch):
    monkeypatch.setattr(setup_checks, "cpu_count", lambda: 2)
    cfg_path = run(tmp_path, zoo)
    (r,) = run_checks(Context(load_config(cfg_path, ["model.threads=2"])), ["runtime.threads"])
    assert (r.status, r.level) == ("fail", "warning") and "model.threads = 2" in r.message and "2 CPU core" in r.message
    monkeypatch.setenv("GRADIAN_THREADS", "4")
    (r,) = run_checks(Context(load_config(cfg_path)), ["runtime.threads"])
    assert r.status == "fail" and "GRADIAN_THREADS" in r.message
    monkeypatch.setenv("GRADIAN_THREADS", "lots")
    (r,) = run_checks(Context(load_config(cfg_path)), ["runtime.threads"])
    assert (r.status, r.level) == ("fail", "error")
    monkeypatch.setenv("GRADIAN_THREADS", "1")
    (r,) = run_checks(Context(load_config(cfg_path)), ["runtime.threads"])
    assert r.status == "pass"


# ----------------------------------------------------------------------------------------------- data


def test_data_unreadable_record(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=[GOOD_TRAIN[0], '{"text": "broken'] + GOOD_TRAIN[1:]))
    assert code == 1
    assert_fails(by_id, "data.unreadable_record", "error", "train.jsonl:2", "invalid JSON")
    assert by_id["data.duplicate_rows"]["status"] == "skip"


def test_data_unreadable_eval_record(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, eval=GOOD_EVAL[:3] + ["not json"]))
    assert code == 1
    assert_fails(by_id, "data.unreadable_record", "error", "eval.jsonl:4")


def test_data_empty(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=[]))
    assert code == 1
    assert_fails(by_id, "data.empty", "error", "train.jsonl", "no records")


def test_data_unknown_record_shape(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=GOOD_TRAIN[:2] + [{"question": "q", "reply": "r"}]))
    assert code == 1
    assert_fails(by_id, "data.unknown_record_shape", "error", "train.jsonl:3", "question")
    code, by_id, _ = diagnose(run(tmp_path, zoo, eval=[{"prompt": "q"}]))
    assert_fails(by_id, "data.unknown_record_shape", "error", "eval.jsonl:1", "answer")


def test_data_invalid_record(tmp_path, zoo):
    no_assistant = {"messages": [{"role": "user", "content": "hello?"}]}
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=[GOOD_TRAIN[0], no_assistant, {"prompt": "q", "completion": 3}]))
    assert code == 1
    r = assert_fails(by_id, "data.invalid_record", "error", "train.jsonl:2", "assistant", "train.jsonl:3", "completion")
    assert r["message"].startswith("2 malformed")


def test_data_duplicate_rows(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=GOOD_TRAIN + [GOOD_TRAIN[0]]))
    assert code == 0
    assert_fails(by_id, "data.duplicate_rows", "warning", f"train.jsonl:{len(GOOD_TRAIN) + 1}", "train.jsonl:1")


def test_data_no_chat_template(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.base_no_template))
    assert code == 0
    assert_fails(by_id, "data.no_chat_template", "warning", "chat_template", str(zoo.base_no_template))
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.base_no_template, train=[{"text": "a b c"}, {"text": "d e"}]))
    assert code == 0
    assert_fails(by_id, "data.no_chat_template", "info", "chat_template")


def test_data_tokenize_failed(tmp_path, zoo):
    sys_chat = {"messages": [{"role": "system", "content": "be brief"}] + chat("q?", "a.")["messages"]}
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.base_strict_template, train=[GOOD_TRAIN[0], sys_chat]))
    assert code == 1
    assert_fails(by_id, "data.tokenize_failed", "error", "train.jsonl:2", "System role not supported")
    assert by_id["data.no_supervised_tokens"]["status"] == "skip"


def test_data_no_supervised_tokens(tmp_path, zoo):
    long_prompt = {"prompt": "word " * 100, "completion": " end."}  # far beyond 64 tokens: the completion is cut off
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=GOOD_TRAIN + [long_prompt]), "grads.max_seq_length=64")
    assert code == 0
    assert_fails(by_id, "data.no_supervised_tokens", "warning", "1 of 9", "grads.max_seq_length=64",
                 f"train.jsonl:{len(GOOD_TRAIN) + 1}")
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=[long_prompt, long_prompt]), "grads.max_seq_length=64")
    assert code == 1
    assert_fails(by_id, "data.no_supervised_tokens", "error", "2 of 2")


def test_model_context_length(tmp_path, zoo):
    very_long = {"prompt": "word " * 400, "completion": " end."}  # > 256 = max_position_embeddings of the tiny base
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=GOOD_TRAIN + [very_long]), "grads.max_seq_length=1024")
    assert code == 0  # rotary positions: out of distribution, not a crash
    assert_fails(by_id, "model.context_length", "warning", "256", "grads.max_seq_length=1024",
                 f"train.jsonl:{len(GOOD_TRAIN) + 1}")
    code, by_id, _ = diagnose(run(tmp_path, zoo, train=GOOD_TRAIN + [very_long]), "grads.max_seq_length=256")
    assert by_id["model.context_length"]["status"] == "pass"


# ----------------------------------------------------------------------------------------------- model, tokenizer


def test_tokenizer_load_failed(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.base_no_tokenizer))
    assert code == 1
    assert_fails(by_id, "tokenizer.load_failed", "error", "model.base", str(zoo.base_no_tokenizer))
    assert by_id["data.no_chat_template"]["status"] == "skip"


def test_model_load_failed(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.base_corrupt_weights))
    assert code == 1
    assert_fails(by_id, "model.load_failed", "error", "model.base", str(zoo.base_corrupt_weights))
    assert by_id["adapter.skipped_modules"]["status"] == "skip"
    # an adapter directory given as the base
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.adapter))
    assert_fails(by_id, "model.load_failed", "error", "LoRA adapter directory", "model.adapter")


@pytest.mark.parametrize("kind", ["base_bert", "base_seqcls"])
def test_model_not_causal_lm(tmp_path, zoo, kind):
    base = getattr(zoo, kind)
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=base))
    assert code == 1
    assert_fails(by_id, "model.not_causal_lm", "error", "model.base", str(base),
                 "BertModel" if kind == "base_bert" else "LlamaForSequenceClassification")
    assert by_id["model.load_failed"]["status"] == "skip"


def test_tokenizer_vocab_mismatch(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, base=zoo.base_small_vocab))
    assert code == 1
    assert_fails(by_id, "tokenizer.vocab_mismatch", "error", "300 tokens", "200 rows")


def test_model_full_finetune(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=None))
    assert code == 1
    assert_fails(by_id, "model.full_finetune", "error", "model.adapter is not set")
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=zoo.base))
    assert_fails(by_id, "model.full_finetune", "error", str(zoo.base), "full model")
    assert by_id["adapter.not_lora"]["status"] == "skip"


def test_adapter_unreadable(tmp_path, zoo):
    bad = zoo.variant("adapter_badjson", zoo.adapter)
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA",')
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=bad))
    assert code == 1
    assert_fails(by_id, "adapter.unreadable", "error", str(bad / "adapter_config.json"))
    noweights = zoo.variant("adapter_noweights", zoo.adapter)
    (noweights / "adapter_model.safetensors").unlink()
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=noweights))
    assert_fails(by_id, "adapter.unreadable", "error", "adapter_model.safetensors")


@pytest.mark.parametrize("peft_type", ["IA3", "PREFIX_TUNING"])
def test_adapter_not_lora(tmp_path, zoo, peft_type):
    ad = zoo.variant(f"adapter_{peft_type}", zoo.adapter, peft_type=peft_type)
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=ad))
    assert code == 1
    assert_fails(by_id, "adapter.not_lora", "error", str(ad / "adapter_config.json"), peft_type)
    assert by_id["adapter.base_mismatch"]["status"] == "skip"


def test_adapter_task_type(tmp_path, zoo):
    ad = zoo.variant("adapter_seqcls", zoo.adapter, task_type="SEQ_CLS")
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=ad))
    assert code == 1
    assert_fails(by_id, "adapter.task_type", "error", str(ad / "adapter_config.json"), "SEQ_CLS")


def test_adapter_quantized(tmp_path, zoo):
    ad = zoo.variant("adapter_qlora", zoo.adapter, base_model_name_or_path="unsloth/tiny-llama-bnb-4bit")
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=ad))
    assert code == 0
    assert_fails(by_id, "adapter.quantized", "warning", "bnb-4bit", "model.dtype", "4-bit")
    # the recorded base names another model: a warning from adapter.base_mismatch too (the shapes fit)
    assert_fails(by_id, "adapter.base_mismatch", "warning", "base_model_name_or_path")
    # a quantization_config on the base itself
    cfg = load_config(run(tmp_path, zoo, base=zoo.base_quantized_config))
    (r,) = run_checks(Context(cfg), ["adapter.quantized"])
    assert (r.status, r.level) == ("fail", "warning")
    assert "quantization_config" in r.message and "bitsandbytes" in r.message


def test_adapter_base_mismatch(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=zoo.adapter_wide))
    assert code == 1
    assert_fails(by_id, "adapter.base_mismatch", "error", str(zoo.adapter_wide), "do not fit", "[4, 48]", "[4, 32]")
    assert by_id["adapter.skipped_modules"]["status"] == "skip"
    assert by_id["model.load_failed"]["status"] == "pass", "the base itself loads"


def test_adapter_skipped_modules(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=zoo.adapter_embed_and_linear))
    assert code == 0
    assert_fails(by_id, "adapter.skipped_modules", "warning", "embed_tokens", "embedding LoRA")
    code, by_id, _ = diagnose(run(tmp_path, zoo, adapter=zoo.adapter_embed_only))
    assert code == 1
    assert_fails(by_id, "adapter.skipped_modules", "error", "no LoRA Linear sites", "embed_tokens")
    assert by_id["index.size"]["status"] == "skip"
    code, by_id, _ = diagnose(run(tmp_path, zoo), "grads.module_filter=[nonexistent_proj]")
    assert code == 1
    assert_fails(by_id, "adapter.skipped_modules", "error", "grads.module_filter")


def test_train_target_modules(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo), "train.target_modules=[q_proj, c_attn]")
    assert code == 0
    assert_fails(by_id, "train.target_modules", "warning", "train.target_modules", "c_attn")
    assert "q_proj" not in by_id["train.target_modules"]["message"].split("match")[0]


# ----------------------------------------------------------------------------------------------- evaluation, resources


def test_evaluation_small_eval_set(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo, eval=GOOD_EVAL[:10]))
    assert code == 0
    r = assert_fails(by_id, "evaluation.small_eval_set", "warning", "10 eval items", "eval.jsonl")
    from gradian.capability.metrics import min_detectable_delta

    assert f"{min_detectable_delta(10, 0.95):.2f}" in r["message"]


def test_evaluation_metric_loglik(tmp_path, zoo):
    code, by_id, _ = diagnose(run(tmp_path, zoo), "evaluation.metric=loglik")
    assert code == 0
    assert_fails(by_id, "evaluation.metric_loglik", "info", "loglik")


def test_memory_logit_upcast(tmp_path, zoo, monkeypatch):
    cfg = load_config(run(tmp_path, zoo), ["grads.loss_chunk_tokens=16", "grads.batch_size=4", "grads.max_seq_length=64"])
    (r,) = run_checks(Context(cfg), ["memory.logit_upcast"])
    assert r.status == "pass"
    vocab = 300
    assert human(16 * vocab * 4) in r.message and human(4 * 64 * vocab * 4) in r.message
    monkeypatch.setattr(estimates, "mem_available", lambda: 1000)
    (r,) = run_checks(Context(cfg), ["memory.logit_upcast"])
    assert (r.status, r.level) == ("fail", "warning") and "grads.loss_chunk_tokens" in r.message


def test_index_size(tmp_path, zoo, monkeypatch):
    cfg = load_config(run(tmp_path, zoo), ["grads.storage_dtype=bfloat16", "grads.projection_dim=256",
                                                    "grads.projection_kind=rademacher"])
    ctx = Context(cfg)
    (r,) = run_checks(ctx, ["index.size"])
    assert r.status == "pass"
    from gradian.grads.layout import site_shapes
    from gradian.projection.projector import Projector

    sites, _ = ctx.sites
    dim = Projector(site_shapes(sites), 256).dim
    assert f"dim {dim}" in r.message and human(len(GOOD_TRAIN) * (dim * 2 + 4)) in r.message

    class _Usage:
        free = 10

    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: _Usage())
    (r,) = run_checks(Context(cfg), ["index.size"])
    assert (r.status, r.level) == ("fail", "warning") and str(cfg.index_dir) in r.message
    # a projection width the sites cannot have is an error (the index verb would refuse it)
    monkeypatch.undo()
    (r,) = run_checks(Context(load_config(run(tmp_path, zoo), ["grads.projection_dim=8",
                                                                   "grads.projection_kind=rademacher"])), ["index.size"])
    assert (r.status, r.level) == ("fail", "error") and "grads.projection_dim" in r.message


# ----------------------------------------------------------------------------------------------- API for attribute


def test_flags_from_checks():
    rs = [CheckResult("a.x", "error", "fail", "m1", "f1"), CheckResult("b.y", "warning", "fail", "m2", "f2"),
          CheckResult("c.z", "info", "fail", "m3", "f3"), CheckResult("d.w", "warning", "pass", "ok", ""),
          CheckResult("e.v", "warning", "skip", "skipped", "")]
    assert flags_from_checks(rs) == [{"id": "b.y", "level": "warning", "message": "m2", "fix": "f2"},
                                     {"id": "c.z", "level": "info", "message": "m3", "fix": "f3"}]


def test_run_checks_for_session(tmp_path, zoo):
    from gradian.setup.session import open_session

    cfg = load_config(run(tmp_path, zoo, eval=GOOD_EVAL[:10], train=GOOD_TRAIN + [GOOD_TRAIN[1]]))
    s = open_session(cfg)
    results = run_checks_for_session(s)
    assert {r.id for r in results} == set(REGISTRY)
    ids = {f["id"] for f in s.log.flags}
    assert {"evaluation.small_eval_set", "data.duplicate_rows"} <= ids
    assert all(set(f) == {"id", "level", "message", "fix"} for f in s.log.flags)
    # the run log owns what the run records about itself; the session holds the loaded inputs only
    assert "load" in s.log.timings and not hasattr(s, "flags") and not hasattr(s, "timings")
    first = dict(s.log.flags[0])
    s.log.flag(first["id"], "error", "raised again", "")  # the first raise of an id wins
    assert s.log.flags[0] == first and len({f["id"] for f in s.log.flags}) == len(s.log.flags)
    # an error-level check stops attribution with CheckFailed (exit code 2) naming the check
    cfg = load_config(run(tmp_path, zoo, base=zoo.base_small_vocab))
    s = open_session(cfg)
    with pytest.raises(CheckFailed, match="tokenizer.vocab_mismatch") as ei:
        run_checks_for_session(s)
    assert ei.value.exit_code == 2


def test_docs_list_every_check():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "checks.md").read_text()
    for cid, c in REGISTRY.items():
        assert f"`{cid}`" in doc, cid
    assert set(REGISTRY) >= {
        "data.no_chat_template", "data.no_supervised_tokens", "data.unreadable_record", "model.not_causal_lm",
        "model.full_finetune", "adapter.not_lora", "adapter.quantized", "adapter.skipped_modules",
        "evaluation.no_eval_set", "attribution.no_capability_target", "memory.logit_upcast",
    }
