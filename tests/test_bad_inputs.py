"""The bad-input contract: for every verb, unusable input is one clear paragraph naming the file:line, key path or
module, exit code 2 (diagnose: exit 1 with the failing check, or 2 for an invalid config), no traceback unless
--debug, and no partial outputs (report, index shards, adapter) under the output directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from typer.testing import CliRunner

from gradian.cli import app

from helpers_models import GOOD_EVAL, GOOD_TRAIN, chat, session_zoo, write_run

torch.set_num_threads(1)
runner = CliRunner()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return session_zoo(tmp_path_factory)


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.is_dir() else []


@dataclass
class Case:
    id: str
    verb: str  # diagnose | evaluate | index | attribute | train
    make: Callable  # (tmp_path, zoo) -> (config path, extra CLI args)
    needles: list[str]  # must appear in the message (whitespace-insensitive); "{run}" is the run dir
    check: Optional[str] = None  # the check `diagnose` must fail on the same input
    check_level: str = "error"
    diag_code: Optional[int] = None  # diagnose's exit code when it is not a failed check (2: invalid config)
    marks: list = field(default_factory=list)
    check_needles: Optional[list[str]] = None  # in the check's message; default: the needles naming a file under {run}
    diagnosable: bool = True  # False: only a run finds it (a metric that misbehaves on the answers), diagnose passes

    def diag_needles(self) -> list[str]:
        return self.check_needles if self.check_needles is not None else [n for n in self.needles if "{run}" in n]


def cfg(tmp, zoo, *, base=None, adapter="default", **kw):
    """A run dir with good defaults; train.output keeps `gradian train` inside run/out."""
    extra = kw.pop("extra", {})
    extra.setdefault("train", {"output": "out/adapter"})
    adapter = zoo.adapter if adapter == "default" else adapter
    return write_run(tmp / "run", base or zoo.base, adapter, extra=extra, **kw), []


def with_file(name: str, data: bytes, key: str = "train"):
    def make(tmp, zoo):
        path, args = cfg(tmp, zoo)
        (tmp / "run" / name).write_bytes(data)
        return path, args + ["--set", f"data.{key}={name}"]
    return make


def raw(text: str):
    def make(tmp, zoo):
        return write_run(tmp / "run", zoo.base, zoo.adapter, raw_config=text), []
    return make


def sets(*overrides: str, **kw):
    def make(tmp, zoo):
        path, args = cfg(tmp, zoo, **kw)
        for o in overrides:
            args += ["--set", o]
        return path, args
    return make


def adapter_variant(name: str, **changes):
    return lambda tmp, zoo: cfg(tmp, zoo, adapter=zoo.variant(name, zoo.adapter, **changes))


def adapter_edit(name: str, edit: Callable[[Path], None]):
    def make(tmp, zoo):
        ad = zoo.variant(name, zoo.adapter)
        edit(ad)
        return cfg(tmp, zoo, adapter=ad)
    return make


def no_weights(ad: Path) -> None:
    (ad / "adapter_model.safetensors").unlink(missing_ok=True)


def list_config(ad: Path) -> None:
    (ad / "adapter_config.json").write_text("[1, 2, 3]")


def output_is_file(tmp, zoo):
    path, args = cfg(tmp, zoo)
    (tmp / "run" / "out").write_text("not a directory")
    return path, args


def train_is_dir(tmp, zoo):
    path, args = cfg(tmp, zoo)
    (tmp / "run" / "data_dir").mkdir()
    (tmp / "run" / "data_dir" / "part-0.jsonl").write_text(json.dumps(GOOD_TRAIN[0]) + "\n")
    return path, args + ["--set", "data.train=data_dir"]


def unreadable(tmp, zoo):
    path, args = cfg(tmp, zoo)
    os.chmod(tmp / "run" / "train.jsonl", 0)
    return path, args


def with_module(name: str, source: str, *overrides: str):
    """A Python metric module beside gradian.yaml, and the overrides that use it."""
    def make(tmp, zoo):
        path, args = cfg(tmp, zoo)
        (tmp / "run" / name).write_text(source)
        for o in overrides:
            args += ["--set", o]
        return path, args
    return make


def config_is_dir(tmp, zoo):
    d = tmp / "configs"
    d.mkdir()
    return d, []


def missing_config(tmp, zoo):
    return tmp / "nope.yaml", []


BAD_UTF8 = (json.dumps(GOOD_TRAIN[0]) + "\n" + json.dumps(GOOD_TRAIN[1]) + "\n").encode() + b'{"text": "caf\xe9 \xff"}\n'
SYSTEM_CHAT = {"messages": [{"role": "system", "content": "be brief"}] + chat("q?", "a.")["messages"]}
ROOT_ONLY = pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                               reason="running as root: chmod 000 does not stop reads (the directory case covers it)")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

CASES = [
    # ---- the config file and --set: exit 2 from every verb, diagnose included
    Case("config_not_found", "attribute", missing_config, ["nope.yaml", "config file not found"], diag_code=2),
    Case("config_is_dir", "train", config_is_dir, ["configs", "without a gradian.yaml"], diag_code=2),
    Case("yaml_syntax", "index", raw("model:\n  base: m\ndata:\n  train: [unclosed\n"), ["gradian.yaml:", "invalid YAML"],
         diag_code=2),
    Case("yaml_not_mapping", "diagnose", raw("- model\n- data\n"), ["gradian.yaml", "expected a mapping"], diag_code=2),
    Case("yaml_empty", "evaluate", raw(""), ["missing required key 'model'"], diag_code=2),
    Case("unknown_key", "attribute", sets(extra={"grads": {"projection_dims": 64}}),
         ["unknown key 'grads.projection_dims'"], diag_code=2),
    Case("negative_batch_size", "train", sets(extra={"grads": {"batch_size": -4}}), ["grads.batch_size", "-4"],
         diag_code=2),
    Case("wrong_type", "evaluate", sets(extra={"evaluation": {"confidence": "high"}}), ["evaluation.confidence", "high"],
         diag_code=2),
    Case("missing_key", "index", raw("model:\n  adapter: a\ndata:\n  train: t.jsonl\n"), ["missing required key 'model.base'"],
         diag_code=2),
    Case("set_bad_value", "attribute", sets("grads.batch_size=abc"), ["grads.batch_size", "abc"], diag_code=2),
    Case("set_without_equals", "evaluate", sets("grads.batch_size"), ["--set", "KEY.PATH=VALUE"], diag_code=2),
    Case("set_into_a_value", "diagnose", sets("model.base.name=x"), ["model.base.name", "'base' is not a section"],
         diag_code=2),
    Case("set_unknown_key", "index", sets("grads.nope=1"), ["unknown key 'grads.nope'"], diag_code=2),
    Case("output_is_a_file", "attribute", output_is_file, ["'output'", "{run}/out", "is a file"], diag_code=2),
    # ---- the metric (issue 20): a bad pattern, a Python metric that does not import or misbehaves
    Case("bad_regex_pattern", "attribute", sets(extra={"evaluation": {"metric": "regex", "pattern": "(unclosed"}}),
         ["evaluation.pattern", "not a valid regular expression", "(unclosed"], diag_code=2),
    Case("pattern_without_regex", "attribute", sets(extra={"evaluation": {"negate": True}}),
         ["evaluation.negate", "metric: regex"], diag_code=2),
    Case("metric_not_a_metric", "evaluate", sets("evaluation.metric=bleu"), ["evaluation.metric", "bleu",
                                                                            "python:module:function"], diag_code=2),
    Case("metric_import_fails", "attribute", sets("evaluation.metric=python:no_such_metrics:score"),
         ["evaluation.metric", "no_such_metrics", "cannot import", "the config's directory"],
         check="evaluation.metric", check_needles=["evaluation.metric", "no_such_metrics"]),
    Case("metric_module_raises_on_import", "attribute",
         with_module("broken_metric.py", "import not_a_package\n", "evaluation.metric=python:broken_metric:score"),
         ["evaluation.metric", "broken_metric", "ModuleNotFoundError", "not_a_package"],
         check="evaluation.metric", check_needles=["broken_metric"]),
    Case("metric_function_missing", "evaluate",
         with_module("my_metric.py", "def other(p, g, i):\n    return 1.0\n", "evaluation.metric=python:my_metric:score"),
         ["evaluation.metric", "my_metric", "has no function 'score'"],
         check="evaluation.metric", check_needles=["has no function 'score'"]),
    Case("metric_returns_out_of_range", "evaluate",
         with_module("wide_metric.py", "def score(p, g, i):\n    return 7\n", "evaluation.metric=python:wide_metric:score"),
         ["evaluation.metric", "returned 7", "in [0, 1]"], diagnosable=False),
    Case("eval_answer_not_a_regex", "attribute",
         lambda t, z: cfg(t, z, eval=GOOD_EVAL[:2] + [{"prompt": "q?", "answer": "[a-"}],
                          extra={"evaluation": {"metric": "regex"}, "train": {"output": "out/adapter"}}),
         ["{run}/eval.jsonl:3", "not a valid regular expression", "[a-"],
         check="evaluation.metric", check_needles=["eval.jsonl:3", "[a-"]),
    # ---- paths
    Case("missing_base", "attribute", sets("model.base=./no_such_model"), ["model.base", "no_such_model", "does not exist"],
         check="config.paths", check_needles=["model.base", "no_such_model"]),
    Case("missing_adapter", "index", sets("model.adapter=./no_such_adapter"), ["model.adapter", "no_such_adapter"],
         check="config.paths", check_needles=["model.adapter", "no_such_adapter"]),
    Case("missing_checkpoint_adapter", "attribute", sets("attribution.checkpoint_adapters=[./no_such_ckpt]"),
         ["attribution.checkpoint_adapters[0]", "no_such_ckpt"],
         check="config.paths", check_needles=["attribution.checkpoint_adapters[0]", "no_such_ckpt"]),
    Case("missing_train", "evaluate", sets("data.train=missing.jsonl"), ["{run}/missing.jsonl", "not found"],
         check="config.paths"),
    Case("train_is_a_directory", "train", train_is_dir, ["{run}/data_dir", "is a directory"],
         check="data.unreadable_record"),
    Case("unreadable_permissions", "attribute", unreadable, ["train.jsonl", "cannot read"], check="data.unreadable_record",
         marks=[ROOT_ONLY]),
    # ---- data records: the message names file:line
    Case("malformed_json_line", "attribute", lambda t, z: cfg(t, z, train=[GOOD_TRAIN[0], "{not json", GOOD_TRAIN[1]]),
         ["{run}/train.jsonl:2", "invalid JSON"], check="data.unreadable_record"),
    Case("wrong_field_type", "train", lambda t, z: cfg(t, z, train=[{"prompt": "q", "completion": 3}]),
         ["{run}/train.jsonl:1", "'completion' must be a string"], check="data.invalid_record"),
    Case("unknown_record_shape", "index", lambda t, z: cfg(t, z, train=[GOOD_TRAIN[0], {"question": "q", "reply": "r"}]),
         ["{run}/train.jsonl:2", "unknown record shape", "question"], check="data.unknown_record_shape"),
    Case("not_an_object", "attribute", lambda t, z: cfg(t, z, train=[GOOD_TRAIN[0], "[1, 2]"]),
         ["{run}/train.jsonl:2", "expected a JSON object"], check="data.unknown_record_shape"),
    Case("empty_train_file", "attribute", lambda t, z: cfg(t, z, train=[]), ["{run}/train.jsonl", "no records"],
         check="data.empty"),
    Case("blank_eval_file", "evaluate", lambda t, z: cfg(t, z, eval=["", "   "]), ["{run}/eval.jsonl", "no records"],
         check="data.empty"),
    Case("non_utf8_bytes", "attribute", with_file("latin1.jsonl", BAD_UTF8), ["{run}/latin1.jsonl:3", "not UTF-8"],
         check="data.unreadable_record"),
    Case("line_of_30_mib", "index", with_file("huge.jsonl", b'{"text": "' + b"a" * (30 * 2**20) + b'"}\n'),
         ["{run}/huge.jsonl:1", "MiB limit"], check="data.unreadable_record"),
    Case("json_not_a_list", "index", with_file("train.json", b'{"rows": 3}'), ["{run}/train.json:1", "JSON list"],
         check="data.unreadable_record"),
    Case("unsupported_extension", "attribute", with_file("train.tsv", b"prompt\tcompletion\nq\ta\n"),
         ["{run}/train.tsv", "unsupported file type"], check="data.unreadable_record"),
    Case("eval_without_answer", "evaluate", lambda t, z: cfg(t, z, eval=GOOD_EVAL[:2] + [{"prompt": "q?"}]),
         ["{run}/eval.jsonl:3", "'answer'"], check="data.unknown_record_shape"),
    Case("eval_ends_with_answer", "evaluate",
         lambda t, z: cfg(t, z, eval=[{**chat("q?", "a."), "answer": "a."}]),
         ["{run}/eval.jsonl:1", "must end with a user turn"], check="data.invalid_record"),
    Case("no_assistant_turn", "attribute",
         lambda t, z: cfg(t, z, train=[{"messages": [{"role": "user", "content": "hello?"}]}]),
         ["{run}/train.jsonl:1", "no assistant turn"], check="data.invalid_record"),
    Case("unknown_role", "train",
         lambda t, z: cfg(t, z, train=[{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}]),
         ["{run}/train.jsonl:1", "messages[0].role"], check="data.invalid_record"),
    Case("template_rejects_record", "index", lambda t, z: cfg(t, z, base=z.base_strict_template, train=[SYSTEM_CHAT]),
         ["{run}/train.jsonl:1", "chat template", "System role not supported"], check="data.tokenize_failed"),
    # ---- models and adapters: the message names the key and the module/file
    Case("full_finetune_as_adapter", "attribute", lambda t, z: cfg(t, z, adapter=z.base),
         ["model.full_finetune", "config.json"], check="model.full_finetune",
         check_needles=["model.adapter", "config.json"]),
    Case("seq_cls_adapter", "attribute", adapter_variant("adapter_seqcls", task_type="SEQ_CLS"),
         ["adapter_config.json", "SEQ_CLS", "adapter.task_type"], check="adapter.task_type",
         check_needles=["adapter_config.json", "SEQ_CLS"]),
    Case("adapter_for_another_base", "index", lambda t, z: cfg(t, z, adapter=z.adapter_wide),
         ["model.adapter", "adapter.base_mismatch", "[4, 48]", "[4, 32]"], check="adapter.base_mismatch",
         check_needles=["model.adapter", "[4, 48]", "[4, 32]"]),
    Case("ia3_adapter", "index", adapter_variant("adapter_IA3", peft_type="IA3"), ["adapter_config.json", "'IA3'",
                                                                                    "adapter.not_lora"],
         check="adapter.not_lora", check_needles=["adapter_config.json", "IA3"]),
    Case("prefix_tuning_adapter", "attribute", adapter_variant("adapter_PREFIX_TUNING", peft_type="PREFIX_TUNING"),
         ["adapter_config.json", "PREFIX_TUNING"], check="adapter.not_lora",
         check_needles=["adapter_config.json", "PREFIX_TUNING"]),
    Case("adapter_config_not_object", "attribute", adapter_edit("adapter_listcfg", list_config),
         ["adapter_config.json", "expected a JSON object"], check="adapter.unreadable",
         check_needles=["adapter_config.json", "expected a JSON object"]),
    Case("adapter_without_weights", "index", adapter_edit("adapter_noweights2", no_weights),
         ["adapter_model.safetensors"], check="adapter.unreadable", check_needles=["adapter_model.safetensors"]),
    Case("embedding_only_lora", "attribute", lambda t, z: cfg(t, z, adapter=z.adapter_embed_only),
         ["model.adapter", "no LoRA Linear sites", "embed_tokens"], check="adapter.skipped_modules",
         check_needles=["model.adapter", "embed_tokens"]),
    Case("module_filter_matches_nothing", "index", sets("grads.module_filter=[nonexistent_proj]"),
         ["grads.module_filter", "nonexistent_proj"], check="adapter.skipped_modules",
         check_needles=["grads.module_filter", "nonexistent_proj"]),
    Case("encoder_base", "attribute", lambda t, z: cfg(t, z, base=z.base_bert),
         ["model.base", "model.not_causal_lm", "BertModel"], check="model.not_causal_lm",
         check_needles=["model.base", "BertModel"]),
    Case("seq_cls_base", "evaluate", lambda t, z: cfg(t, z, base=z.base_seqcls),
         ["model.base", "LlamaForSequenceClassification"], check="model.not_causal_lm",
         check_needles=["model.base", "LlamaForSequenceClassification"]),
    Case("adapter_dir_as_base", "evaluate", lambda t, z: cfg(t, z, base=z.adapter),
         ["model.base", "LoRA adapter directory"], check="model.load_failed",
         check_needles=["model.base", "LoRA adapter directory"]),
    Case("corrupt_base_weights", "attribute", lambda t, z: cfg(t, z, base=z.base_corrupt_weights),
         ["model.base", "cannot load the model"], check="model.load_failed",
         check_needles=["model.base"]),
    Case("base_without_tokenizer", "train", lambda t, z: cfg(t, z, base=z.base_no_tokenizer),
         ["model.base", "tokenizer"], check="tokenizer.load_failed",
         check_needles=["model.base", "tokenizer"]),
    Case("cuda_not_available", "attribute", sets("model.device=cuda"), ["model.device", "cuda"],
         check="device.unavailable", marks=[NO_CUDA],
         check_needles=["model.device", "cuda"]),
]


def _params():
    return [pytest.param(c, id=c.id, marks=c.marks) for c in CASES]


@pytest.mark.parametrize("case", _params())
def test_bad_input(case: Case, tmp_path, zoo):
    cfg_path, args = case.make(tmp_path, zoo)
    run_dir = tmp_path / "run"
    out = run_dir / "out"
    before = files_under(out) if out.is_dir() else None
    res = runner.invoke(app, [case.verb, str(cfg_path), *args])
    text = res.output
    expected = 2 if case.verb != "diagnose" else (case.diag_code or 1)
    assert res.exit_code == expected, (res.exit_code, text, repr(res.exception))
    assert "Traceback" not in text
    if case.verb != "diagnose" or case.diag_code:
        assert text.count("error:") == 1, text  # one paragraph (loaders' progress bars may precede it)
        text = text[text.index("error:"):]
    for n in case.needles:
        n = n.replace("{run}", str(run_dir))
        assert squash(n) in squash(text), (n, text)
    # nothing partial under the output dir: no report, scores, capability, index shards or adapter
    if out.is_dir():
        assert files_under(out) == (before or []), files_under(out)
    assert not any(run_dir.glob("**/report.json")) and not any(run_dir.glob("**/report.html"))
    if case.id == "output_is_a_file":
        assert out.read_text() == "not a directory"

    # the same input through `diagnose`: a failed check naming the same place, or exit 2 for an invalid config
    if case.verb == "diagnose" or not case.diagnosable:
        return
    dargs = ["diagnose", str(cfg_path), *args, "--json"]
    dres = runner.invoke(app, dargs)
    if case.diag_code:
        assert dres.exit_code == case.diag_code, (dres.exit_code, dres.output)
        for n in case.needles:
            assert squash(n.replace("{run}", str(run_dir))) in squash(dres.output)
        return
    assert dres.exit_code == (1 if case.check_level == "error" else 0), dres.output
    rows = {r["id"]: r for r in json.loads(dres.stdout)}
    r = rows[case.check]
    assert r["status"] == "fail" and r["level"] == case.check_level, r
    for n in case.diag_needles():
        assert squash(n.replace("{run}", str(run_dir))) in squash(r["message"]), (n, r["message"])


def test_at_least_25_cases_cover_every_verb():
    assert len(CASES) >= 25
    assert {c.verb for c in CASES} == {"diagnose", "evaluate", "index", "attribute", "train"}


def test_tokenizer_without_chat_template_warns_and_exits_0(tmp_path, zoo):
    path, _ = cfg(tmp_path, zoo, base=zoo.base_no_template)
    res = runner.invoke(app, ["diagnose", str(path), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in json.loads(res.stdout)}
    r = rows["data.no_chat_template"]
    assert (r["status"], r["level"]) == ("fail", "warning")
    assert str(zoo.base_no_template) in r["message"]


def test_debug_shows_the_traceback(tmp_path, zoo):
    path, _ = cfg(tmp_path, zoo, train=["{not json"])
    res = runner.invoke(app, ["--debug", "attribute", str(path)])
    assert res.exit_code != 0
    from gradian.errors import DataError

    assert isinstance(res.exception, DataError)


def test_train_target_modules_not_in_base(tmp_path, zoo):
    path, _ = cfg(tmp_path, zoo, extra={"train": {"output": "out/adapter", "target_modules": ["c_attn"]}})
    res = runner.invoke(app, ["train", str(path)])
    assert res.exit_code == 2 and "train.target_modules" in squash(res.output)
    assert not files_under(tmp_path / "run" / "out")


def test_real_process_exit_code_and_no_traceback(tmp_path, zoo):
    """Through a real `gradian` process: exit code 2, stderr holds one paragraph naming file:line, no traceback."""
    path, _ = cfg(tmp_path, zoo, train=[GOOD_TRAIN[0], "{not json"])
    env = {**os.environ, "GRADIAN_THREADS": "1", "COLUMNS": "400"}
    cmd = [sys.executable, "-c", "from gradian.cli import main; main()", "attribute", str(path)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.startswith("error:")
    assert f"{tmp_path / 'run' / 'train.jsonl'}:2" in p.stderr
    assert p.stdout == ""
    assert not files_under(tmp_path / "run" / "out")
