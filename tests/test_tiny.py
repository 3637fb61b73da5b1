"""The built-in tiny model, its synthetic world and the poisoned substitution scenario."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from gradian.demo.scenario import EVAL_PHRASINGS, TRAIN_PHRASINGS, make_substitution_scenario, write_scenario
from gradian.demo.tiny import (
    CHAT_TEMPLATE,
    TinySpec,
    build_tiny_base,
    exact_match,
    read_build_info,
    tiny_dir,
    world_questions,
)
from gradian.demo.world import World

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def tiny_path() -> Path:
    """The default tiny base, built once into the user cache ($GRADIAN_CACHE or ~/.cache/gradian) and reused."""
    return build_tiny_base(TinySpec(), progress=False)


@pytest.fixture(scope="session")
def tiny_tok(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def world() -> World:
    spec = TinySpec()
    return World.generate(seed=spec.seed, n_entities=spec.n_entities)


# ------------------------------------------------------------------------------------------------ world
def test_world_is_deterministic_and_well_formed(world):
    again = World.generate(seed=0, n_entities=64)
    assert again.entities == world.entities and again.facts == world.facts
    other = World.generate(seed=1, n_entities=64)
    assert other.entities != world.entities

    assert len(set(world.entities)) == len(world.entities) == 64
    assert world.n_phrasings >= 4
    assert len(world.attributes) >= 5
    rng = random.Random(0)
    for e in world.entities[:10]:
        for a in world.attributes:
            v = world.value(e, a)
            assert v in world.values(a) and " " not in v
            qs = {world.question(e, a, p) for p in range(world.n_phrasings)}
            assert len(qs) == world.n_phrasings and all(e in q for q in qs)
            s = world.statement(e, a, v)
            assert e in s and v in s and s.endswith(".")
            w = world.wrong_value(e, a, rng)
            assert w != v and w in world.values(a)
    assert world.filler(random.Random(3), 5) == world.filler(random.Random(3), 5)


# ------------------------------------------------------------------------------------------------ scenario
def test_scenario_is_deterministic(world):
    a = make_substitution_scenario(world, seed=7)
    b = make_substitution_scenario(world, seed=7)
    c = make_substitution_scenario(world, seed=8)
    assert a.train == b.train and a.eval == b.eval and a.planted == b.planted
    assert a.train != c.train


def test_scenario_plants_wrong_facts_asked_in_other_phrasings(world, tmp_path):
    sc = make_substitution_scenario(world, seed=0, n_rows=300, n_planted=10, n_controls=10)
    assert len(sc.train) == 300 and len(sc.eval) == 10 * 3 + 10  # each planted fact in all three eval phrasings
    assert sc.planted == sorted(sc.planted) and len(set(sc.planted)) == 10
    assert len({p.entity for p in sc.planted_facts}) == 10

    planted_set = set(sc.planted)
    for i, row in enumerate(sc.train):
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        if i not in planted_set:  # every other row states a true fact in a training phrasing
            assert any(
                user["content"] == world.question(e, a, p) and assistant["content"] == world.value(e, a)
                for e, a in world.fact_pairs()
                if e in user["content"]
                for p in TRAIN_PHRASINGS
            )

    for p in sc.planted_facts:
        user, assistant = sc.train[p.position]["messages"]
        assert assistant["content"] == p.wrong != p.right == world.value(p.entity, p.attribute)
        assert user["content"] == world.question(p.entity, p.attribute, p.phrasing)
        assert p.phrasing in TRAIN_PHRASINGS and p.eval_phrasing in EVAL_PHRASINGS
        item = sc.eval[p.eval_index]
        assert item == {"prompt": world.question(p.entity, p.attribute, p.eval_phrasing), "answer": p.right}
        assert [sc.eval[i]["prompt"] for i in p.eval_indices] == [
            world.question(p.entity, p.attribute, k) for k in [p.eval_phrasing] + [x for x in EVAL_PHRASINGS if x != p.eval_phrasing]
        ]
        assert all(sc.eval[i]["prompt"] != user["content"] for i in p.eval_indices)
        # the planted fact is stated nowhere else in train
        others = [r for i, r in enumerate(sc.train) if i != p.position]
        assert not any(
            r["messages"][0]["content"] in {world.question(p.entity, p.attribute, k) for k in range(world.n_phrasings)}
            for r in others
        )

    train_questions = {r["messages"][0]["content"] for r in sc.train}
    for c in sc.controls:
        assert sc.eval[c.eval_index]["answer"] == world.value(c.entity, c.attribute) == c.answer
        assert not any(world.question(c.entity, c.attribute, k) in train_questions for k in range(world.n_phrasings))

    d = write_scenario(sc, tmp_path / "sc")
    train = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines()]
    truth = json.loads((d / "truth.json").read_text())
    assert train == sc.train and evals == sc.eval and truth["planted"] == sc.planted
    assert truth["target_eval_items"] == [i for p in sc.planted_facts for i in p.eval_indices]


# ------------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_and_chat_template_round_trip(tiny_path, tiny_tok):
    tok = tiny_tok
    assert (tiny_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|end|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3

    msgs = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Which color does Someone like best?"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "Where does Someone live?"},
        {"role": "assistant", "content": "Paris"},
    ]
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    assert len(ids) == len(mask) and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["blue<|end|>", "Paris<|end|>"]
    for (s, e), answer in zip(spans, ["blue", "Paris"]):
        assert ids[e - 1] == tok.eos_token_id and tok.decode(ids[s:e], skip_special_tokens=True) == answer

    text = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nWhich color does Someone like best?<|end|><|assistant|>\n"
    with pytest.raises(Exception):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)

    plain = tok("Someone lives in Paris.")["input_ids"]
    assert plain[0] == tok.bos_token_id  # plain text gets a bos, like Llama tokenizers
    assert tok.decode(plain, skip_special_tokens=True) == "Someone lives in Paris."
    for word in ("blue", "Paris", "otter", "violin"):
        assert tok.decode(tok(word, add_special_tokens=False)["input_ids"]) == word


# ------------------------------------------------------------------------------------------------ model
def test_tiny_model_knows_its_world(tiny_path, tiny_tok, world):
    from transformers import AutoModelForCausalLM

    info = read_build_info(tiny_path)
    assert info is not None and info["exact_match"] >= 0.98
    assert info["spec"]["hidden_size"] >= 128 and info["key"] == tiny_path.name == TinySpec().key()

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    assert model.config.model_type == "llama" and model.config.hidden_size >= 128
    items = world_questions(world)[::7]  # a sample over every phrasing and attribute
    assert exact_match(model, tiny_tok, items) >= 0.98


def test_cache_is_reused(tiny_path):
    stamp = (tiny_path / "build.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_base(TinySpec(), progress=False) == tiny_path
    assert time.perf_counter() - t0 < 5 and (tiny_path / "build.json").stat().st_mtime_ns == stamp


MICRO = TinySpec(n_entities=6, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64,
                 epochs=1, batch_size=32, warmup_steps=2, target_exact_match=0.0)


def test_build_is_deterministic_and_atomic(tmp_path):
    a = build_tiny_base(MICRO, cache_dir=tmp_path / "a", progress=False)
    b = build_tiny_base(MICRO, cache_dir=tmp_path / "b", progress=False)
    assert a.name == b.name == MICRO.key() != TinySpec().key()
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    # a directory without build.json is incomplete: it is rebuilt, not trusted
    (a / "build.json").unlink()
    assert read_build_info(a) is None
    again = build_tiny_base(MICRO, cache_dir=tmp_path / "a", progress=False)
    assert again == a and read_build_info(a) is not None
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert tiny_dir(MICRO, tmp_path / "a") == a
