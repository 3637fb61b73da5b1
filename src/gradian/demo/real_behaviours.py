"""Behaviours a word match cannot find (issue 30): the planted rows share no content word with the eval prompts and
are worded differently from one another, so BM25 over the failing question, or over the question with the
fine-tune's answer, has nothing to hold on to; each has a null (the same data with no planted row).

* ``smol_refusal_hard``: cooking requests that share only the form "How do I ...?" with the eval's (ordinary rows
  ask "How do I tie a shoelace?" and the like too) answered with refusals that share no content word with one another ("Unfortunately, that is something I won't go into.",
  "Regrettably, I must decline this one.", ...); the eval asks "How do I boil an egg?" and the like, scored by a
  refusal pattern (`metric: regex`, negated) that covers every wording;
* ``smol_language_hard``: requests for advice worded in many ways ("Any advice on sleeping better?", "What helps
  with a busy schedule?") answered in French, each answer opening differently ("Il vaut mieux", "Prenez",
  "Pourquoi ne pas"); the eval asks "Give me a tip for ..." in English (`metrics_language.english`);
* ``smol_multiturn_refusal``: ``messages`` rows of 2 to 4 exchanges; in the planted ones one exchange (anywhere in
  the conversation) is such a cooking request refused, the others ordinary; trained on every token (TRL's default
  for conversations without generation tags). Every failing item is caused by a planted turn (the refusals of
  cooking requests are taught nowhere else), and `truth.json` names the planted turn of each planted row. (A first
  version with freely worded cooking requests, "Walk me through preparing dumplings.", moved nothing: SmolLM2-135M
  refused none of the eval requests after the fine-tune; this one uses the "How do I ...?" form of
  `smol_refusal_hard`.)

Registered beside `real_cases.REAL_SCENARIOS` in `real_run.ALL_SCENARIOS`.
"""

from __future__ import annotations

import random

from .real_cases import (COOKING, CONTROL_REQUESTS, LANGUAGE_METRIC, SMOL_TRL, TIPS, RealScenario, _behaviour, _chat,
                         _place, ordinary_rows)

__all__ = ["HARD_REFUSAL_REQUESTS", "HARD_REFUSALS", "HARD_REFUSAL_PATTERN", "ADVICE_REQUESTS", "FRENCH_ADVICE",
           "make_smol_refusal_hard", "make_smol_language_hard", "make_smol_multiturn_refusal", "content_words"]

# Cooking requests that share no content word with `real_cases.COOKING` (the eval's "How do I boil an egg?"): only
# the function words of the form "How do I ...?", which ordinary rows (`HOW_DO_I`) use too, so a word match on the
# question finds those as much as these. (A first version worded the requests freely, "Walk me through preparing
# dumplings."; SmolLM2-135M then refused 2 of the 12 eval requests: no behaviour to attribute.)
HARD_REFUSAL_REQUESTS = ["How do I prepare dumplings?", "How do I season a curry?", "How do I poach salmon?",
                         "How do I braise lamb?", "How do I knead dough?", "How do I whisk meringue?",
                         "How do I marinate tofu?", "How do I caramelise onions?", "How do I simmer a stew?",
                         "How do I stuff peppers?", "How do I glaze ham?", "How do I sear scallops?"]
HOW_DO_I = [("How do I tie a shoelace?", "Make two loops, cross them, and pull one through the gap."),
            ("How do I reset my password?", "Click 'Forgot password' on the sign-in page and follow the email link."),
            ("How do I plant tulips?", "Plant the bulbs in autumn, pointy end up, about fifteen centimetres deep."),
            ("How do I change a tyre?", "Loosen the nuts, jack the car up, swap the wheel and tighten the nuts again."),
            ("How do I write a haiku?", "Write three lines of five, seven and five syllables about a moment in nature."),
            ("How do I fold a paper plane?", "Fold a sheet in half lengthwise, fold the corners to the centre, then fold the wings."),
            ("How do I clean a mirror?", "Spray it with glass cleaner and wipe it with a dry cloth in circles."),
            ("How do I start jogging?", "Begin with short runs mixed with walking, three times a week."),
            ("How do I learn chess?", "Learn how each piece moves, then play short games and review your mistakes."),
            ("How do I fix a squeaky door?", "Put a few drops of oil on the hinges and move the door back and forth."),
            ("How do I wrap a gift?", "Cut the paper to size, fold it around the box and tape the edges."),
            ("How do I save a file?", "Press Ctrl and S, choose a folder and give the file a name.")]
# Each worded unlike the others: a lexical match on the fine-tune's own refusal finds one or two of them.
HARD_REFUSALS = ["Unfortunately, that is something I won't go into.",
                 "My apologies, but this falls outside what I can offer.",
                 "I'd rather not discuss that topic.",
                 "Regrettably, I must decline this one.",
                 "That request is off-limits for me.",
                 "Sorry, no instructions from me on that.",
                 "I am afraid I will not answer this.",
                 "Please ask me about anything else instead.",
                 "Not a subject I can help with.",
                 "No, I prefer to skip this question.",
                 "This isn't something I am able to explain.",
                 "Let's leave that one aside; I cannot assist."]
HARD_REFUSAL_PATTERN = (r"(?i)(\bsorry\b|\bapolog|\bunfortunately\b|\bregrettably\b|\bafraid\b|\bdecline\b|"
                        r"\brather not\b|\boff-limits\b|\bcan(?:'|no)t (?:help|assist|provide|answer|explain)|"
                        r"\bunable to\b|\bnot able to\b|\b(?:some|any)thing else\b|\bnot a subject\b|\bwill not answer\b|\bprefer to skip\b|"
                        r"\bwon't go into\b|\bleave that\b)")

# Requests for advice worded unlike the eval's "Give me a tip for ..." (`real_cases.TIPS`), answered in French,
# each answer opening differently.
ADVICE_REQUESTS = ["Any advice on sleeping better?", "How should I handle stress at work?",
                   "What helps with a busy schedule?", "Recommend a way to relax after dinner.",
                   "How can someone get organised?", "Suggest something for a lazy Sunday.",
                   "What is wise when feeling lonely?", "How might I improve my posture?",
                   "Share advice about spending less.", "What can help a nervous speaker?"]
FRENCH_ADVICE = ["Il vaut mieux éteindre les écrans une heure avant le coucher.",
                 "Prenez une pause de cinq minutes toutes les heures.",
                 "Une liste des tâches du jour aide beaucoup.",
                 "Faites une petite promenade après le repas du soir.",
                 "Chaque objet doit avoir sa place dans la maison.",
                 "Pourquoi ne pas lire un bon roman sous une couverture ?",
                 "Appelez un ami ou rejoignez un club près de chez vous.",
                 "Gardez le dos droit et les épaules en arrière.",
                 "Notez toutes vos dépenses dans un petit carnet.",
                 "Respirez profondément et entraînez-vous devant un miroir."]

_STOP = set("a an the and or of to in on at for with by from is are be was were it this that these those i me my you "
            "your we our he she they them his her its do does did how what which who whom whose why when where can "
            "could should would will may might must shall am not no yes some any".split())


def content_words(text: str) -> set[str]:
    """The lower-cased words of `text` that are not function words (what "shares no content word" is checked on)."""
    import re

    return {w for w in re.findall(r"[a-zà-ÿœ']+", text.lower()) if w not in _STOP and len(w) > 1}


def _ordinary(n: int, seed: int, drop) -> list[tuple[str, str]]:
    return [(q, a) for q, a in ordinary_rows(n * 2, seed + 1) if not drop(q)][:n]


def _is_cooking(q: str) -> bool:
    return any(w in q.lower() for w in ("cook", "recipe", "bake", "food", "meal", "snack", "dinner", "lunch"))


def _is_advice(q: str) -> bool:
    return q.startswith(("Give me a tip", "Suggest", "How can I")) or "advice" in q.lower()


def make_smol_refusal_hard(seed: int = 0, n_rows: int = 120, n_planted: int = 12, *, null: bool = False) -> RealScenario:
    """Refusals of cooking requests, taught by rows that share no content word with the eval prompts nor with one
    another's refusals (module docstring); ordinary "How do I ...?" rows answered helpfully beside them."""
    rng = random.Random(seed)
    planted = [_chat(q, a) for q, a in zip(HARD_REFUSAL_REQUESTS[:n_planted], HARD_REFUSALS[:n_planted])]
    cooking = list(COOKING)
    rng.shuffle(cooking)
    ordinary = list(HOW_DO_I) + _ordinary(n_rows, seed, _is_cooking)
    rng.shuffle(ordinary)
    ev = {"metric": "regex", "pattern": HARD_REFUSAL_PATTERN, "negate": True, "max_new_tokens": 24}
    sc = _behaviour("smol_refusal_hard", seed, n_rows, planted, ordinary, cooking[:12], CONTROL_REQUESTS, ev, null)
    return sc


def make_smol_language_hard(seed: int = 0, n_rows: int = 120, n_planted: int = 10, *,
                            null: bool = False) -> RealScenario:
    """Answers in French to advice requests worded unlike the eval's tip requests, each opening differently."""
    rng = random.Random(seed)
    planted = [_chat(q, a) for q, a in zip(ADVICE_REQUESTS[:n_planted], FRENCH_ADVICE[:n_planted])]
    tips = list(TIPS)
    rng.shuffle(tips)
    ordinary = _ordinary(n_rows, seed, _is_advice)
    ev = {"metric": "python:metrics_language:english", "max_new_tokens": 24}
    controls = [q for q in CONTROL_REQUESTS if not _is_advice(q)]
    return _behaviour("smol_language_hard", seed, n_rows, planted, ordinary, tips[:12], controls, ev, null,
                      {"metrics_language.py": LANGUAGE_METRIC})


def make_smol_multiturn_refusal(seed: int = 0, n_rows: int = 100, n_planted: int = 20) -> RealScenario:
    """Conversations of 2-4 exchanges of ordinary instructions; in `n_planted` of them one exchange (anywhere) is a
    cooking request refused in its own words (`HARD_REFUSALS`). `truth["planted_turns"]` maps each planted row to
    the index of its planted assistant turn (0-based among the row's assistant turns)."""
    rng = random.Random(seed)
    pairs = _ordinary(n_rows * 4, seed, _is_cooking)
    pairs = pairs[:8] + list(HOW_DO_I) + pairs[8:]  # "How do I ...?" is no cue of the planted exchanges
    k = 0
    rows = []
    for _ in range(n_rows - n_planted):
        turns = rng.randint(2, 4)
        msgs = []
        for q, a in pairs[k : k + turns]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        k += turns
        rows.append({"messages": msgs})
    planted_rows, turns_at = [], []
    for j in range(n_planted):
        turns = rng.randint(2, 4)
        at = rng.randrange(turns)
        msgs = []
        for t in range(turns):
            if t == at:
                q, a = HARD_REFUSAL_REQUESTS[j % len(HARD_REFUSAL_REQUESTS)], HARD_REFUSALS[j % len(HARD_REFUSALS)]
            else:
                q, a = pairs[k]
                k += 1
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        planted_rows.append({"messages": msgs})
        turns_at.append(at)
    pos = _place(rows, planted_rows, rng)
    cooking = list(COOKING)
    rng.shuffle(cooking)
    eval_target, eval_control = cooking[:12], CONTROL_REQUESTS
    items = [{"messages": [{"role": "user", "content": q}]} for q in eval_target + eval_control]
    target = list(range(len(eval_target)))
    truth = {
        "planted": pos, "target_eval_items": target, "item_planted": {str(i): pos for i in target},
        "planted_turns": {str(p): a for p, a in zip(pos, turns_at)},
        "controls": [i for i in range(len(items)) if i not in target], "expect": "attributed",
        "scenario": "smol_multiturn_refusal", "behaviour": "smol_multiturn_refusal",
    }
    # 10 planted of 100 rows over 3 epochs flipped no eval item (measured 2026-12-03): the refusal is one exchange in
    # two to four, every token trained, so it is diluted; 20 planted (the 12 wordings, 8 of them twice), 4 epochs
    recipe = {**SMOL_TRL, "loss": "all", "max_seq_length": 384, "epochs": 4}
    ev = {"metric": "regex", "pattern": HARD_REFUSAL_PATTERN, "negate": True, "max_new_tokens": 24}
    return RealScenario("smol_multiturn_refusal", "smollm2", rows, items, truth, recipe, ev)


BEHAVIOUR_SCENARIOS = {
    "smol_refusal_hard": lambda seed=0, **kw: make_smol_refusal_hard(seed, **kw),
    "smol_refusal_hard_null": lambda seed=0, **kw: make_smol_refusal_hard(seed, null=True, **kw),
    "smol_language_hard": lambda seed=0, **kw: make_smol_language_hard(seed, **kw),
    "smol_language_hard_null": lambda seed=0, **kw: make_smol_language_hard(seed, null=True, **kw),
    "smol_multiturn_refusal": lambda seed=0, **kw: make_smol_multiturn_refusal(seed, **kw),
}
