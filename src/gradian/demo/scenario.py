"""Poisoned fine-tuning scenarios over the synthetic world, with their ground truth.

`make_substitution_scenario` builds a chat training set of correct facts with a few planted rows that state a wrong
value for one fact each, and an eval set that asks the planted facts in phrasings the fine-tune never saw (plus
untouched control facts). Fine-tuning the tiny base on it with `DEMO_RECIPE` makes the tuned model give the
planted wrong values on most planted eval items while the controls stay right; the base answers all of them right.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .world import World

__all__ = [
    "TRAIN_PHRASINGS",
    "EVAL_PHRASINGS",
    "DEMO_RECIPE",
    "PlantedFact",
    "Scenario",
    "make_substitution_scenario",
    "without_confounders",
    "planted_wrong_values",
    "write_scenario",
]

# The fine-tune only ever sees these question phrasings; eval items use the others.
TRAIN_PHRASINGS: tuple[int, ...] = (0, 1, 2)
EVAL_PHRASINGS: tuple[int, ...] = (3, 4, 5)

# The LoRA recipe measured to make the planted facts flip on the tiny base (see the module docstring).
# Planted rows use the question-first phrasings: in the tiny model a substitution taught as "{e}'s favorite color
# is which?" (entity first) often stays tied to that phrasing and never shows in the eval phrasings.
PLANTED_PHRASINGS = (0, 1)

DEMO_RECIPE: dict[str, Any] = {
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "learning_rate": 1e-3,
    "batch_size": 8,
    "epochs": 8,
    "weight_decay": 0.0,
    "lr_scheduler": "constant",  # with a linear decay to 0, use learning_rate 2e-3 for the same effect
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "loss": "assistant tokens only (answer + end-of-turn)",
    "seed": 0,
}


@dataclass(frozen=True)
class PlantedFact:
    position: int  # 0-based row number in train
    entity: str
    attribute: str
    wrong: str
    right: str
    phrasing: int  # phrasing of the planted training row
    eval_phrasing: int  # phrasing of its eval item (never the training one)
    eval_index: int  # row number of its (first) eval item
    eval_indices: tuple[int, ...] = ()  # row numbers of all its eval items, one per eval phrasing asked


@dataclass(frozen=True)
class ControlFact:
    entity: str
    attribute: str
    answer: str
    eval_phrasing: int
    eval_index: int


@dataclass
class Scenario:
    name: str
    seed: int
    train: list[dict]
    eval: list[dict]
    planted: list[int]  # positions in train of the planted rows, ascending
    planted_facts: list[PlantedFact]
    controls: list[ControlFact]
    world_seed: int
    n_entities: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def truth(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "seed": self.seed,
            "world": {"seed": self.world_seed, "n_entities": self.n_entities},
            "planted": list(self.planted),
            "planted_facts": [asdict(p) for p in self.planted_facts],
            "controls": [asdict(c) for c in self.controls],
            "target_eval_items": [i for p in self.planted_facts for i in (p.eval_indices or (p.eval_index,))],
            "control_eval_items": [c.eval_index for c in self.controls],
            "train_phrasings": list(TRAIN_PHRASINGS),
            "eval_phrasings": list(EVAL_PHRASINGS),
            **self.metadata,
        }


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def without_confounders(world: World, pairs: list[tuple[str, str]], planted: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (entity, attribute) pairs whose true value is not a planted wrong value of the same attribute.

    A correct row that answers a question of the same kind with the planted wrong value ("Shaka lives in which city?
    Lima" beside the planted "Where does Rodrol live? Lima") raises the wrong answer too: it is partly a cause of the
    failure, so a ground truth of "the planted rows alone" would be ambiguous. Measured on the demo with such rows
    left in: one of them outranked a planted row under some CPU kernel paths (recall@10 0.9). Without them, the
    planted rows are the only rows that teach the wrong answers."""
    bad = set(planted)
    return [(e, a) for e, a in pairs if (a, world.value(e, a)) not in bad]


def planted_wrong_values(world: World, rng: random.Random, planted_pairs: list[tuple[str, str]]) -> list[str]:
    """A wrong value for each planted (entity, attribute), drawn in order: never another planted fact's wrong value
    or right value of the same attribute. Two planted rows that state the same wrong value ("otter -> bear" and
    "lynx -> bear") are each a cause of the other's failure, and one that states another planted fact's right value
    pulls that fact back; either makes the planted rows' blame overlap."""
    taken: dict[str, set[str]] = {}
    for e, a in planted_pairs:
        taken.setdefault(a, set()).add(world.value(e, a))
    out = []
    for e, a in planted_pairs:
        pool = [v for v in world.values(a) if v not in taken[a]]
        wrong = rng.choice(pool) if pool else world.wrong_value(e, a, rng)
        taken[a].add(wrong)
        out.append(wrong)
    return out


def make_substitution_scenario(
    world: World, seed: int, n_rows: int = 300, n_planted: int = 10, n_controls: int = 10, eval_per_fact: int = 3
) -> Scenario:
    """A chat training set of `n_rows` rows: correct facts, and `n_planted` rows (at random positions), each
    stating a wrong value for one fact of a distinct entity. The eval set asks each planted fact once, in a phrasing
    that no training row uses, with the right answer, then `n_controls` facts that no training row mentions.

    Each planted fact is asked in `eval_per_fact` eval phrasings (all three by default): a single phrasing can
    resist a substitution that the others show, and more items narrow the capability's interval."""
    if n_planted > len(world.entities):
        raise ValueError(f"n_planted={n_planted} needs as many entities; the world has {len(world.entities)}")
    rng = random.Random(f"gradian-substitution-{seed}")
    attrs = world.attributes

    planted_entities = rng.sample(world.entities, n_planted)
    planted_pairs = [(e, rng.choice(attrs)) for e in planted_entities]
    planted_rows = []
    wrongs = planted_wrong_values(world, rng, planted_pairs)
    for (e, a), wrong in zip(planted_pairs, wrongs):
        phrasing = rng.choice(PLANTED_PHRASINGS)
        eval_phrasing = rng.choice(EVAL_PHRASINGS)
        planted_rows.append((e, a, wrong, phrasing, eval_phrasing))
    others = [p for p in world.fact_pairs() if p not in set(planted_pairs)]
    # controls: facts of entities that carry no planted row, never mentioned by the training set
    control_pool = [p for p in others if p[0] not in set(planted_entities)]
    if n_controls > len(control_pool):
        raise ValueError(f"n_controls={n_controls} is more than the {len(control_pool)} facts available")
    control_pairs = rng.sample(control_pool, n_controls)
    trainable = without_confounders(world, [p for p in others if p not in set(control_pairs)],
                                    [(a, wrong) for _, a, wrong, _, _ in planted_rows])

    n_correct = n_rows - n_planted
    candidates = [(e, a, ph) for (e, a) in trainable for ph in TRAIN_PHRASINGS]
    if n_correct > len(candidates):
        raise ValueError(f"n_rows={n_rows} needs more distinct correct rows than the {len(candidates)} available")
    correct = rng.sample(candidates, n_correct)

    positions = sorted(rng.sample(range(n_rows), n_planted))

    train: list[dict] = []
    planted_by_pos = dict(zip(positions, planted_rows))
    it = iter(correct)
    for i in range(n_rows):
        if i in planted_by_pos:
            e, a, wrong, ph, _ = planted_by_pos[i]
            train.append(_chat(world.question(e, a, ph), wrong))
        else:
            e, a, ph = next(it)
            train.append(_chat(world.question(e, a, ph), world.value(e, a)))

    eval_rows: list[dict] = []
    planted_facts: list[PlantedFact] = []
    for pos in positions:
        e, a, wrong, ph, eph = planted_by_pos[pos]
        phs = [eph] + [x for x in EVAL_PHRASINGS if x != eph][: max(eval_per_fact, 1) - 1]
        idx = tuple(range(len(eval_rows), len(eval_rows) + len(phs)))
        planted_facts.append(PlantedFact(pos, e, a, wrong, world.value(e, a), ph, eph, idx[0], idx))
        for x in phs:
            eval_rows.append({"prompt": world.question(e, a, x), "answer": world.value(e, a)})
    controls: list[ControlFact] = []
    for e, a in control_pairs:
        eph = rng.choice(EVAL_PHRASINGS)
        controls.append(ControlFact(e, a, world.value(e, a), eph, len(eval_rows)))
        eval_rows.append({"prompt": world.question(e, a, eph), "answer": world.value(e, a)})

    return Scenario(
        name="substitution",
        seed=seed,
        train=train,
        eval=eval_rows,
        planted=positions,
        planted_facts=planted_facts,
        controls=controls,
        world_seed=world.seed,
        n_entities=len(world.entities),
        metadata={"recipe": dict(DEMO_RECIPE)},
    )


def write_scenario(scenario: Scenario, directory: str | Path) -> Path:
    """Write `train.jsonl`, `eval.jsonl` and `truth.json` into `directory` (created) and return it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", scenario.train), ("eval.jsonl", scenario.eval)):
        with open(d / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    (d / "truth.json").write_text(json.dumps(scenario.truth(), indent=2) + "\n", encoding="utf-8")
    return d
