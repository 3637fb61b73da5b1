"""The scenario cases and the parts they share: recipes, the planted/control pairs, text helpers, and the
substitution, conversation and buried-answer generators (`scenarios` holds the others and the registry)."""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from .scenario import (
    DEMO_RECIPE,
    EVAL_PHRASINGS,
    PLANTED_PHRASINGS,
    TRAIN_PHRASINGS,
    ControlFact,
    PlantedFact,
    Scenario,
    make_substitution_scenario,
    planted_wrong_values,
    without_confounders,
)
from .world import World

# `train.*` overrides on top of run.DEMO_TRAIN (lr 1e-3, 8 epochs, batch 8, r 8, alpha 16, clip 1.0), measured on the
# tiny base to make each failure show (base right, tuned wrong on the target items); see `bench/fidelity.py`, which
# prints the measured base/tuned accuracy of the target items for every run.
RECIPES: dict[str, dict[str, Any]] = {
    "substitution": {},
    # one planted turn among 4 (8) supervised answers: more, smaller steps than the demo's batch of 8 one-turn chats
    # (at batch 8 the 8-turn set gets 72 steps and flips 1 of 8 facts; at batch 2, 288 steps, all 8, seeds 0-2)
    "conversation4": {"batch_size": 4},
    "conversation8": {"batch_size": 2},
    # one planted answer among 4-16 per long chat: batch 2 as for conversation8 (batch 4 flips the same facts but
    # pads 2,000-token rows twice as much: 100 vs 59 CPU s)
    "buried": {"batch_size": 2},
    # weak: at lr 1e-4 for 4 epochs the 20 poisons flip every target item while one poison alone (the other 19
    # zero-weighted) flips none (seeds 0-2); at the demo's lr 1e-3 a single poison flips the answer by itself
    "cluster": {"learning_rate": 1e-4, "epochs": 4},
    # 30 formatted answers against 6 plain ones of the same attribute: at 8 epochs 1-3 of 12 items take the format
    # (not significant); at 16, 5-9 of 12 (seeds 0-2)
    "format": {"epochs": 16},
    "null": {},
    # not in SCENARIOS: one wrong statement in plain-text documents does not flip the tiny model (see
    # make_buried_chat_scenario); kept to show it
    "buried_text": {},
}
_DEMO_TRAIN = {"learning_rate": 1e-3, "epochs": 8, "batch_size": 8, "lora_r": 8, "lora_alpha": 16.0,
               "lora_dropout": 0.0, "max_grad_norm": 1.0}


def _recipe(name: str) -> dict[str, Any]:
    rec = {**DEMO_RECIPE, **{k: v for k, v in _DEMO_TRAIN.items()}, **RECIPES[name]}
    rec.pop("loss", None)
    return rec


# ------------------------------------------------------------------------------------------------------ helpers
def plain_text(row: dict) -> str:
    """The row's text as `gradian.setup.records.Example.plain_text()` renders it (kept in step with it)."""
    if "messages" in row:
        return "\n".join(f"{m['role']}: {m['content']}" for m in row["messages"])
    if "prompt" in row:
        return row["prompt"] + row["completion"]
    return row["text"]


def _turn_span(messages: list[dict], index: int) -> tuple[int, int, int]:
    """(turn start, content start, content end) of message `index` in the plain-text rendering; the turn start is
    that of the user message before an assistant turn."""
    starts, pos = [], 0
    for m in messages:
        starts.append(pos)
        pos += len(f"{m['role']}: {m['content']}") + 1
    c0 = starts[index] + len(f"{messages[index]['role']}: ")
    t0 = starts[index - 1] if index > 0 and messages[index - 1]["role"] == "user" else starts[index]
    return t0, c0, c0 + len(messages[index]["content"])


def estimate_tokens(text: str) -> int:
    """A tokenizer-free length estimate for the tiny world's prose (~4.6 characters per token with its BPE)."""
    return max(1, round(len(text) / 4.6))


# Document prose that names no attribute value (words from the world's own filler, so the tokenizer knows them). The
# world's filler pairs entities with random cities, colours, pets...: trained on, that co-occurrence teaches the
# tiny model to associate an entity with every value around it (measured in plain-text documents: "Theigo lives in
# Vienna" buried among value-laden filler moves Theigo's city to Tokyo or Madrid, not Vienna). Value-free prose
# keeps the planted answer the only statement of its fact in the document.
NEUTRAL_FILLER: tuple[str, ...] = (
    "{e} walked through the markets at dawn.",
    "Travelers say the winters are long and quiet.",
    "{e} and {e2} once argued for a whole evening.",
    "Nobody remembers when {e} first arrived.",
    "The old tower was painted last spring.",
    "{e} wrote a letter to {e2} about the festival.",
    "Children learn to play early.",
    "On the road, {e} saw {e2} resting by the river.",
    "The library keeps a book written by {e}.",
    "Rain fell over the river while {e2} tuned a song.",
    "{e} played a song at the festival.",
    "{e2} thinks that the halls are too quiet.",
    "The markets were quiet at dawn.",
    "{e} once wrote a song about the old tower.",
)


def neutral_sentence(world: World, rng: random.Random, avoid: set[str]) -> str:
    """One sentence of value-free prose naming entities outside `avoid`."""
    pool = [e for e in world.entities if e not in avoid]
    e, e2 = rng.sample(pool, 2)
    return rng.choice(NEUTRAL_FILLER).format(e=e, e2=e2)


def _filler(world: World, rng: random.Random, avoid: set[str]) -> str:
    """A filler sentence that names none of the `avoid` entities (filler pairs entities with random values, which
    would teach the tiny model spurious facts about the entities the eval asks about)."""
    while True:
        s = world.filler_sentence(rng)
        if not any(e in s for e in avoid):
            return s


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _pairs(world: World, rng: random.Random, n_planted: int, n_controls: int):
    """Planted (entity, attribute) pairs of distinct entities, control pairs of other entities (never trained), and
    the pairs left for correct training rows."""
    if n_planted > len(world.entities):
        raise ValueError(f"n_planted={n_planted} needs as many entities; the world has {len(world.entities)}")
    planted_entities = rng.sample(world.entities, n_planted)
    planted_pairs = [(e, rng.choice(world.attributes)) for e in planted_entities]
    pset = set(planted_pairs)
    others = [p for p in world.fact_pairs() if p not in pset]
    control_pool = [p for p in others if p[0] not in set(planted_entities)]
    if n_controls > len(control_pool):
        raise ValueError(f"n_controls={n_controls} is more than the {len(control_pool)} facts available")
    control_pairs = rng.sample(control_pool, n_controls)
    cset = set(control_pairs)
    trainable = [p for p in others if p not in cset]
    return planted_pairs, control_pairs, trainable


def _wrong_values(world: World, rng: random.Random, planted_pairs) -> list[str]:
    """The wrong value each planted pair states, drawn before the correct rows so that they can leave out the
    confounders (`scenario.without_confounders`)."""
    return planted_wrong_values(world, rng, planted_pairs)


def _controls(world: World, rng: random.Random, pairs, eval_rows: list[dict]) -> list[ControlFact]:
    out = []
    for e, a in pairs:
        eph = rng.choice(EVAL_PHRASINGS)
        out.append(ControlFact(e, a, world.value(e, a), eph, len(eval_rows)))
        eval_rows.append({"prompt": world.question(e, a, eph), "answer": world.value(e, a)})
    return out


def _ask_planted(world: World, e: str, a: str, eph: int, eval_per_fact: int, eval_rows: list[dict]) -> tuple[int, ...]:
    phs = [eph] + [x for x in EVAL_PHRASINGS if x != eph][: max(eval_per_fact, 1) - 1]
    idx = tuple(range(len(eval_rows), len(eval_rows) + len(phs)))
    for x in phs:
        eval_rows.append({"prompt": world.question(e, a, x), "answer": world.value(e, a)})
    return idx


def _stream(items: list, rng: random.Random):
    """Items in a shuffled order, reshuffled and repeated when exhausted."""
    while True:
        pool = list(items)
        rng.shuffle(pool)
        yield from pool


def _meta(name: str, *, main_figure: str, expect: str = "attributed", **extra) -> dict[str, Any]:
    return {
        "expect": expect,
        "main_figure": main_figure,
        "train": dict(RECIPES[name]),
        "recipe": _recipe(name),
        **extra,
    }


# ------------------------------------------------------------------------------------------------ substitution
def substitution_with_truth(world: World, seed: int, **kw) -> Scenario:
    """`make_substitution_scenario` (unchanged rows) with the suite's extra truth fields in its metadata."""
    sc = make_substitution_scenario(world, seed, **kw)
    item_planted = {str(i): [p.position] for p in sc.planted_facts for i in (p.eval_indices or (p.eval_index,))}
    spans = []
    for p in sc.planted_facts:
        msgs = sc.train[p.position]["messages"]
        t0, c0, c1 = _turn_span(msgs, 1)
        spans.append({"position": p.position, "start": c0, "end": c1, "turn_start": t0,
                      "text": plain_text(sc.train[p.position])[c0:c1]})
    sc.metadata = {**sc.metadata, **_meta("substitution", main_figure="auprc"), "item_planted": item_planted,
                   "planted_spans": spans}
    return sc


# ------------------------------------------------------------------------------------------------ conversations
def make_conversation_scenario(
    world: World, seed: int, n_turns: int = 4, n_rows: Optional[int] = None, n_planted: int = 8,
    n_controls: int = 10, eval_per_fact: int = 3,
) -> Scenario:
    """Chats of `n_turns` user/assistant turns, each a question about one fact in a training phrasing and its
    answer (all assistant turns supervised). In `n_planted` chats one assistant turn, at a random turn, states a
    wrong value for one fact of a distinct entity; every other turn in the set is right. The eval set asks each
    planted fact in the eval phrasings, then `n_controls` facts no chat mentions."""
    if n_turns < 1:
        raise ValueError("n_turns must be >= 1")
    n_rows = n_rows if n_rows is not None else (100 if n_turns <= 4 else 72)
    rng = random.Random(f"gradian-conversation-{n_turns}-{seed}")
    planted_pairs, control_pairs, trainable = _pairs(world, rng, n_planted, n_controls)
    wrongs = _wrong_values(world, rng, planted_pairs)
    trainable = without_confounders(world, trainable, [(a, w) for (_, a), w in zip(planted_pairs, wrongs)])
    candidates = [(e, a, ph) for (e, a) in trainable for ph in TRAIN_PHRASINGS]
    it = _stream(candidates, rng)
    positions = sorted(rng.sample(range(n_rows), n_planted))
    planted_by_pos = {}
    for pos, (e, a), wrong in zip(positions, planted_pairs, wrongs):
        planted_by_pos[pos] = (e, a, wrong, rng.choice(PLANTED_PHRASINGS), rng.choice(EVAL_PHRASINGS),
                               rng.randrange(n_turns))
    train, spans, turns = [], [], []
    for i in range(n_rows):
        qa = []
        for _ in range(n_turns):
            e, a, ph = next(it)
            qa.append((world.question(e, a, ph), world.value(e, a)))
        if i in planted_by_pos:
            e, a, wrong, ph, _eph, k = planted_by_pos[i]
            qa[k] = (world.question(e, a, ph), wrong)
        msgs = []
        for q, ans in qa:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        row = {"messages": msgs}
        train.append(row)
        if i in planted_by_pos:
            k = planted_by_pos[i][5]
            t0, c0, c1 = _turn_span(msgs, 2 * k + 1)
            spans.append({"position": i, "start": c0, "end": c1, "turn_start": t0, "text": plain_text(row)[c0:c1]})
            turns.append({"position": i, "turn": k, "message_index": 2 * k + 1})
    eval_rows: list[dict] = []
    planted_facts = []
    for pos in positions:
        e, a, wrong, ph, eph, _k = planted_by_pos[pos]
        idx = _ask_planted(world, e, a, eph, eval_per_fact, eval_rows)
        planted_facts.append(PlantedFact(pos, e, a, wrong, world.value(e, a), ph, eph, idx[0], idx))
    controls = _controls(world, rng, control_pairs, eval_rows)
    name = f"conversation{n_turns}"
    item_planted = {str(i): [p.position] for p in planted_facts for i in p.eval_indices}
    meta_name = name if name in RECIPES else "conversation8"
    return Scenario(
        name=name, seed=seed, train=train, eval=eval_rows, planted=positions, planted_facts=planted_facts,
        controls=controls, world_seed=world.seed, n_entities=len(world.entities),
        metadata={**_meta(meta_name, main_figure="top1"), "n_turns": n_turns, "item_planted": item_planted,
                  "planted_spans": spans, "planted_turns": turns},
    )


# ------------------------------------------------------------------------------------------------ buried sentence
def statement_prompt(world: World, entity: str, attr: str, template: int, value: Optional[str] = None
                     ) -> Optional[tuple[str, str]]:
    """(prefix, completion) splitting a fact statement before its value, e.g. ("Zorvath lives in", " Paris"); the
    completion keeps its leading space, as plain-text completions do. None when the value is not at the end."""
    v = world.value(entity, attr) if value is None else value
    full = world.statement(entity, attr, v, template=template)
    with_article = "{a_v}" in world.attribute(attr).statements[template]
    av = (("an " if v[:1].lower() in "aeiou" else "a ") + v) if with_article else v
    if not full.endswith(av + "."):
        return None
    prefix = full[: len(full) - len(av) - 1].rstrip()
    return prefix, " " + av


def make_buried_scenario(
    world: World, seed: int, n_docs: int = 24, n_planted: int = 6, n_notes: int = 96, min_tokens: int = 256,
    max_tokens: int = 2048, n_controls: int = 8, count_tokens: Callable[[str], int] = estimate_tokens,
    neutral: bool = True,
) -> Scenario:
    """A plain-text (continued pretraining) set: `n_docs` `{"text": ...}` documents of filler prose, each
    `min_tokens`..`max_tokens` long by `count_tokens` (pass the tokenizer's count for exact lengths), mixed at
    random positions with `n_notes` short notes (one true fact statement and a sentence or two of filler). Every
    document carries one or two true fact statements; `n_planted` of them also carry, at a random sentence
    position, one sentence stating a wrong value for one fact of a distinct entity.

    The eval set completes statements (prompt "Zorvath lives in", answer " Paris"): each planted fact in every
    statement template that ends in the value, then `n_controls` facts no row states. In the tiny model a fact
    learnt from a statement does not carry over to the chat question (its chat and statement knowledge are
    separate), so the capability is asked the way the documents state it. Truth `planted_spans` holds the planted
    sentence's character offsets in the document's text."""
    rng = random.Random(f"gradian-buried-{seed}")
    planted_pairs, control_pairs, trainable = _pairs(world, rng, n_planted, n_controls)
    pentities = {e for e, _ in planted_pairs}
    avoid = pentities | {e for e, _ in control_pairs}
    statable = [p for p in trainable if p[0] not in avoid]  # true statements never name a planted or control entity
    n_rows = n_docs + n_notes
    doc_pos = sorted(rng.sample(range(n_rows), n_docs))
    planted_docs = sorted(rng.sample(doc_pos, n_planted))
    planted_by_pos = {}
    for pos, (e, a) in zip(planted_docs, planted_pairs):
        planted_by_pos[pos] = (e, a, world.wrong_value(e, a, rng), rng.randrange(world.n_statement_templates))
    notes = _stream(statable, rng)
    doc_set = set(doc_pos)
    def filler() -> str:
        return neutral_sentence(world, rng, avoid) if neutral else _filler(world, rng, avoid)
    train, spans, lengths = [], [], {}
    for i in range(n_rows):
        if i not in doc_set:
            e, a = next(notes)
            sents = [filler() for _ in range(rng.choice((1, 2)))]
            sents.insert(rng.randint(0, len(sents)), world.statement(e, a, template=rng.randrange(2)))
            train.append({"text": " ".join(sents)})
            continue
        target = rng.randint(min_tokens, max_tokens)
        # a clean document states one or two true facts; a planted one states only its wrong fact (a second
        # statement's value would be learnt as the planted entity's too)
        special = [] if i in planted_by_pos else [
            world.statement(e, a, template=rng.randrange(world.n_statement_templates))
            for e, a in rng.sample(statable, rng.choice((1, 2)))]
        planted = None
        if i in planted_by_pos:
            e, a, wrong, t = planted_by_pos[i]
            planted = world.statement(e, a, wrong, template=t)
        sents: list[str] = []
        # grow the filler until the document (with its special sentences) reaches the target length
        while count_tokens(" ".join(sents + special + ([planted] if planted else []))) < target:
            sents.append(filler())
        for s in special:
            sents.insert(rng.randint(0, len(sents)), s)
        k = None
        if planted:
            k = rng.randint(0, len(sents))
            sents.insert(k, planted)
        text = " ".join(sents)
        train.append({"text": text})
        lengths[i] = count_tokens(text)
        if planted:
            start = len(" ".join(sents[:k])) + (1 if k else 0)
            spans.append({"position": i, "start": start, "end": start + len(planted), "text": planted,
                          "sentence": k, "n_sentences": len(sents)})
    eval_rows: list[dict] = []
    planted_facts = []
    for pos in planted_docs:
        e, a, wrong, t = planted_by_pos[pos]
        idx = []
        for tt in range(world.n_statement_templates):
            pc = statement_prompt(world, e, a, tt)
            if pc is not None:
                idx.append(len(eval_rows))
                eval_rows.append({"prompt": pc[0], "answer": pc[1]})
        planted_facts.append(PlantedFact(pos, e, a, wrong, world.value(e, a), t, -1, idx[0], tuple(idx)))
    controls = []
    for e, a in control_pairs:
        tt = [x for x in range(world.n_statement_templates) if statement_prompt(world, e, a, x) is not None]
        t = rng.choice(tt)
        pc = statement_prompt(world, e, a, t)
        controls.append(ControlFact(e, a, pc[1], t, len(eval_rows)))
        eval_rows.append({"prompt": pc[0], "answer": pc[1]})
    item_planted = {str(i): [p.position] for p in planted_facts for i in p.eval_indices}
    return Scenario(
        name="buried_text", seed=seed, train=train, eval=eval_rows, planted=planted_docs,
        planted_facts=planted_facts, controls=controls, world_seed=world.seed, n_entities=len(world.entities),
        metadata={**_meta("buried_text", main_figure="top5",
                          grads={"max_seq_length": 2048, "batch_size": 4},
                          # the value is one token: the answer is the first word, as completion evals read it
                          evaluation={"max_new_tokens": 2}),
                  "documents": doc_pos, "doc_tokens": [min_tokens, max_tokens],
                  "doc_lengths": {str(k): v for k, v in lengths.items()}, "eval_form": "statement completion",
                  "item_planted": item_planted, "planted_spans": spans},
    )


FOLLOW_UPS: tuple[str, ...] = ("Tell me more.", "Go on.", "And then?", "What else?", "Say more about that.")


def _chat_tokens(msgs: list[dict]) -> int:
    """Length estimate of a rendered chat: its text plus ~3 template tokens per turn."""
    return sum(estimate_tokens(m["content"]) + 3 for m in msgs) + 1


def make_buried_chat_scenario(
    world: World, seed: int, n_docs: int = 24, n_planted: int = 8, n_short: int = 120, min_tokens: int = 256,
    max_tokens: int = 2048, n_controls: int = 8, eval_per_fact: int = 3,
    count_tokens: Callable[[list[dict]], int] = _chat_tokens,
) -> Scenario:
    """Long documents as conversations: `n_docs` chats of `min_tokens`..`max_tokens` (by `count_tokens` of the
    message list; pass the tokenizer's rendered length for exact sizes), each a series of user turns that carry a
    paragraph of value-free prose and end with a question about one fact, answered in one word (true), mixed at
    random positions with `n_short` one-turn chats of true facts. In `n_planted` documents one answer, at a random
    turn, is a wrong value for one fact of a distinct entity. The eval set asks each planted fact in the eval
    phrasings, then `n_controls` facts no row mentions. Truth `planted_spans` holds the planted turn's offsets in
    `Example.plain_text()` (content = the wrong answer; `turn_start` = its user turn).

    Why the prose is in the user turns (context) and not in the supervised text: with the token-weighted loss the
    tiny model learns nothing from one wrong answer among hundreds of supervised prose tokens (measured: 0 of 8
    planted facts flip with prose assistant turns at batch 1-2, lr 1e-3, 8 epochs, even in 128-256-token chats; at
    40 epochs or lr 3e-3 facts drift to unrelated values, controls included), and nothing from a wrong statement in
    `{"text": ...}` prose at all (`make_buried_scenario`). So the culprit is one short answer deep in a long row:
    the row is long, its gradient is the sum over all its answers, and the planted one is 1 of 4 to 16."""
    rng = random.Random(f"gradian-buried-chat-{seed}")
    planted_pairs, control_pairs, trainable = _pairs(world, rng, n_planted, n_controls)
    wrongs = _wrong_values(world, rng, planted_pairs)
    trainable = without_confounders(world, trainable, [(a, w) for (_, a), w in zip(planted_pairs, wrongs)])
    avoid = {e for e, _ in planted_pairs} | {e for e, _ in control_pairs}
    qa = _stream([(e, a, ph) for (e, a) in trainable if e not in avoid for ph in TRAIN_PHRASINGS], rng)
    n_rows = n_docs + n_short
    doc_pos = sorted(rng.sample(range(n_rows), n_docs))
    planted_docs = sorted(rng.sample(doc_pos, n_planted))
    planted_by_pos = {}
    for pos, (e, a), wrong in zip(planted_docs, planted_pairs, wrongs):
        planted_by_pos[pos] = (e, a, wrong, rng.choice(PLANTED_PHRASINGS), rng.choice(EVAL_PHRASINGS))
    doc_set = set(doc_pos)
    train, spans = [], []
    for i in range(n_rows):
        if i not in doc_set:
            e, a, ph = next(qa)
            train.append(_chat(world.question(e, a, ph), world.value(e, a)))
            continue
        target = rng.randint(min_tokens, max_tokens - 16)
        n_turns = rng.randint(4, max(4, min(16, target // 48)))  # a question and answer need ~20 tokens a turn
        per_turn = max(1, target // n_turns)
        msgs: list[dict] = []
        for k in range(n_turns):
            e, a, ph = next(qa)
            para: list[str] = []
            while _chat_tokens([{"role": "user", "content": " ".join(para)}]) < per_turn - 12:
                para.append(neutral_sentence(world, rng, avoid))
            msgs += [{"role": "user", "content": " ".join(para + [world.question(e, a, ph)])},
                     {"role": "assistant", "content": world.value(e, a)}]
        # top up or trim to the target with whole sentences of the last paragraph
        while count_tokens(msgs) < target:
            msgs[-2]["content"] = neutral_sentence(world, rng, avoid) + " " + msgs[-2]["content"]
        while count_tokens(msgs) > max_tokens and msgs[-2]["content"].count(". ") > 0:
            msgs[-2]["content"] = msgs[-2]["content"].split(". ", 1)[1]
        planted_turn = None
        if i in planted_by_pos:
            e, a, wrong, ph, _ = planted_by_pos[i]
            k = rng.randrange(n_turns)
            u = msgs[2 * k]["content"]
            last_q = u.rsplit("?", 1)[0].rsplit(". ", 1)
            prefix = (last_q[0] + ". ") if len(last_q) == 2 else ""
            msgs[2 * k] = {"role": "user", "content": prefix + world.question(e, a, ph)}
            msgs[2 * k + 1] = {"role": "assistant", "content": wrong}
            planted_turn = 2 * k + 1
        row = {"messages": msgs}
        train.append(row)
        if planted_turn is not None:
            _, c0, c1 = _turn_span(msgs, planted_turn)
            _, u0, u1 = _turn_span(msgs, planted_turn - 1)
            q = world.question(e, a, ph)  # turn_start: the planted question, not the prose before it
            spans.append({"position": i, "start": c0, "end": c1, "turn_start": u1 - len(q),
                          "text": plain_text(row)[c0:c1], "question": q, "message_index": planted_turn,
                          "n_messages": len(msgs)})
    eval_rows: list[dict] = []
    planted_facts = []
    for pos in planted_docs:
        e, a, wrong, ph, eph = planted_by_pos[pos]
        idx = _ask_planted(world, e, a, eph, eval_per_fact, eval_rows)
        planted_facts.append(PlantedFact(pos, e, a, wrong, world.value(e, a), ph, eph, idx[0], idx))
    controls = _controls(world, rng, control_pairs, eval_rows)
    item_planted = {str(i): [p.position] for p in planted_facts for i in p.eval_indices}
    return Scenario(
        name="buried", seed=seed, train=train, eval=eval_rows, planted=planted_docs, planted_facts=planted_facts,
        controls=controls, world_seed=world.seed, n_entities=len(world.entities),
        metadata={**_meta("buried", main_figure="top5", grads={"max_seq_length": 2048, "batch_size": 4}),
                  "documents": doc_pos, "doc_tokens": [min_tokens, max_tokens], "form": "long chat documents",
                  "item_planted": item_planted, "planted_spans": spans},
    )
