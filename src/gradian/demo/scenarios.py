"""The scenario suite: hard attribution cases over the synthetic world, each with its ground truth.

Every generator is a pure function of (world, seed, sizes) and returns the same `Scenario` as
`make_substitution_scenario`, so `write_scenario` writes `train.jsonl`, `eval.jsonl` and `truth.json` the same way.
Beyond the substitution truth (`planted`, `planted_facts`, `controls`, `target_eval_items`), `truth.json` carries:

* ``item_planted``: {eval item: [training positions that caused it]} - what a per-item hit is checked against;
* ``planted_spans``: [{position, start, end, text}] - character offsets of the planted sentence or turn in the row's
  text (`text` rows: the record's text; `messages` rows: `Example.plain_text()`, "role: content" lines);
* ``cluster``: positions of a group of weak poisons that only act together (paraphrase scenario);
* ``expect``: the verdict the scenario should give (``attributed``, or ``declined`` for the null fine-tune);
* ``main_figure``: the figure the bench compares methods on;
* ``train`` (the `train.*` overrides on top of `run.DEMO_TRAIN`), ``grads`` and ``evaluation`` (config overrides):
  the recipe measured to make the failure show (base right, tuned wrong on the target items); ``recipe`` is the
  full training recipe. `scenario_base(name)` gives the base model a scenario runs on (the tiny base; for
  ``buried`` the same weights with a 2,048-token context).

    world = World.generate(seed=0, n_entities=64)
    sc = make_scenario("conversation4", world, seed=3)
    write_scenario(sc, "runs/conv4-s3")

Scenarios (`SCENARIOS`): ``substitution`` (the demo's), ``conversation4`` / ``conversation8`` (one wrong assistant turn
in a 4- or 8-turn chat), ``buried`` (one wrong answer at a random depth of a 256-2,048-token conversation whose user
turns carry paragraphs of prose; see `make_buried_chat_scenario` for why not plain-text documents), ``cluster`` (20
paraphrased weak poisons of one fact), ``format`` (answers of one attribute taught in a wrong format), ``null`` (no
planted rows: the capability must not move). `make_buried_scenario` builds the plain-text variant (`{"text": ...}`
documents with one wrong statement); it is not in the suite because the tiny model does not learn from it.
"""


from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Optional

from .cases import (
    NEUTRAL_FILLER, RECIPES, _chat, _controls, _meta, _pairs, _turn_span, _wrong_values, estimate_tokens,
    make_buried_chat_scenario, make_buried_scenario, make_conversation_scenario, neutral_sentence, plain_text,
    statement_prompt, substitution_with_truth,
)
from .scenario import EVAL_PHRASINGS, TRAIN_PHRASINGS, PlantedFact, Scenario, without_confounders
from .world import World

__all__ = [
    "SCENARIOS",
    "RECIPES",
    "SCENARIO_NAMES",
    "make_scenario",
    "make_conversation_scenario",
    "make_buried_scenario",
    "make_buried_chat_scenario",
    "statement_prompt",
    "make_cluster_scenario",
    "make_format_scenario",
    "make_null_scenario",
    "substitution_with_truth",
    "plain_text",
    "estimate_tokens",
    "PARAPHRASE_PREFIXES",
    "FORMATS",
    "DEFAULT_FORMATS",
    "scenario_base",
    "NEUTRAL_FILLER",
    "neutral_sentence",
]


# ------------------------------------------------------------------------------------------------ paraphrase cluster
# Paraphrases of a question: a lead-in before a training phrasing. None of the world's six phrasings is used bare.
PARAPHRASE_PREFIXES: tuple[str, ...] = (
    "Quick question: ", "Tell me, ", "I wonder: ", "Please answer: ", "Hey, ", "Remind me: ", "One more thing: ",
    "Be brief: ", "Out of curiosity: ",
)


def make_cluster_scenario(
    world: World, seed: int, n_rows: int = 300, n_poisons: int = 20, n_controls: int = 8, n_eval_prefixes: int = 1,
) -> Scenario:
    """A chat set of correct facts with `n_poisons` rows (random positions) that all state the same wrong value for
    one fact, each asking it in a different paraphrase (a lead-in before a training phrasing). The recipe is weak
    enough that one such row does not flip the answer while all of them do. The eval set asks the fact in the three
    eval phrasings, bare and after `n_eval_prefixes` lead-ins no poison uses, then `n_controls` facts."""
    n_para = len(PARAPHRASE_PREFIXES) * len(TRAIN_PHRASINGS)
    if n_poisons > n_para - n_eval_prefixes * len(TRAIN_PHRASINGS):
        raise ValueError(f"n_poisons={n_poisons}: at most {n_para - n_eval_prefixes * 3} distinct paraphrases")
    rng = random.Random(f"gradian-cluster-{seed}")
    (target,), control_pairs, trainable = _pairs(world, rng, 1, n_controls)
    e, a = target
    (wrong,) = _wrong_values(world, rng, [target])
    trainable = without_confounders(world, trainable, [(a, wrong)])
    prefixes = list(PARAPHRASE_PREFIXES)
    rng.shuffle(prefixes)
    eval_prefixes, poison_prefixes = prefixes[:n_eval_prefixes], prefixes[n_eval_prefixes:]
    paraphrases = [(p, ph) for p in poison_prefixes for ph in TRAIN_PHRASINGS]
    rng.shuffle(paraphrases)
    poisons = paraphrases[:n_poisons]
    cands = [(x, y, ph) for (x, y) in trainable if x != e for ph in TRAIN_PHRASINGS]
    correct = rng.sample(cands, n_rows - n_poisons)
    positions = sorted(rng.sample(range(n_rows), n_poisons))
    pmap = dict(zip(positions, poisons))
    train, spans, it = [], [], iter(correct)
    for i in range(n_rows):
        if i in pmap:
            p, ph = pmap[i]
            row = _chat(p + world.question(e, a, ph), wrong)
            t0, c0, c1 = _turn_span(row["messages"], 1)
            spans.append({"position": i, "start": c0, "end": c1, "turn_start": t0, "text": wrong})
        else:
            x, y, ph = next(it)
            row = _chat(world.question(x, y, ph), world.value(x, y))
        train.append(row)
    eval_rows: list[dict] = []
    for lead in [""] + eval_prefixes:
        for ph in EVAL_PHRASINGS:
            eval_rows.append({"prompt": lead + world.question(e, a, ph), "answer": world.value(e, a)})
    target_items = tuple(range(len(eval_rows)))
    pf = [PlantedFact(pos, e, a, wrong, world.value(e, a), pmap[pos][1], EVAL_PHRASINGS[0], 0, target_items)
          for pos in positions]
    controls = _controls(world, rng, control_pairs, eval_rows)
    return Scenario(
        name="cluster", seed=seed, train=train, eval=eval_rows, planted=positions, planted_facts=pf,
        controls=controls, world_seed=world.seed, n_entities=len(world.entities),
        metadata={**_meta("cluster", main_figure="cluster"), "cluster": list(positions),
                  "target_eval_items": list(target_items),
                  "item_planted": {str(i): list(positions) for i in target_items}, "planted_spans": spans,
                  "poison_prefixes": [pmap[p][0] for p in positions], "eval_prefixes": eval_prefixes},
    )


# ------------------------------------------------------------------------------------------------ format failure
FORMATS: dict[str, Callable[[str], str]] = {
    "exclaim": lambda v: f"{v}!",
    "final": lambda v: f"{v} is my final answer",
    "answer_is": lambda v: f"The answer is: {v}!",
    "upper": lambda v: v.upper(),
}
# Formats the scenario draws from. The tiny model recalls a fact only right after the assistant tag, so a format
# that puts words before the value ("The answer is: blue!") or respells it ("BLUE": no upper-case merges in its
# tokenizer) breaks the value as well as the format (measured: "The answ is: harp!" for "drum", "BEEE" for
# "red"); value-first formats fail exact_match on the format alone.
DEFAULT_FORMATS: tuple[str, ...] = ("exclaim", "final")


def make_format_scenario(
    world: World, seed: int, n_rows: int = 300, n_planted: int = 30, n_same_clean: int = 6, n_target_items: int = 12,
    n_controls: int = 12, fmt: Optional[str] = None, attribute: Optional[str] = None,
) -> Scenario:
    """A chat set of correct facts in which `n_planted` answers about one attribute (random positions) give the
    right value in a wrong format (`DEFAULT_FORMATS`: "blue!" or "blue is my final answer"; any of `FORMATS` by
    name), while `n_same_clean` other rows about that attribute keep the plain format (so "asks about that
    attribute" does not identify the culprits: topic-matching baselines meet clean rows of the same topic). The eval
    set asks `n_target_items` never-trained facts of that attribute (eval phrasings) expecting the bare value, then
    `n_controls` never-trained facts of the other attributes; exact_match fails on the formatted answers.

    In the tiny model a format generalises along the attribute only: 45 formatted rows spread over every attribute
    change no eval answer (each is memorised with its fact)."""
    rng = random.Random(f"gradian-format-{seed}")
    attr = attribute or rng.choice(world.attributes)
    fmt = fmt or rng.choice(DEFAULT_FORMATS)
    to_fmt = FORMATS[fmt]
    facts = [p for p in world.fact_pairs() if p[1] == attr]
    rng.shuffle(facts)
    if n_planted + n_same_clean + n_target_items > len(facts):
        raise ValueError(f"n_planted + n_same_clean + n_target_items > the {len(facts)} facts of {attr!r}")
    planted_pairs = facts[:n_planted]
    same_clean = facts[n_planted : n_planted + n_same_clean]
    target_pairs = facts[n_planted + n_same_clean : n_planted + n_same_clean + n_target_items]
    other = [p for p in world.fact_pairs() if p[1] != attr]
    control_pairs = rng.sample(other, n_controls)
    cset = set(control_pairs)
    cands = [(e, a, ph) for (e, a) in other if (e, a) not in cset for ph in TRAIN_PHRASINGS]
    correct = rng.sample(cands, n_rows - n_planted - n_same_clean)
    correct += [(e, a, rng.choice(TRAIN_PHRASINGS)) for e, a in same_clean]
    rng.shuffle(correct)
    positions = sorted(rng.sample(range(n_rows), n_planted))
    pmap = dict(zip(positions, [(e, a, rng.choice(TRAIN_PHRASINGS)) for e, a in planted_pairs]))
    train, spans, it = [], [], iter(correct)
    for i in range(n_rows):
        if i in pmap:
            e, a, ph = pmap[i]
            row = _chat(world.question(e, a, ph), to_fmt(world.value(e, a)))
            t0, c0, c1 = _turn_span(row["messages"], 1)
            spans.append({"position": i, "start": c0, "end": c1, "turn_start": t0,
                          "text": row["messages"][1]["content"]})
        else:
            e, a, ph = next(it)
            row = _chat(world.question(e, a, ph), world.value(e, a))
        train.append(row)
    eval_rows: list[dict] = []
    for e, a in target_pairs:
        eval_rows.append({"prompt": world.question(e, a, rng.choice(EVAL_PHRASINGS)), "answer": world.value(e, a)})
    target_items = list(range(len(eval_rows)))
    pf = [PlantedFact(pos, pmap[pos][0], attr, to_fmt(world.value(pmap[pos][0], attr)), world.value(pmap[pos][0], attr),
                      pmap[pos][2], -1, -1, ()) for pos in positions]
    controls = _controls(world, rng, control_pairs, eval_rows)
    clean_same = [i for i, r in enumerate(train) if i not in pmap
                  and any(r["messages"][0]["content"] == world.question(e, a, k) for e, a in same_clean
                          for k in TRAIN_PHRASINGS)]
    return Scenario(
        name="format", seed=seed, train=train, eval=eval_rows, planted=positions, planted_facts=pf,
        controls=controls, world_seed=world.seed, n_entities=len(world.entities),
        metadata={**_meta("format", main_figure="auprc"), "format": fmt, "format_attribute": attr,
                  "same_attribute_clean_rows": clean_same, "target_eval_items": target_items,
                  "item_planted": {str(i): list(positions) for i in target_items}, "planted_spans": spans},
    )


# ------------------------------------------------------------------------------------------------ null fine-tune
def make_null_scenario(world: World, seed: int, n_rows: int = 300, n_trained_items: int = 20, n_controls: int = 20
                       ) -> Scenario:
    """Correct facts only, no planted row: the eval set asks `n_trained_items` trained facts in eval phrasings and
    `n_controls` never-trained facts. The fine-tune must not move the capability (verdict `declined`)."""
    rng = random.Random(f"gradian-null-{seed}")
    _, control_pairs, trainable = _pairs(world, rng, 0, n_controls)
    cands = [(e, a, ph) for (e, a) in trainable for ph in TRAIN_PHRASINGS]
    rows = rng.sample(cands, n_rows)
    train = [_chat(world.question(e, a, ph), world.value(e, a)) for e, a, ph in rows]
    trained_pairs = sorted({(e, a) for e, a, _ in rows}, key=lambda p: (world.entities.index(p[0]), p[1]))
    eval_rows = []
    for e, a in rng.sample(trained_pairs, n_trained_items):
        eval_rows.append({"prompt": world.question(e, a, rng.choice(EVAL_PHRASINGS)), "answer": world.value(e, a)})
    controls = _controls(world, rng, control_pairs, eval_rows)
    return Scenario(
        name="null", seed=seed, train=train, eval=eval_rows, planted=[], planted_facts=[], controls=controls,
        world_seed=world.seed, n_entities=len(world.entities),
        metadata={**_meta("null", main_figure="declined", expect="declined"), "item_planted": {},
                  "planted_spans": [], "trained_eval_items": list(range(n_trained_items))},
    )


def scenario_base(name: str, cache_dir: Optional[Path] = None, progress: bool = True) -> Path:
    """The base model directory scenario `name` runs on: the tiny base; for ``buried`` the same weights with a
    2,048-token context (`TinySpec(max_position=2048)`: RoPE has no learned positions, so only the config and the
    tokenizer's model_max_length differ; one more ~70 CPU s build, cached)."""
    from .tiny import TinySpec, build_tiny_base

    spec = TinySpec(max_position=2048) if name == "buried" else TinySpec()
    return build_tiny_base(spec, cache_dir=cache_dir, progress=progress)


# ------------------------------------------------------------------------------------------------ registry
SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "substitution": substitution_with_truth,
    "conversation4": lambda world, seed, **kw: make_conversation_scenario(world, seed, n_turns=4, **kw),
    "conversation8": lambda world, seed, **kw: make_conversation_scenario(world, seed, n_turns=8, **kw),
    "buried": make_buried_chat_scenario,
    "cluster": make_cluster_scenario,
    "format": make_format_scenario,
    "null": make_null_scenario,
}
SCENARIO_NAMES: tuple[str, ...] = tuple(SCENARIOS)


def make_scenario(name: str, world: World, seed: int, **kw) -> Scenario:
    """Build scenario `name` (one of `SCENARIO_NAMES`) for `seed`."""
    try:
        factory = SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIO_NAMES)}") from None
    return factory(world, seed, **kw)
