"""Query formulations: one vocabulary, one class each, frozen queries built complete (`attribution.formulation`)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from gradian.attribution.formulation import KINDS, Formulation, asked, contrast_answer
from gradian.attribution.queries import QueryItem, new_query, query_rows
from gradian.capability.metrics import as_metric
from gradian.config import QueryFormulation
from gradian.setup.records import EvalItem
from helpers_models import build_tokenizer


def test_every_formulation_has_its_class_and_keeps_its_report_name():
    assert set(KINDS) == set(Formulation)
    for f in Formulation:
        assert KINDS[f].name is f and f.kind is KINDS[f]
    # report.json writes the names as they were before the classes (the schema's Literal)
    assert sorted(map(str, Formulation)) == ["behaviour", "classic", "contrastive", "margin", "own_words"]
    assert json.dumps([Formulation.own_words]) == '["own_words"]'
    assert [f for f in Formulation if f.kind.decisive] == [Formulation.own_words]
    assert [f for f in Formulation if f.kind.by_margin] == [Formulation.margin]
    assert [f for f in Formulation if f.kind.sampled] == [Formulation.behaviour]


def test_the_report_schema_spells_the_one_vocabulary():
    """report.json's per-item formulation is any Formulation's name, its run-level one any the setting can ask for:
    a formulation added or renamed without the schema fails here, not in a reader."""
    from typing import get_args

    from gradian.report.schema import Query, QueryEntry

    assert set(get_args(QueryEntry.model_fields["formulation"].annotation)) == set(map(str, Formulation))
    metrics = (as_metric("exact_match"), SimpleNamespace(generative=True, defines_class=True))
    can_ask = {str(asked(s, m)) for s in QueryFormulation for m in metrics}
    assert set(get_args(Query.model_fields["formulation"].annotation)) == can_ask


def test_the_setting_maps_onto_the_formulation_of_its_name():
    exact, loglik = as_metric("exact_match"), as_metric("loglik")
    regex = SimpleNamespace(generative=True, defines_class=True)  # what a regex metric says of itself
    for setting in QueryFormulation:
        if setting is not QueryFormulation.auto:
            assert asked(setting, exact) is Formulation(setting.value)
    assert asked(QueryFormulation.auto, regex) is Formulation.behaviour  # a class of answers, generated
    assert asked(QueryFormulation.auto, exact) is Formulation.contrastive
    assert asked(QueryFormulation.auto, loglik) is Formulation.contrastive


def test_a_query_is_frozen_and_built_complete():
    q = new_query(3, "p", " Paris", "Lyon.", "Paris", "contrastive")
    assert q.formulation is Formulation.contrastive and q.target == " Paris"
    assert q.contrast == contrast_answer(" Paris", "Lyon.") == " Lyon"
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.target = "x"
    c = new_query(3, "p", " Paris", "Lyon.", "Paris", Formulation.classic)
    assert c.contrast == "" and c.target == " Paris" and not c.own_words
    own = new_query(3, "p", " Paris", "Lyon", "Paris", "own_words", " Paris", " Lyon", "base")
    assert own.own_words and own.contrast == " Lyon" and own.target_source == "base"
    with pytest.raises(TypeError, match="new_query"):  # a bare name never reaches a caller that asks the class
        QueryItem(3, "p", " Paris", "Lyon", "Paris", "classic", " Paris", "", "expected")


def test_each_class_makes_its_own_rows():
    """The rows L_q is made of, as each class says: contrastive the target (+1) and the contrast (-1), classic the
    target, margin the target as a margin row, behaviour one row per distinct sample with the summed weight."""
    tok = build_tokenizer(chat_template=False)
    it = EvalItem("e", 0, " Paris", prompt="Capital of France?")
    kw = dict(chat=False, max_len=64)

    def answer(row):
        return tok.decode([t for t, m in zip(row.input_ids, row.supervised) if m], skip_special_tokens=True)

    rows, sign, owner, margin = query_rows(tok, [it], [new_query(0, it.prompt, " Paris", "Lyon", "", "contrastive")],
                                           **kw)
    assert [answer(r) for r in rows] == [" Paris", " Lyon"] and sign == [1.0, -1.0] and owner == [0, 0] and not margin
    rows, sign, _, margin = query_rows(tok, [it], [new_query(0, it.prompt, " Paris", "Lyon", "", "classic")], **kw)
    assert [answer(r) for r in rows] == [" Paris"] and sign == [1.0] and not margin
    rows, _, _, margin = query_rows(tok, [it], [new_query(0, it.prompt, " Paris", " Paris", "", "margin")], **kw)
    assert not rows and [(q, answer(r)) for q, r in margin] == [(0, " Paris")]
    b = new_query(0, it.prompt, " Paris", "Lyon", "", "behaviour", samples=((" Lyon", -0.25), (" Nice", -0.5),
                                                                            (" Lyon", -0.25)))
    rows, sign, _, _ = query_rows(tok, [it], [b], **kw)
    assert [answer(r) for r in rows] == [" Lyon", " Nice"] and sign == [-0.5, -0.5]


def test_an_item_gets_its_own_formulation_from_the_one_asked():
    """`Kind.for_item`: contrastive (and behaviour, until sampled) becomes own_words where one model's answer passes
    and the other's fails, classic where there is nothing to contrast, margin under loglik when the greedy answer is
    the expected one; classic stays classic."""
    from gradian.attribution.queries import query_items

    items = [EvalItem("e", i, " Paris", prompt=f"q{i}") for i in range(3)]
    cap = SimpleNamespace(tuned_generated=["Lyon", "Paris", "Nice"], base_generated=["Paris", "Paris", "Rome"],
                          tuned_raw=None, base_raw=None, base_scores=[1.0, 1.0, 0.0], tuned_scores=[0.0, 1.0, 0.0],
                          metric="exact_match")
    got = query_items(cap, items, [0, 1, 2], "contrastive")
    assert [q.formulation for q in got] == [Formulation.own_words, Formulation.classic, Formulation.contrastive]
    assert (got[0].target, got[0].contrast, got[0].target_source) == ("Paris", "Lyon", "base")
    assert query_items(cap, items, [0, 1, 2], Formulation.behaviour) == got
    assert {q.formulation for q in query_items(cap, items, [0, 1, 2], "classic")} == {Formulation.classic}
    ll = query_items(cap, items, [0, 1], "contrastive", metric="loglik")
    assert [q.formulation for q in ll] == [Formulation.contrastive, Formulation.margin]
