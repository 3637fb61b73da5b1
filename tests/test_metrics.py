"""Metrics a user can write (regex, Python), answers that end where a base model's answer ends, the decisive token of
an own-words query, the guard against degenerate scores, and token-level row verdicts: the pure parts, each
against a case that breaks when the behaviour does."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from gradian.capability.metrics import Metric, as_metric, import_metric, metric_from_config
from gradian.config import config_from_dict
from gradian.errors import ConfigError, DataError
from gradian.setup.records import EvalItem, load_eval


def item(answer="", prompt="q?", record=None, **kw):
    return EvalItem("e", 0, answer, prompt=prompt, record=record or {"prompt": prompt, "answer": answer}, **kw)


def cfg(tmp_path, **evaluation):
    return config_from_dict({"model": {"base": "m"}, "data": {"train": "t.jsonl"}, "evaluation": evaluation},
                            root=tmp_path)


# ------------------------------------------------------------------------------------------------ metrics
def test_regex_per_item_answer_and_fixed_pattern_and_negate(tmp_path):
    m = metric_from_config(cfg(tmp_path, metric="regex"))
    assert m.score(item(r"\bParis\b"), "It is Paris.") == 1.0
    assert m.score(item(r"\bParis\b"), "It is Parisian.") == 0.0
    refusal = metric_from_config(cfg(tmp_path, metric="regex", pattern=r"(?i)\bsorry\b", negate=True))
    assert refusal.score(item(), "To boil an egg, ...") == 1.0  # must NOT refuse: passes
    assert refusal.score(item(), "I'm Sorry, I can't.") == 0.0
    assert not refusal.needs_answer and m.needs_answer


def test_bad_patterns_are_errors_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"evaluation.*not a valid regular expression"):
        cfg(tmp_path, metric="regex", pattern="(unclosed")
    with pytest.raises(ConfigError, match="evaluation.negate"):
        cfg(tmp_path, metric="contains", negate=True)
    m = metric_from_config(cfg(tmp_path, metric="regex"))
    with pytest.raises(DataError, match=r"eval.jsonl:3.*not a valid regular expression"):
        m.check_items([item("ok"), item("[a-", source="eval.jsonl:3")])


def test_python_metric_from_the_config_directory_gets_the_record(tmp_path):
    (tmp_path / "my_metric.py").write_text(
        "def score(prompt, generated, item):\n    return float(item['lang'] in generated and prompt == 'q?')\n")
    m = metric_from_config(cfg(tmp_path, metric="python:my_metric:score"))
    it = item(record={"prompt": "q?", "lang": "fr"})
    assert m.score(it, "en fr") == 1.0 and m.score(it, "en") == 0.0
    assert not m.needs_answer and m.generative


def test_python_metric_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot import module 'nope_metric_mod'.*config's directory"):
        metric_from_config(cfg(tmp_path, metric="python:nope_metric_mod:score"))
    (tmp_path / "half_metric.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="has no function 'score'"):
        import_metric("half_metric", "score", tmp_path, "python:half_metric:score")
    (tmp_path / "bad_metric.py").write_text("def score(p, g, i):\n    return 'yes'\n")
    m = metric_from_config(cfg(tmp_path, metric="python:bad_metric:score"))
    with pytest.raises(ConfigError, match=r"returned 'yes' on e.*in \[0, 1\]"):
        m.score(item(), "x")
    with pytest.raises(ConfigError, match="python:module:function"):
        cfg(tmp_path, metric="python:only_module")
    with pytest.raises(ValueError, match="metric_from_config"):
        as_metric("regex")  # a regex needs its settings, never a silent per-item default


def test_eval_records_without_answer_when_the_metric_needs_none(tmp_path):
    p = tmp_path / "eval.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "How do I boil an egg?"}]}) + "\n")
    with pytest.raises(DataError, match="'answer'"):
        load_eval(p)
    items = load_eval(p, need_answer=False)
    assert items[0].answer == "" and items[0].record["messages"][0]["content"].startswith("How")


# ------------------------------------------------------------------------------------------------ answers
def test_one_line_answers_for_plain_prompts_with_one_line_completions():
    from gradian.capability.evaluate import answer_text, one_line_answers
    from gradian.setup.records import Example

    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(ids))
    assert answer_text(tok, [" Paris", "\n", "Question: x"], raw=True, one_line=True) == " Paris"
    assert answer_text(tok, ["\n", " Paris", "\n", "Q"], one_line=True) == "Paris"  # a leading break is not the end
    assert answer_text(tok, [" Paris", "\n", "Q"]) == "Paris\nQ"
    pc = [Example("a", 0, "prompt_completion", {"prompt": "Q:", "completion": " A."})]
    assert one_line_answers(pc, chat=False) and not one_line_answers(pc, chat=True)
    two = pc + [Example("b", 1, "prompt_completion", {"prompt": "Q:", "completion": " line one\nline two"})]
    assert not one_line_answers(two, chat=False)


# ------------------------------------------------------------------------------------------------ decisive token
def test_decisive_token_is_the_first_prefix_the_base_cannot_recover_from(monkeypatch, tmp_path):
    """The fine-tune answers " The capital of Poland is Krakow." where the base answered " Warsaw". The base,
    continuing any prefix that does not yet hold "Krakow", ends with "Warsaw"; the decisive token is " Krakow",
    found by bisection, not the departure " The"."""
    from gradian.attribution import decisive
    from gradian.attribution.queries import new_query
    from helpers_models import build_tokenizer

    tok = build_tokenizer(chat_template=False)
    it = item("Warsaw", prompt="Question: capital of Poland?\nAnswer:")
    q = new_query(0, it.prompt, "Warsaw", "The capital of Poland is Krakow.", "Warsaw", "own_words",
                  " Warsaw", " The capital of Poland is Krakow.", "base")
    calls = []

    def fake_generate(model, tokenizer, prefixes, **kw):
        calls.append(len(prefixes))
        outs = []
        for p in prefixes:
            text = tokenizer.decode(p)
            outs.append(tokenizer(" Warsaw.", add_special_tokens=False)["input_ids"] if "K" not in text.split("Answer:")[-1] else [])
        return outs

    monkeypatch.setattr(decisive, "generate_from", fake_generate)
    # the base would write none of the fine-tune's tokens itself: every prefix is a candidate
    monkeypatch.setattr(decisive, "other_choices", lambda m, t, rows, **kw: [[-1] * len(r.input_ids) for r in rows])
    model = SimpleNamespace(disable_adapter=contextlib.nullcontext, generation_config=SimpleNamespace(eos_token_id=None))
    metric = Metric("contains")
    starts = decisive.decisive_starts(model, tok, [it], [q], metric, chat=False, max_len=64, max_new_tokens=8,
                                      batch_size=4, one_line=False)
    row, other = decisive.answer_rows(tok, it, q, chat=False, max_len=64)
    assert tok.decode(row.input_ids[starts[0]:]).lstrip().startswith("K")
    assert starts[0] > decisive.departure(row, other)
    assert len(calls) >= 3  # the whole answer, the departure token, then bisection rounds
    every = len(calls)

    # The base would itself write every token of the answer but the departure " The" and " K": only those two
    # prefixes can change the continuation, so the search probes them alone and finds the same token.
    k_at, dep = starts[0], decisive.departure(row, other)
    own = [[row.input_ids[p + 1] if p + 1 < len(row.input_ids) and p + 1 not in (dep, k_at) else -1
            for p in range(len(r.input_ids))] for r in [row]]
    monkeypatch.setattr(decisive, "other_choices", lambda m, t, rows, **kw: own)
    calls.clear()
    again = decisive.decisive_starts(model, tok, [it], [q], metric, chat=False, max_len=64, max_new_tokens=8,
                                     batch_size=4, one_line=False)
    assert again == starts
    assert 2 <= len(calls) < every


def test_generation_budgets_cut_each_continuation():
    """`generate_from(..., budgets=...)`: each continuation is at most its budget (the first tokens of the one
    greedy run), a zero budget makes no model call, and the answers come back in the prefixes' order."""
    import torch

    from gradian.capability.evaluate import generate_from
    from transformers import LlamaForCausalLM

    from helpers_models import _llama_config, build_tokenizer

    tok = build_tokenizer(chat_template=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(len(tok))).eval()
    prefixes = [tok("a b", add_special_tokens=False)["input_ids"], tok("c", add_special_tokens=False)["input_ids"],
                tok("d e f", add_special_tokens=False)["input_ids"]]
    full = generate_from(model, tok, prefixes, chat=False, max_new_tokens=6, batch_size=2)
    cut = generate_from(model, tok, prefixes, chat=False, max_new_tokens=6, batch_size=2, budgets=[2, 0, 6])
    assert cut[0] == full[0][:2] and cut[1] == [] and cut[2] == full[2]


# ------------------------------------------------------------------------------------------------ guards
def test_zero_queries_and_flat_scores_are_degenerate():
    from gradian.attribution.scoring import degenerate

    assert degenerate(np.zeros(3), np.arange(5.0))[0] == "attribution.zero_query"
    assert degenerate(np.ones(3), np.full(5, 0.25))[0] == "attribution.flat_scores"
    assert degenerate(np.ones(3), np.array([0.1, np.nan]))[0] == "attribution.flat_scores"
    assert degenerate(np.array([0.0, 1.0]), np.arange(5.0)) is None


def test_row_verdict_looks_at_tokens_not_the_mean():
    """A planted wrong fact differs from a true row in one token: its mean loss under the base is low, but that
    token was unlikely and the fine-tune learned it."""
    from gradian.explain.blame import row_verdict

    base = np.array([0.05, 0.1, 0.02, 9.0, 0.1])  # mean 1.85 but only " Osaka" is surprising
    tuned = np.array([0.01, 0.02, 0.01, 0.05, 0.02])
    assert row_verdict(base, tuned) == "taught"
    assert row_verdict(base[[0, 1, 2, 4]], tuned[[0, 1, 2, 4]]) == "base_believed"
    assert row_verdict(base, base) == "not_learned"
    assert row_verdict(np.array([0.1]), np.array([0.1, 0.2])) == "unknown"


# ------------------------------------------------------------------------------------------------ recipes
def test_callback_reads_the_loss_mode_from_the_trained_labels():
    from gradian.integrations.callback import _loss_mode

    ds = SimpleNamespace(column_names=["input_ids", "labels"], __getitem__=None)
    masked = {"labels": [[-100, -100, 5, 6], [-100, 7]]}
    full = {"labels": [[4, 5, 6], [7, 8]]}

    class DS(dict):
        column_names = ["input_ids", "labels"]

    args = SimpleNamespace(completion_only_loss=None, assistant_only_loss=False)
    assert _loss_mode(DS(masked), args) == "supervised"  # TRL's default for prompt-completion data
    assert _loss_mode(DS(full), args) == "all"  # TRL's default for messages without generation tags
    assert _loss_mode(None, SimpleNamespace(completion_only_loss=True, assistant_only_loss=False)) == "supervised"
    del ds


def test_not_converged_reads_a_trainers_state_and_spares_a_fitted_run(tmp_path):
    from gradian.checks.convergence import _curve_share, not_converged

    out = tmp_path / "trl-out"
    ck = out / "checkpoint-30"
    ck.mkdir(parents=True)

    def state(losses):
        hist = [{"step": i + 1, "loss": l, "learning_rate": 1e-3} for i, l in enumerate(losses)]
        (ck / "trainer_state.json").write_text(json.dumps({"num_train_epochs": 3, "max_steps": 30,
                                                           "log_history": hist}))

    state([1.0] * 10 + [0.5] * 10 + [0.12] * 10)  # the last epoch made 42% of the descent, but the rows are fitted
    share, means, src = _curve_share(None, str(out))
    assert src.endswith("trainer_state.json") and share > 0.1 and not not_converged(share, means)
    state([2.0] * 10 + [1.6] * 10 + [1.2] * 10)  # still descending, far from fitted
    share, means, _ = _curve_share(None, str(out))
    assert not_converged(share, means)
