"""Variants chosen once from the config's strings: the enums the config parses them into (same YAML in and out), one
class per metric and per preconditioner built from the name (`Metric(name)`, `Preconditioner(kind)`), and the
properties callers ask instead of comparing names."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from gradian.attribution.precondition import (DataInfPreconditioner, DiagonalPreconditioner, EkfacPreconditioner,
                                              FisherPreconditioner, IdentityPreconditioner, Preconditioner,
                                              preconditioner_class)
from gradian.capability.metrics import (ContainsMetric, ExactMatchMetric, LoglikMetric, Metric, PythonMetric,
                                        RegexMetric, is_binary_metric, make_metric)
from gradian.config import (MetricKind, PreconditionerKind, ProjectionKind, QueryFormulation, config_from_dict,
                            dump_config, metric_kind)
from gradian.errors import ConfigError
from gradian.grads.layout import SiteShape
from gradian.projection import Projector
from gradian.setup.records import EvalItem
from gradian.store.rows import RowSource


def _cfg(**sections):
    return config_from_dict({"model": {"base": "m"}, "data": {"train": "t.jsonl"}, **sections})


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("section,key,enum", [("attribution", "preconditioner", PreconditionerKind),
                                              ("attribution", "query", QueryFormulation),
                                              ("grads", "projection_kind", ProjectionKind)])
def test_config_strings_become_members_and_dump_as_the_same_strings(section, key, enum):
    for member in enum:
        cfg = _cfg(**{section: {key: member.value}})
        got = getattr(getattr(cfg, section), key)
        assert got is member and got == member.value and hash(got) == hash(member.value)
        assert f"{got}" == member.value and {member.value: 1}[got] == 1  # messages and lookups read the string
        assert yaml.safe_load(dump_config(cfg))[section][key] == member.value
        assert type(cfg.model_dump(mode="json")[section][key]) is str
    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        _cfg(**{section: {key: "nope"}})


def test_metric_kind_of_every_metric_name():
    assert [metric_kind(n) for n in ("exact_match", "contains", "loglik", "regex", "python:m:f")] == list(MetricKind)
    assert _cfg(evaluation={"metric": "python:m:f"}).evaluation.metric_kind is MetricKind.python
    assert _cfg(evaluation={"metric": "loglik"}).evaluation.metric == "loglik"  # the field stays the string
    with pytest.raises(ValueError):
        metric_kind("python")  # the bare kind is not a metric name


# ------------------------------------------------------------------------------------------------ metrics


def _item(answer):
    return EvalItem("e", 0, answer, prompt="q?", record={"prompt": "q?", "answer": answer})


def test_metric_builds_the_class_of_its_name_with_its_properties():
    fn = lambda prompt, generated, item: 1.0  # noqa: E731
    built = {n: Metric(n) for n in ("exact_match", "contains", "loglik", "regex")}
    built["python:m:f"] = Metric("python:m:f", fn=fn)
    assert [type(m) for m in built.values()] == [ExactMatchMetric, ContainsMetric, LoglikMetric, RegexMetric,
                                                 PythonMetric]
    assert make_metric("regex", r"\d", True) == Metric("regex", r"\d", True) == RegexMetric("regex", r"\d", True)
    assert {n for n, m in built.items() if m.scores_likelihood} == {"loglik"}
    assert {n for n, m in built.items() if not m.generative} == {"loglik"}
    assert {n for n, m in built.items() if m.binary} == {"exact_match", "contains", "regex"}
    assert {n for n, m in built.items() if not m.needs_answer} == {"python:m:f"}
    assert not Metric("regex", "x").needs_answer  # a fixed pattern needs no per-item answer
    assert built["contains"].score(_item("Paris"), "it is paris.") == 1.0
    assert built["exact_match"].score(_item("Paris"), "Paris.") == 1.0
    assert built["exact_match"].score(_item("Paris"), "It is Paris.") == 0.0
    with pytest.raises(ValueError, match="does not score generated answers"):
        built["loglik"].score(_item("Paris"), "Paris")
    assert np.allclose(built["loglik"].score_logprobs(np.log([0.25]) * 2, np.array([2])), [0.25])


def test_metric_names_and_settings_that_do_not_fit_are_errors():
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        Metric("f1")
    with pytest.raises(ValueError, match="takes no pattern"):
        Metric("contains", "x")
    with pytest.raises(ValueError, match="takes no fn"):
        Metric("regex", fn=len)


def test_messages_describe_the_metric_and_reports_know_binary_metrics():
    assert Metric("regex", "(?i)sorry", True).describe() == \
        "evaluation.metric 'regex' (regex not matching '(?i)sorry')"
    assert Metric("regex").describe() == "evaluation.metric 'regex' (regex matching each item's answer)"
    assert Metric("contains").describe() == "evaluation.metric 'contains'"
    assert [is_binary_metric(n) for n in ("contains", "exact_match", "loglik", "python:m:f", None, 3)] == [
        True, True, False, False, False, False]


# ------------------------------------------------------------------------------------------------ preconditioners


def test_preconditioner_builds_the_class_of_its_kind():
    classes = [IdentityPreconditioner, DiagonalPreconditioner, FisherPreconditioner, DataInfPreconditioner,
               EkfacPreconditioner]
    assert [type(Preconditioner(k.value)) for k in PreconditionerKind] == classes
    assert [preconditioner_class(k) for k in PreconditionerKind] == classes
    assert [c.is_identity for c in classes] == [True, False, False, False, False]
    assert [c.parameter_space for c in classes] == [False, False, False, False, True]
    p = Preconditioner("fisher", 3.0, [2, 2], memory_bytes=10, scope="global")
    assert (p.damping, p.block_dims, p.memory_bytes, p.scope) == (3.0, [2, 2], 10, "global")
    assert Preconditioner("datainf").damping == 0.1 and Preconditioner("ekfac", 2).damping == 2.0
    with pytest.raises(ValueError, match="unknown kind 'kfac'; known: identity, diagonal, fisher, datainf, ekfac"):
        Preconditioner("kfac")


def test_precondition_queries_keeps_what_scoring_scaled_by():
    """Identity: the raw float32 query and its float32 norm (what scoring used before the classes); the others:
    H^-1 q in float64 and its float64 norm."""
    rng = np.random.default_rng(0)
    G = rng.standard_normal((30, 8)).astype(np.float32)
    q = rng.standard_normal((3, 8)).astype(np.float32)
    ident = Preconditioner("identity").fit(RowSource(G))
    qi, ni = ident.precondition_queries(q)
    assert qi is q or np.array_equal(qi, q)
    assert ni.dtype == np.float32 and np.array_equal(ni, np.linalg.norm(q.astype(np.float32), axis=1))
    diag = Preconditioner("diagonal", 0.5, [5, 3]).fit(RowSource(G))
    qd, nd = diag.precondition_queries(q)
    assert qd.dtype == np.float64 and np.array_equal(qd, diag.apply(q))
    assert np.array_equal(nd, np.linalg.norm(diag.apply(q), axis=1))
    assert diag.metric_weights() is not None and ident.metric_weights() is None
    assert Preconditioner("fisher").fit(RowSource(G)).metric_weights() is None
    assert ident.describe() == {"kind": "identity", "damping": None, "damping_rule": ident.describe()["damping_rule"]}
    assert type(diag.describe()["kind"]) is str


# ------------------------------------------------------------------------------------------------ projection


def test_projector_kind_is_a_member_and_its_spec_the_string():
    sites = [SiteShape("s", 2, 64, 32)]
    p = Projector(sites, 16, "data-aware")
    assert p.kind is ProjectionKind.data_aware and p.data_aware and p.needs_fit
    r = Projector(sites, 16, "sjlt")
    assert not r.data_aware and r.spec()["kind"] == "sjlt" and type(r.spec()["kind"]) is str
    with pytest.raises(ValueError, match="only a projecting data-aware projector"):
        r.fitter()
    with pytest.raises(ConfigError, match="unknown kind 'pca'"):
        Projector(sites, 16, "pca")
