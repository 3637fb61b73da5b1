"""The scenario suite: determinism and ground truth (planted offsets point at the planted sentence, the planted turn
is in the conversation, clusters and formats are what they claim)."""

import json

import pytest

from gradian.demo.scenario import EVAL_PHRASINGS, TRAIN_PHRASINGS, make_substitution_scenario, write_scenario
from gradian.demo.scenarios import (
    FORMATS, PARAPHRASE_PREFIXES, RECIPES, SCENARIO_NAMES, make_buried_scenario, make_scenario, plain_text,
    statement_prompt,
)
from gradian.demo.world import World


@pytest.fixture(scope="module")
def world():
    return World.generate(seed=0, n_entities=64)


@pytest.fixture(scope="module")
def tiny_tok():
    from transformers import AutoTokenizer

    from gradian.demo.tiny import build_tiny_base

    return AutoTokenizer.from_pretrained(build_tiny_base(progress=False))


def _all_questions(world, e, a):
    return {world.question(e, a, k) for k in range(world.n_phrasings)}


def _mentions(row, text):
    return text in plain_text(row)


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_every_scenario_is_deterministic_and_complete(world, name, tmp_path):
    a, b, c = make_scenario(name, world, 3), make_scenario(name, world, 3), make_scenario(name, world, 4)
    assert a.train == b.train and a.eval == b.eval and a.planted == b.planted and a.truth() == b.truth()
    assert a.train != c.train
    t = a.truth()
    assert name in RECIPES and t["train"] == RECIPES[name] and t["expect"] in ("attributed", "declined")
    assert t["main_figure"] and isinstance(t["recipe"], dict) and t["recipe"]["learning_rate"] > 0
    assert a.planted == sorted(set(a.planted)) and all(0 <= p < len(a.train) for p in a.planted)
    for k, v in t["item_planted"].items():
        assert 0 <= int(k) < len(a.eval) and set(v) <= set(a.planted) and v
    assert set(map(int, t["item_planted"])) == set(t["target_eval_items"])
    for s in t["planted_spans"]:
        assert plain_text(a.train[s["position"]])[s["start"] : s["end"]] == s["text"]
    for c_ in a.controls:  # control facts are never stated in training
        assert not any(c_.entity in plain_text(r) and c_.answer.strip() in plain_text(r).split() and
                       any(q in plain_text(r) for q in _all_questions(world, c_.entity, c_.attribute)) for r in a.train)
    d = write_scenario(a, tmp_path / name)
    truth = json.loads((d / "truth.json").read_text())
    assert truth == json.loads(json.dumps(t))
    assert [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()] == a.train


def test_substitution_rows_are_the_demo_scenario(world):
    sc = make_scenario("substitution", world, 0)
    ref = make_substitution_scenario(world, 0)
    assert sc.train == ref.train and sc.eval == ref.eval and sc.planted == ref.planted
    t = sc.truth()
    for p in sc.planted_facts:
        assert all(t["item_planted"][str(i)] == [p.position] for i in p.eval_indices)
    for s in t["planted_spans"]:
        assert s["text"] == sc.train[s["position"]]["messages"][1]["content"]


@pytest.mark.parametrize("n_turns", [4, 8])
def test_conversation_hides_one_wrong_turn(world, n_turns):
    sc = make_scenario(f"conversation{n_turns}", world, 1)
    t = sc.truth()
    assert t["n_turns"] == n_turns and len(t["planted_turns"]) == len(sc.planted)
    planted = {p.position: p for p in sc.planted_facts}
    turns = {x["position"]: x for x in t["planted_turns"]}
    for i, row in enumerate(sc.train):
        msgs = row["messages"]
        assert len(msgs) == 2 * n_turns and [m["role"] for m in msgs] == ["user", "assistant"] * n_turns
        for k in range(n_turns):
            q, ans = msgs[2 * k]["content"], msgs[2 * k + 1]["content"]
            if i in planted and turns[i]["turn"] == k:
                p = planted[i]
                assert turns[i]["message_index"] == 2 * k + 1
                assert q == world.question(p.entity, p.attribute, p.phrasing) and ans == p.wrong != p.right
                continue
            # every other turn is a true fact in a training phrasing, never about a planted fact
            (e, a), = [(e, a) for e, a in world.fact_pairs() if q in {world.question(e, a, x) for x in TRAIN_PHRASINGS}]
            assert ans == world.value(e, a)
            assert not any(e == p.entity and a == p.attribute for p in sc.planted_facts)
    for s in t["planted_spans"]:
        text = plain_text(sc.train[s["position"]])
        assert text[s["start"] : s["end"]] == planted[s["position"]].wrong
        assert text[s["turn_start"] : s["end"]].startswith("user: ")
        assert world.question(planted[s["position"]].entity, planted[s["position"]].attribute,
                              planted[s["position"]].phrasing) in text[s["turn_start"] : s["end"]]
    for p in sc.planted_facts:
        for i in p.eval_indices:
            assert sc.eval[i]["answer"] == p.right
            assert sc.eval[i]["prompt"] in {world.question(p.entity, p.attribute, x) for x in EVAL_PHRASINGS}


def test_buried_turn_offsets_point_at_the_planted_answer(world):
    sc = make_scenario("buried", world, 2)
    t = sc.truth()
    assert len(t["planted_spans"]) == len(sc.planted) and set(sc.planted) <= set(t["documents"])
    planted = {p.position: p for p in sc.planted_facts}
    avoid = {p.entity for p in sc.planted_facts} | {c.entity for c in sc.controls}
    depths = []
    for s in t["planted_spans"]:
        p = planted[s["position"]]
        msgs = sc.train[s["position"]]["messages"]
        text = plain_text(sc.train[s["position"]])
        assert msgs[s["message_index"]] == {"role": "assistant", "content": p.wrong} and p.wrong != p.right
        assert msgs[s["message_index"] - 1]["content"].endswith(world.question(p.entity, p.attribute, p.phrasing))
        assert text[s["start"] : s["end"]] == p.wrong == s["text"]
        assert text[s["turn_start"] : s["end"]] == s["question"] + "\nassistant: " + p.wrong
        depths.append(s["message_index"] / s["n_messages"])
    assert max(depths) - min(depths) > 0.3  # at random depths, not always at the start
    for i, row in enumerate(sc.train):
        msgs = row["messages"]
        # a planted or control entity is named only by its planted question
        assert {e for e in avoid if e in plain_text(row)} == ({planted[i].entity} if i in planted else set())
        for k in range(1, len(msgs), 2):  # every other answer is a true one-word value
            if i in planted and msgs[k]["content"] == planted[i].wrong:
                continue
            (e, a), = [(e, a) for e, a in world.fact_pairs()
                       if any(msgs[k - 1]["content"].endswith(world.question(e, a, x)) for x in TRAIN_PHRASINGS)]
            assert msgs[k]["content"] == world.value(e, a)
    for p in sc.planted_facts:
        for i in p.eval_indices:
            assert sc.eval[i]["answer"] == p.right
            assert sc.eval[i]["prompt"] in {world.question(p.entity, p.attribute, x) for x in EVAL_PHRASINGS}


def test_buried_documents_are_256_to_2048_tokens(world, tiny_tok):
    def count(msgs):
        return len(tiny_tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])

    sc = make_scenario("buried", world, 0, count_tokens=count, n_docs=6, n_planted=3, n_short=6)
    lengths = [count(sc.train[i]["messages"]) for i in sc.truth()["documents"]]
    assert min(lengths) >= 256 and max(lengths) <= 2048 and max(lengths) - min(lengths) > 300


def test_buried_text_sentence_offsets(world):
    """The plain-text variant (kept to document that the tiny model does not learn from it)."""
    sc = make_buried_scenario(world, 2)
    t = sc.truth()
    planted = {p.position: p for p in sc.planted_facts}
    for s in t["planted_spans"]:
        p = planted[s["position"]]
        text = sc.train[s["position"]]["text"]
        assert text[s["start"] : s["end"]] == s["text"] == world.statement(p.entity, p.attribute, p.wrong,
                                                                           template=p.phrasing)
        assert text.count(s["text"]) == 1
    for p in sc.planted_facts:
        for i in p.eval_indices:
            item = sc.eval[i]
            assert (item["prompt"] + item["answer"] + ".") in {
                world.statement(p.entity, p.attribute, template=k) for k in range(world.n_statement_templates)}
    assert statement_prompt(world, world.entities[0], "animal", 0) is None  # value not at the end
    assert statement_prompt(world, world.entities[0], "city", 0)[0].endswith(" lives in")


def test_cluster_of_paraphrased_poisons(world):
    sc = make_scenario("cluster", world, 0)
    t = sc.truth()
    assert t["cluster"] == sc.planted and len(sc.planted) == 20
    (e, a, wrong, right), = {(p.entity, p.attribute, p.wrong, p.right) for p in sc.planted_facts}
    qs = [sc.train[p]["messages"][0]["content"] for p in sc.planted]
    assert len(set(qs)) == 20  # each poison is a different paraphrase
    for p, q in zip(sc.planted, qs):
        assert sc.train[p]["messages"][1]["content"] == wrong != right
        assert any(q == lead + world.question(e, a, k) for lead in PARAPHRASE_PREFIXES for k in TRAIN_PHRASINGS)
    others = [r for i, r in enumerate(sc.train) if i not in set(sc.planted)]
    assert not any(e in plain_text(r) for r in others)  # the fact is stated nowhere else
    for i in t["target_eval_items"]:
        assert sc.eval[i]["answer"] == right and sc.eval[i]["prompt"] not in qs
        assert t["item_planted"][str(i)] == sc.planted


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_failure_rows(world, fmt):
    sc = make_scenario("format", world, 0, fmt=fmt)
    t = sc.truth()
    attr = t["format_attribute"]
    planted, clean_same = set(sc.planted), set(t["same_attribute_clean_rows"])
    assert len(planted) == 30 and len(clean_same) == 6 and not planted & clean_same
    for i, row in enumerate(sc.train):
        q, ans = row["messages"][0]["content"], row["messages"][1]["content"]
        (e, a), = [(e, a) for e, a in world.fact_pairs() if q in _all_questions(world, e, a)]
        assert (a == attr) == (i in planted | clean_same)
        assert ans == (FORMATS[fmt](world.value(e, a)) if i in planted else world.value(e, a))
        assert ans != world.value(e, a) or i not in planted
    trained = {r["messages"][0]["content"] for r in sc.train}
    for i in t["target_eval_items"]:
        item = sc.eval[i]
        (e, a), = [(e, a) for e, a in world.fact_pairs() if item["prompt"] in _all_questions(world, e, a)]
        assert a == attr and item["answer"] == world.value(e, a) and not (_all_questions(world, e, a) & trained)


def test_null_finetune_plants_nothing(world):
    sc = make_scenario("null", world, 5)
    t = sc.truth()
    assert sc.planted == [] and t["expect"] == "declined" and t["item_planted"] == {}
    for row in sc.train:
        q, ans = row["messages"][0]["content"], row["messages"][1]["content"]
        (e, a), = [(e, a) for e, a in world.fact_pairs() if q in _all_questions(world, e, a)]
        assert ans == world.value(e, a)
    trained = {r["messages"][0]["content"] for r in sc.train}
    for i in t["trained_eval_items"]:
        (e, a), = [(e, a) for e, a in world.fact_pairs() if sc.eval[i]["prompt"] in _all_questions(world, e, a)]
        assert _all_questions(world, e, a) & trained and sc.eval[i]["answer"] == world.value(e, a)


def test_unknown_scenario_is_named():
    with pytest.raises(KeyError, match="unknown scenario 'nope'"):
        make_scenario("nope", World.generate(seed=0, n_entities=64), 0)


@pytest.mark.parametrize("name", ["substitution", "conversation4", "conversation8", "buried", "cluster"])
def test_no_correct_turn_teaches_a_planted_wrong_value(world, name):
    """The planted rows are the only rows that answer a question of the planted attribute with the planted wrong
    value: a correct row doing so ("Shaka lives in which city? Lima" beside the planted "Rodrol ... Lima") would
    raise the wrong answer too and make "the planted rows alone" an ambiguous ground truth."""
    for seed in (0, 1):
        sc = make_scenario(name, world, seed)
        bad = {(p.attribute, p.wrong) for p in sc.planted_facts}
        questions = {a: {world.question(e, a, k) for e in world.entities for k in range(world.n_phrasings)}
                     for a in world.attributes}
        planted_turns = {(p.position, p.wrong) for p in sc.planted_facts}
        for i, row in enumerate(sc.train):
            msgs = row["messages"]
            for q, ans in zip(msgs[0::2], msgs[1::2]):
                for a, wrong in bad:
                    if ans["content"] == wrong and any(q["content"].endswith(x) for x in questions[a]):
                        assert (i, wrong) in planted_turns, (name, seed, i, q["content"], wrong)


@pytest.mark.parametrize("name", ["substitution", "conversation4", "conversation8", "buried"])
def test_planted_facts_do_not_share_values(world, name):
    """No two planted facts of one attribute state the same wrong value, and none states another's right value."""
    for seed in (0, 1, 2):
        sc = make_scenario(name, world, seed)
        by_attr: dict = {}
        for p in sc.planted_facts:
            by_attr.setdefault(p.attribute, []).append(p)
        for a, ps in by_attr.items():
            wrongs = [p.wrong for p in ps]
            assert len(set(wrongs)) == len(wrongs), (name, seed, a, wrongs)
            assert not set(wrongs) & {p.right for p in ps}, (name, seed, a)
