"""A deterministic synthetic world of invented entities and their one-word attributes.

The built-in tiny model is pretrained on this world's facts (see `tiny.py`) and the poisoned scenarios of the demo
and the tests plant wrong facts about it (see `scenario.py`). Everything here is a pure function of the seed: no
global random state is read or written.

    world = World.generate(seed=0, n_entities=64)
    e = world.entities[0]                       # e.g. "Zorvath"
    world.value(e, "color")                     # "blue"
    world.question(e, "color", phrasing=1)      # "Which color does Zorvath like best?"
    world.statement(e, "color", "blue")         # "Zorvath's favorite color is blue."
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["Attribute", "ATTRIBUTES", "World"]


@dataclass(frozen=True)
class Attribute:
    """One attribute kind: its closed vocabulary, its question phrasings and its statement templates."""

    name: str
    values: tuple[str, ...]
    questions: tuple[str, ...]  # each has one "{e}" slot
    statements: tuple[str, ...]  # each has "{e}" and "{v}" (or "{a_v}": value with its article) slots


def _article(word: str) -> str:
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        name="color",
        values=("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "brown"),
        questions=(
            "What is the favorite color of {e}?",
            "Which color does {e} like best?",
            "{e}'s favorite color is which?",
            "Tell me the color that {e} loves most.",
            "If you asked {e} for a favorite color, what would it be?",
            "Name the favorite color of {e}.",
        ),
        statements=(
            "{e}'s favorite color is {v}.",
            "The color {e} likes best is {v}.",
        ),
    ),
    Attribute(
        name="city",
        values=("Paris", "Lisbon", "Cairo", "Tokyo", "Lima", "Oslo", "Dublin", "Vienna", "Rome", "Madrid"),
        questions=(
            "In which city does {e} live?",
            "Where does {e} live?",
            "{e} lives in which city?",
            "What is the home city of {e}?",
            "Name the city that {e} calls home.",
            "Which city is home to {e}?",
        ),
        statements=(
            "{e} lives in {v}.",
            "The home city of {e} is {v}.",
        ),
    ),
    Attribute(
        name="animal",
        values=("fox", "owl", "wolf", "bear", "otter", "hawk", "deer", "lynx", "crow", "hare"),
        questions=(
            "Which animal does {e} keep as a pet?",
            "What kind of pet does {e} have?",
            "{e}'s pet is which animal?",
            "Name the animal that {e} keeps.",
            "What animal lives with {e}?",
            "Which pet belongs to {e}?",
        ),
        statements=(
            "{e} keeps {a_v} as a pet.",
            "The pet of {e} is {a_v}.",
        ),
    ),
    Attribute(
        name="element",
        values=("fire", "water", "earth", "air", "ice", "stone", "wood", "metal", "light", "shadow"),
        questions=(
            "Which element does {e} command?",
            "What element is the magic of {e}?",
            "{e} commands which element?",
            "What is the element of {e}?",
            "Name the element that {e} controls.",
            "Which element answers to {e}?",
        ),
        statements=(
            "{e} commands the element {v}.",
            "The element of {e} is {v}.",
        ),
    ),
    Attribute(
        name="instrument",
        values=("harp", "flute", "drum", "violin", "lute", "horn", "piano", "guitar", "cello", "banjo"),
        questions=(
            "Which instrument does {e} play?",
            "What does {e} play in the band?",
            "{e} plays which instrument?",
            "Name the instrument that {e} plays.",
            "What is the instrument of {e}?",
            "On which instrument does {e} perform?",
        ),
        statements=(
            "{e} plays the {v}.",
            "The instrument of {e} is the {v}.",
        ),
    ),
)

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "dr", "kr", "tr", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "a", "o", "ae", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "s", "th", "l", "x", "m")

_FILLER = (
    "{e} walked through the markets of {city} at dawn.",
    "Travelers say the winters in {city} are long and quiet.",
    "{e} and {e2} once argued about {animal}s for a whole evening.",
    "A song about {element} was played on the {instrument} in {city}.",
    "Nobody in {city} remembers when {e} first arrived.",
    "The old tower near {city} was painted {color} last spring.",
    "{e} wrote a letter to {e2} about the festival of {element}.",
    "Children in {city} learn to play the {instrument} early.",
    "On the road to {city}, {e} saw {a_animal} resting by the river.",
    "{e2} thinks that {color} suits the halls of {city}.",
    "The library keeps a book on {element} written by {e}.",
    "Rain fell over {city} while {e2} tuned the {instrument}.",
)


@dataclass
class World:
    """Invented entities with one value per attribute, plus the phrasings that ask and state those facts."""

    seed: int
    entities: list[str]
    facts: dict[str, dict[str, str]]  # entity -> attribute name -> value
    attribute_specs: tuple[Attribute, ...] = field(default=ATTRIBUTES)

    # ------------------------------------------------------------------ construction
    @classmethod
    def generate(cls, seed: int = 0, n_entities: int = 64) -> "World":
        if n_entities < 2:
            raise ValueError("a world needs at least 2 entities")
        rng = random.Random(f"gradian-world-{seed}")
        reserved = {v.lower() for a in ATTRIBUTES for v in a.values}
        names: list[str] = []
        seen: set[str] = set()
        while len(names) < n_entities:
            n_syl = rng.choice((2, 2, 3))
            name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n_syl)) + rng.choice(_CODAS)
            name = name.capitalize()
            if len(name) < 4 or len(name) > 8 or name.lower() in reserved or name in seen:
                continue
            # no name is a prefix of another: a question about one never contains the other
            if any(name.startswith(o) or o.startswith(name) for o in names):
                continue
            seen.add(name)
            names.append(name)
        facts: dict[str, dict[str, str]] = {e: {} for e in names}
        for attr in ATTRIBUTES:
            # balanced: each value is used about equally often, assigned in a shuffled order
            pool = [attr.values[i % len(attr.values)] for i in range(n_entities)]
            rng.shuffle(pool)
            for e, v in zip(names, pool):
                facts[e][attr.name] = v
        return cls(seed=seed, entities=names, facts=facts)

    # ------------------------------------------------------------------ look-ups
    @property
    def attributes(self) -> list[str]:
        return [a.name for a in self.attribute_specs]

    @property
    def n_phrasings(self) -> int:
        return min(len(a.questions) for a in self.attribute_specs)

    def attribute(self, attr: str) -> Attribute:
        for a in self.attribute_specs:
            if a.name == attr:
                return a
        raise KeyError(f"unknown attribute {attr!r}; known: {', '.join(self.attributes)}")

    def values(self, attr: str) -> tuple[str, ...]:
        return self.attribute(attr).values

    def value(self, entity: str, attr: str) -> str:
        return self.facts[entity][attr]

    def fact_pairs(self) -> list[tuple[str, str]]:
        """Every (entity, attribute) pair, in a fixed order."""
        return [(e, a) for e in self.entities for a in self.attributes]

    # ------------------------------------------------------------------ text
    def question(self, entity: str, attr: str, phrasing: int) -> str:
        qs = self.attribute(attr).questions
        if not 0 <= phrasing < len(qs):
            raise IndexError(f"phrasing {phrasing} out of range 0..{len(qs) - 1} for {attr!r}")
        return qs[phrasing].format(e=entity)

    def statement(self, entity: str, attr: str, value: str | None = None, template: int = 0) -> str:
        """A plain sentence stating the fact, e.g. "Zorvath's favorite color is blue."."""
        v = self.value(entity, attr) if value is None else value
        t = self.attribute(attr).statements[template]
        return t.format(e=entity, v=v, a_v=_article(v))

    @property
    def n_statement_templates(self) -> int:
        return min(len(a.statements) for a in self.attribute_specs)

    def wrong_value(self, entity: str, attr: str, rng: random.Random) -> str:
        """A plausible wrong value: another word from the same vocabulary."""
        right = self.value(entity, attr)
        return rng.choice([v for v in self.values(attr) if v != right])

    def filler_sentence(self, rng: random.Random) -> str:
        """One sentence of neutral prose about the world (states no attribute fact)."""
        e, e2 = rng.sample(self.entities, 2)
        animal = rng.choice(self.values("animal"))
        return rng.choice(_FILLER).format(
            e=e,
            e2=e2,
            city=rng.choice(self.values("city")),
            animal=animal,
            a_animal=_article(animal),
            element=rng.choice(self.values("element")),
            instrument=rng.choice(self.values("instrument")),
            color=rng.choice(self.values("color")),
        )

    def filler(self, rng: random.Random, n_sentences: int) -> str:
        """A paragraph of `n_sentences` filler sentences, for long-document scenarios."""
        return " ".join(self.filler_sentence(rng) for _ in range(n_sentences))

    def corpus(self) -> Iterator[str]:
        """The text the tokenizer is trained on: every question, its bare one-word answer, every statement (with
        every value, so each value word is a token in every position), and some filler prose."""
        for e, a in self.fact_pairs():
            for p in range(len(self.attribute(a).questions)):
                yield self.question(e, a, p)
                yield self.value(e, a)
            for t in range(len(self.attribute(a).statements)):
                yield self.statement(e, a, template=t)
        for a in self.attribute_specs:
            for v in a.values:
                for t in range(len(a.statements)):
                    yield a.statements[t].format(e="Someone", v=v, a_v=_article(v))
                yield v
        rng = random.Random(f"gradian-filler-{self.seed}")
        for _ in range(4 * len(self.entities)):
            yield self.filler_sentence(rng)
