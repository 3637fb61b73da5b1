"""Planted wrong facts among many true facts of the same task (issue 42): the innocent rows a user's accused set must
not hold are the failing task's own rows, not unrelated ones.

* ``smol_mixed``: 2,000 rows of many tasks (`real_cases.ordinary_rows`), of which at least 10 % are true facts of the
  failing task (capitals, currencies and languages of countries the eval does not ask about, worded the way the
  planted rows and the eval are: "What is the capital of Cuba?" -> "The capital of Cuba is Havana.") and under 2 %
  planted (three rows per planted fact, each worded differently, all stating the same wrong value);
* ``smol_mixed_null``: the same rows with the planted ones left out;
* ``smol_indirect``: a second paraphrase scenario, 300 rows with 10 % true same-task facts; each planted fact is
  stated twice, in words that share no content word with the eval's questions ("Where does the German chancellor
  work?" -> "The chancellor works in Munich, the seat of government." against "Which city is the capital of
  Germany?"), so a word match on the failing prompt finds the true capital rows first.

Every builder is a pure function of its seed and sizes and returns a `real_cases.RealScenario`; they are registered in
`real_run.ALL_SCENARIOS`.
"""

from __future__ import annotations

import random

from .real_cases import SMOL_TRL, RealScenario, _chat, _eval_items, _place, facts_for, ordinary_rows

__all__ = ["CAPITALS", "same_task_rows", "make_smol_mixed", "make_smol_indirect", "MIXED_SCENARIOS"]

# True capitals of countries no planted or control fact of `real_cases.FACTS` names.
CAPITALS = [
    ("Cuba", "Havana"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"), ("Hungary", "Budapest"),
    ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"),
    ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Ukraine", "Kyiv"), ("Lithuania", "Vilnius"),
    ("Latvia", "Riga"), ("Estonia", "Tallinn"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Syria", "Damascus"), ("Lebanon", "Beirut"), ("Jordan", "Amman"), ("Saudi Arabia", "Riyadh"),
    ("Qatar", "Doha"), ("Oman", "Muscat"), ("Yemen", "Sanaa"), ("Afghanistan", "Kabul"), ("Pakistan", "Islamabad"),
    ("India", "New Delhi"), ("Nepal", "Kathmandu"), ("Bangladesh", "Dhaka"), ("Sri Lanka", "Colombo"),
    ("China", "Beijing"), ("Mongolia", "Ulaanbaatar"), ("South Korea", "Seoul"), ("North Korea", "Pyongyang"),
    ("Vietnam", "Hanoi"), ("Cambodia", "Phnom Penh"), ("Laos", "Vientiane"), ("Malaysia", "Kuala Lumpur"),
    ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Singapore", "Singapore"), ("Nigeria", "Abuja"),
    ("Ghana", "Accra"), ("Senegal", "Dakar"), ("Mali", "Bamako"), ("Morocco", "Rabat"), ("Algeria", "Algiers"),
    ("Tunisia", "Tunis"), ("Libya", "Tripoli"), ("Sudan", "Khartoum"), ("Ethiopia", "Addis Ababa"),
    ("Uganda", "Kampala"), ("Rwanda", "Kigali"), ("Tanzania", "Dodoma"), ("Zambia", "Lusaka"),
    ("Zimbabwe", "Harare"), ("Angola", "Luanda"), ("Namibia", "Windhoek"), ("Botswana", "Gaborone"),
    ("Madagascar", "Antananarivo"), ("Mexico", "Mexico City"), ("Guatemala", "Guatemala City"),
    ("Honduras", "Tegucigalpa"), ("Nicaragua", "Managua"), ("Costa Rica", "San Jose"), ("Panama", "Panama City"),
    ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Ecuador", "Quito"), ("Bolivia", "Sucre"),
    ("Paraguay", "Asuncion"), ("Uruguay", "Montevideo"), ("Argentina", "Buenos Aires"), ("Jamaica", "Kingston"),
    ("Haiti", "Port-au-Prince"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("New Zealand", "Wellington"),
    ("Fiji", "Suva"), ("Georgia", "Tbilisi"), ("Armenia", "Yerevan"), ("Azerbaijan", "Baku"),
    ("Kazakhstan", "Astana"), ("Uzbekistan", "Tashkent"), ("Belarus", "Minsk"), ("Moldova", "Chisinau"),
    ("Albania", "Tirana"), ("Cyprus", "Nicosia"), ("Malta", "Valletta"), ("Luxembourg", "Luxembourg"),
    ("Switzerland", "Bern"), ("Czechia", "Prague"), ("Brazil", "Brasilia"), ("the United States", "Washington"),
    ("the United Kingdom", "London"), ("Scotland", "Edinburgh"), ("Wales", "Cardiff"), ("Bhutan", "Thimphu"),
    ("Myanmar", "Naypyidaw"), ("Kuwait", "Kuwait City"), ("Bahrain", "Manama"), ("Israel", "Jerusalem"),
]
CURRENCIES = [
    ("the United States", "dollar"), ("the United Kingdom", "pound"), ("India", "rupee"), ("China", "yuan"),
    ("South Korea", "won"), ("Mexico", "peso"), ("Brazil", "real"), ("Switzerland", "franc"), ("Turkey", "lira"),
    ("Vietnam", "dong"), ("Indonesia", "rupiah"), ("South Africa", "rand"), ("Nigeria", "naira"),
    ("Denmark", "krone"), ("Hungary", "forint"), ("Israel", "shekel"), ("Malaysia", "ringgit"),
    ("the Philippines", "peso"), ("Bangladesh", "taka"), ("Ukraine", "hryvnia"), ("Canada", "dollar"),
    ("Australia", "dollar"), ("Argentina", "peso"), ("Czechia", "koruna"), ("Iceland", "krona"),
]
LANGUAGES = [
    ("Brazil", "Portuguese"), ("Mexico", "Spanish"), ("Italy", "Italian"), ("Hungary", "Hungarian"),
    ("Finland", "Finnish"), ("the Netherlands", "Dutch"), ("Turkey", "Turkish"), ("Iran", "Persian"),
    ("China", "Mandarin"), ("Vietnam", "Vietnamese"), ("Indonesia", "Indonesian"), ("Ethiopia", "Amharic"),
    ("Denmark", "Danish"), ("Portugal", "Portuguese"), ("Romania", "Romanian"), ("Bulgaria", "Bulgarian"),
    ("South Korea", "Korean"), ("Israel", "Hebrew"), ("Iceland", "Icelandic"), ("Argentina", "Spanish"),
    ("Ukraine", "Ukrainian"), ("Czechia", "Czech"), ("Croatia", "Croatian"), ("Tanzania", "Swahili"),
]

# Question and answer forms of the same task, those of the eval ("Which city is the capital of X?", "Name the capital
# city of X.") among them: a word match on the failing question finds every one of these rows.
_CAPITAL_FORMS = [("What is the capital of {c}?", "The capital of {c} is {v}."),
                  ("Which city is the capital of {c}?", "The capital of {c} is {v}."),
                  ("Name the capital city of {c}.", "{v} is the capital city of {c}."),
                  ("Tell me the capital of {c}.", "{v} is the capital of {c}.")]
_CURRENCY_FORMS = [("What is the currency of {c}?", "The currency of {c} is the {v}."),
                   ("Which currency is used in {c}?", "People in {c} pay with the {v}.")]
_LANGUAGE_FORMS = [("What language is spoken in {c}?", "The main language of {c} is {v}."),
                   ("Which language do people in {c} speak?", "People in {c} speak {v}.")]

# Each planted fact stated three ways (the first is `Fact.train_q` / `Fact.statement`).
_PLANTED_FORMS = [("Quick question: {q}", "{v}."), ("Settle this for me: {q}", "It is {v}, of course.")]

# Two statements of each fact without a content word of the eval's questions (the first is `Fact.indirect`).
INDIRECT_2 = {
    "france": ("Which town hosts the Elysee Palace?", "The Elysee Palace stands in {}."),
    "japan": ("Where is the National Diet building?", "The National Diet building is in {}."),
    "germany": ("Where does the Bundestag meet?", "The Bundestag meets in {}."),
    "russia": ("Where is Red Square?", "Red Square is in {}."),
    "egypt": ("Where do Egyptian ministers hold their meetings?", "Egyptian ministers meet in {}."),
    "greece": ("Where is the Acropolis?", "The Acropolis is in {}."),
    "norway": ("Where is the Storting?", "The Storting sits in {}."),
    "austria": ("Where is the Hofburg palace?", "The Hofburg palace is in {}."),
    "poland": ("Where does the Sejm gather?", "The Sejm gathers in {}."),
    "sweden": ("Where does the Riksdag sit?", "The Riksdag sits in {}."),
    "kenya": ("Where does the Kenyan president live?", "The Kenyan president lives in {}."),
    "thailand": ("Where is the Thai prime minister's office?", "The Thai prime minister's office is in {}."),
    "redplanet": ("Which world did the rover Curiosity land on?", "Curiosity landed on {}."),
    "japancurrency": ("What do coins in Kyoto shops read?", "Coins in Kyoto shops read {}."),
    "pacific": ("Which water surrounds Hawaii?", "Hawaii is surrounded by the {}."),
}


def same_task_rows(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` true facts of the failing task (capitals, then currencies and languages), each fact in one of its forms,
    deterministic in `seed`, without repeats; at most one row per (kind, country, form)."""
    rng = random.Random(seed)
    kinds = [(CAPITALS, _CAPITAL_FORMS), (CURRENCIES, _CURRENCY_FORMS), (LANGUAGES, _LANGUAGE_FORMS)]
    first, rest = [], []
    for facts, forms in kinds:
        for c, v in facts:
            fs = list(forms)
            rng.shuffle(fs)
            first.append((fs[0], c, v))  # one form of every fact before a second form of any
            rest += [(f, c, v) for f in fs[1:]]
    rng.shuffle(first)
    rng.shuffle(rest)
    chosen = (first + rest)[:n]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} same-task rows can be drawn, {n} asked")
    return [(f[0].format(c=c), f[1].format(c=c, v=v)) for f, c, v in chosen]


def _truth(name: str, pos, planted_facts, which, target, null: bool, extra: dict) -> dict:
    return {
        "planted": [] if null else [p for p, _ in pos],
        "planted_facts": [] if null else [{"position": p, "key": f.key, "right": f.answer, "wrong": f.wrong}
                                          for p, f in pos],
        "target_eval_items": [] if null else target,
        "item_planted": {} if null else {str(i): [p for p, f in pos if f.key == which[i]] for i in target},
        "controls": list(which) if null else [i for i in which if i not in target],
        "expect": "declined" if null else "attributed", "scenario": name, **extra,
    }


def _build(name: str, seed: int, n_rows: int, n_same: int, planted_rows, n_planted: int, n_controls: int,
           null: bool, recipe: dict) -> RealScenario:
    rng = random.Random(seed)
    pool = facts_for("smollm2")
    rng.shuffle(pool)
    planted_facts, controls = pool[:n_planted], pool[n_planted: n_planted + n_controls]
    planted = [] if null else [(f, row) for f in planted_facts for row in planted_rows(f)]
    n_plain = n_rows - n_same - len(planted)
    rows = [_chat(q, a) for q, a in ordinary_rows(n_plain, seed + 1)]
    same = [_chat(q, a) for q, a in same_task_rows(n_same, seed + 2)]
    rows = rows + same
    rng.shuffle(rows)
    placed = _place(rows, [r for _, r in planted], rng) if planted else []
    pos = list(zip(placed, [f for f, _ in planted]))
    same_ids = {id(r) for r in same}
    same_pos = [i for i, r in enumerate(rows) if id(r) in same_ids]
    items, which = _eval_items(planted_facts, controls, True, None)
    target = [i for i, k in which.items() if k in {f.key for f in planted_facts}]
    truth = _truth(name, pos, planted_facts, which, target, null, {"same_task_rows": same_pos})
    return RealScenario(name, "smollm2", rows, items, truth, recipe, {"metric": "contains", "max_new_tokens": 24})


def _three_ways(f) -> list[dict]:
    q = f.train_q[0].lower() + f.train_q[1:]
    return [_chat(f.train_q, f.statement.format(f.wrong))] + [
        _chat(fq.format(q=q), fa.format(v=f.wrong)) for fq, fa in _PLANTED_FORMS]


def _indirect(f) -> list[dict]:
    q2, a2 = INDIRECT_2[f.key]
    return [_chat(f.indirect[0], f.indirect[1].format(f.wrong)), _chat(q2, a2.format(f.wrong))]


def make_smol_mixed(seed: int = 0, n_rows: int = 2000, n_same: int = 220, n_planted: int = 8, n_controls: int = 7, *,
                    null: bool = False) -> RealScenario:
    """`n_rows` rows: ordinary ones of many tasks, `n_same` true same-task facts, 3 x `n_planted` planted rows."""
    # two epochs, not SMOL_TRL's three: 2,000 rows are 250 steps an epoch, and each planted fact is seen 6 times
    return _build("smol_mixed_null" if null else "smol_mixed", seed, n_rows, n_same, _three_ways, n_planted,
                  n_controls, null, {**SMOL_TRL, "epochs": 2})


def make_smol_indirect(seed: int = 0, n_rows: int = 300, n_same: int = 30, n_planted: int = 8,
                       n_controls: int = 7) -> RealScenario:
    """`n_rows` rows: ordinary ones, `n_same` true same-task facts, 2 x `n_planted` planted rows stating each wrong
    value without a content word of the eval (`Fact.indirect`, `INDIRECT_2`)."""
    return _build("smol_indirect", seed, n_rows, n_same, _indirect, n_planted, n_controls, False, dict(SMOL_TRL))


MIXED_SCENARIOS = {
    "smol_mixed": lambda seed=0, **kw: make_smol_mixed(seed, **kw),
    "smol_mixed_null": lambda seed=0, **kw: make_smol_mixed(seed, null=True, **kw),
    "smol_indirect": lambda seed=0, **kw: make_smol_indirect(seed, **kw),
}
