"""Behaviour queries (`attribution.behaviour`) on the tiny model: sampled answers are seeded and labelled by the
metric, the weights are the verdict's mean difference, and the query gradient equals a naive reference (one
example per plain autograd backward, no hooks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradian.attribution.behaviour import Sample, behaviour_weights, sample_answers, with_samples
from gradian.attribution.queries import new_query, query_losses, query_vectors
from gradian.capability.metrics import Metric
from gradian.grads.capture import GradientCapture
from gradian.grads.layout import site_shapes
from gradian.projection import Projector
from gradian.setup.model import lora_sites
from gradian.setup.records import EvalItem
from gradian.setup.tokenize import eval_answer_example, tokenize_example

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import with_random_lora_b
    from gradian.demo.tiny import TinySpec, build_tiny_base

    path = build_tiny_base(TinySpec(), progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return with_random_lora_b(get_peft_model(base, lcfg)), tok


def _items():
    return [EvalItem(f"eval-{i}", i, "x", messages=[{"role": "user", "content": q}])
            for i, q in enumerate(["Where does Rodrol live?", "What does Tato keep?"])]


def test_weights_are_the_mean_over_the_fine_tunes_side():
    ss = [Sample("no", "tuned", False), Sample("nope", "base", False), Sample("yes", "base", True),
          Sample("", "tuned", False)]
    w = dict(behaviour_weights(ss, "regression"))
    assert w == {"no": -0.5, "nope": -0.5}  # L_q = mean log-lik of the failing answers (empty ones dropped)
    assert dict(behaviour_weights(ss, "improvement")) == {"yes": 1.0}  # minus that of the passing ones
    q = new_query(0, "p", "x", "g", "b", "own_words")
    greedy, = with_samples([q], [(Sample("yes", "tuned", True),)], "regression")
    # no failing answer among the samples: the fine-tune's greedy (failing) answer alone is the class
    assert greedy.formulation == "behaviour" and greedy.samples == (("g", -1.0),)
    empty = new_query(0, "p", "x", " ", "b", "own_words")
    kept, = with_samples([empty], [(Sample("yes", "tuned", True),)], "regression")
    assert kept is empty  # and with no greedy answer either, the own-words query stays
    imp, = with_samples([q], [(Sample("yes", "tuned", True),)], "improvement")
    assert imp.formulation == "behaviour" and imp.samples == (("yes", 1.0),)


def test_samples_are_seeded_and_labelled_by_the_metric(tiny):
    model, tok = tiny
    items = _items()
    qs = [new_query(it.position, it.question_text(), "x", "", "", "own_words") for it in items]
    metric = Metric("regex", pattern=r"[aeiou]{2}", negate=True)  # "fails" when two vowels follow each other
    kw = dict(chat=True, n=4, max_new_tokens=6, seed=3, one_line=False, temperature=1.0)
    a = sample_answers(model, tok, items, qs, metric, **kw)
    b = sample_answers(model, tok, items, qs, metric, **kw)
    assert a == b and [len(x) for x in a] == [4, 4]
    assert [s.source for s in a[0]] == ["tuned"] * 4  # the fine-tune alone, by default
    both = sample_answers(model, tok, items, qs, metric, **kw, sources=("tuned", "base"))
    assert [s.source for s in both[0]] == ["tuned"] * 4 + ["base"] * 4
    assert both[0][:4] == a[0]  # each model's draws are seeded apart: asking for the base changes no tuned sample
    assert all(s.passes == (metric.score(items[0], s.text) >= 0.5) for s in a[0])
    torch.manual_seed(11)
    before = torch.rand(1)
    torch.manual_seed(11)
    sample_answers(model, tok, items, qs, metric, **kw)
    assert torch.rand(1) == before  # the global RNG is left as it was
    c = sample_answers(model, tok, items, qs, metric, **{**kw, "seed": 4})
    assert c != a


def test_items_sampled_together_draw_what_each_items_own_generate_draws(tiny, monkeypatch):
    """`sample_answers` draws several items in one left-padded `generate` call, each from its own generator: every
    item's answers are those of `model.generate(do_sample=True)` on its prompt alone, seeded as the item's own call
    always was (the sampler before items were batched), and one item per call draws the same."""
    from gradian.attribution import behaviour
    from gradian.capability.evaluate import _stop_ids, answer_text
    from gradian.setup.tokenize import eval_prompt_ids

    model, tok = tiny
    items = [EvalItem(f"eval-{i}", i, "x", messages=[{"role": "user", "content": q}]) for i, q in
             enumerate(["Where does Rodrol live?", "What does Tato keep in his small house by the sea?", "Why?"])]
    qs = [new_query(it.position, it.question_text(), "x", "", "", "own_words") for it in items]
    metric = Metric("regex", pattern=r"[aeiou]{2}", negate=True)
    n, temp, seed = 4, 1.0, 3
    kw = dict(chat=True, n=n, max_new_tokens=6, seed=seed, one_line=False, temperature=temp)
    got = sample_answers(model, tok, items, qs, metric, **kw)
    stops = _stop_ids(tok, model, True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for it, samples in zip(items, got):
        ids = torch.tensor([eval_prompt_ids(tok, it, True)])
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 2 * it.position)
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temp,
                              top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=6, pad_token_id=pad,
                              eos_token_id=stops or None)
        want = []
        for row in seqs[:, ids.shape[1]:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            want.append(answer_text(tok, row[:cut]))
        assert [s.text for s in samples] == want
    assert any(len({s.text for s in x}) > 1 for x in got)  # draws, not one answer n times
    monkeypatch.setattr(behaviour, "SAMPLE_ROWS", n)  # one item per call
    assert sample_answers(model, tok, items, qs, metric, **kw) == got


def test_the_temperature_reaches_the_sampler_and_the_settings_reach_the_query(tiny, monkeypatch):
    from types import SimpleNamespace

    import gradian.attribution.behaviour as behaviour
    from gradian.capability.evaluate import generate_answers
    from gradian.config import AttributionConfig

    model, tok = tiny
    items = _items()
    qs = [new_query(it.position, it.question_text(), "x", "", "", "own_words") for it in items]
    metric = Metric("regex", pattern=r"[aeiou]{2}", negate=True)
    kw = dict(chat=True, n=4, max_new_tokens=6, seed=3, one_line=False)
    hot = sample_answers(model, tok, items, qs, metric, **kw, temperature=1.0)
    cold = sample_answers(model, tok, items, qs, metric, **kw, temperature=1e-4)
    greedy = generate_answers(model, tok, items, chat=True, max_new_tokens=6, batch_size=2, one_line=False)
    # at a vanishing temperature every draw is the greedy answer; at 1 they spread
    assert [{s.text for s in x} for x in cold] == [{g} for g in greedy]
    assert any(len({s.text for s in x}) > 1 for x in hot)
    seen = {}

    def fake(*a, **k):
        seen.update(k)
        return [() for _ in a[3]]

    from gradian import pipeline

    monkeypatch.setattr(pipeline, "sample_answers", fake)
    cfg = SimpleNamespace(attribution=AttributionConfig(behaviour_samples=5, behaviour_temperature=0.3),
                          evaluation=SimpleNamespace(max_new_tokens=7), seed=2)
    s = SimpleNamespace(model=model, tokenizer=tok, eval_items=items, metric=metric, chat=True, one_line=False, cfg=cfg)
    pipeline.behaviour_queries(s, qs, "regression")
    assert (seen["n"], seen["temperature"], seen["max_new_tokens"], seen["seed"]) == (5, 0.3, 7, 2)
    assert AttributionConfig().behaviour_samples == 16 and AttributionConfig().behaviour_temperature == 0.7


def test_behaviour_query_gradient_equals_one_backward_per_answer(tiny):
    model, tok = tiny
    items = _items()
    samples = [(Sample("He lives in Lima.", "tuned", False), Sample("Lima, I think.", "base", False),
                Sample("In Oslo.", "base", True)),
               (Sample("A crow.", "tuned", False), Sample("Tato keeps a small black crow.", "tuned", False),
                Sample("A crow.", "tuned", False),  # a repeated answer: one row of twice the weight
                Sample("A dog.", "base", True), Sample("Nothing at all.", "base", True))]
    qs = [new_query(it.position, it.question_text(), "x", "", "", "own_words") for it in items]
    qs = with_samples(qs, samples, "regression")
    assert [q.formulation for q in qs] == ["behaviour", "behaviour"]
    from gradian.attribution.queries import query_rows

    rows, sign, owner, _ = query_rows(tok, items, qs, chat=True, max_len=64)
    assert len(rows) == 4 and sorted(sign)[0] == -2 / 3  # 5 failing samples, 4 distinct answers
    sites, _ = lora_sites(model)
    cap = GradientCapture(model, sites, Projector(site_shapes(sites)))
    got = query_vectors(cap, tok, items, qs, chat=True, max_len=64, batch_size=3).double().numpy()

    params = [p for s in sites for p in (s.A.weight, s.B.weight)]
    for p in params:
        p.requires_grad_(True)

    def grad(row):
        for p in params:
            p.grad = None
        ids = torch.tensor([row.input_ids])
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        (-(lp * torch.tensor(row.supervised[1:], dtype=torch.float32)).sum()).backward()
        return torch.cat([p.grad.reshape(-1) for p in params]).double().numpy()

    want = np.zeros_like(got)
    loss_want = np.zeros(len(qs))
    for j, (q, it) in enumerate(zip(qs, items)):
        for text, w in q.samples:
            row = tokenize_example(tok, eval_answer_example(it, text, True), 64)
            want[j] += w * grad(row)
            with torch.no_grad():
                ids = torch.tensor([row.input_ids])
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
                loss_want[j] += w * float(-(lp * torch.tensor(row.supervised[1:], dtype=torch.float32)).sum())
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6 * np.abs(want).max())
    # and the scalar the vector is the gradient of
    losses = query_losses(model, tok, items, qs, chat=True, max_len=64, batch_size=3)
    np.testing.assert_allclose(losses, loss_want, rtol=1e-4)
