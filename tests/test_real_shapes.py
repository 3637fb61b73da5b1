"""The scale tier: `diagnose` and `attribute` end to end on a SmolLM-135M-shaped Llama (30 layers, hidden 576, GQA,
vocab 49,152, tied; LoRA r 16 on all 7 projections: 210 sites, 4,884,480 exact dims), with the defaults and with a
projection. Random weights built locally and cached (`gradian.demo.shapes`), loaded through `from_pretrained`.

Before issue 13 the defaults died here in the cluster step (a dense 4.9M x 1024 float64 sketch, 37 GB) and a
projection of 8192 in back_project (one side of a site with no width). Memory and time per stage are measured by
bench/scale_bench.py, not here."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gradian.cli import app

pytestmark = pytest.mark.scale
runner = CliRunner()


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from gradian.demo.shapes import SMOLLM_135M, RunSpec, shape_run

    return shape_run(SMOLLM_135M, RunSpec(rows=32))


def _config(tmp_path, template, **extra):
    from gradian.demo.shapes import write_shape_config

    return write_shape_config(tmp_path / "run", template, extra=extra)


def test_diagnose_passes_on_the_135m_shape_with_the_dry_run(tmp_path, smol):
    r = runner.invoke(app, ["diagnose", str(_config(tmp_path, smol)), "--json"])
    assert r.exit_code == 0, r.output
    by_id = {c["id"]: c for c in json.loads(r.output)}
    assert not [c for c in by_id.values() if c["level"] == "error" and c["status"] == "fail"]
    dry = by_id["capture.dry_run"]
    assert dry["status"] == "pass" and "210 LoRA sites" in dry["message"] and "4884480 exact LoRA dims" in dry["message"]
    size = by_id["index.size"]
    assert "projection_dim 8192" in size["message"] and "auto" in size["message"]


def test_attribute_with_the_defaults_on_the_135m_shape(tmp_path, smol):
    cfg = _config(tmp_path, smol)
    r = runner.invoke(app, ["attribute", str(cfg)])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "run" / "out" / "report.json").read_text())
    from gradian.report.schema import Report

    Report.model_validate(rep)
    assert rep["verdict"] == "attributed" and len(rep["ranking"]) == 32
    # the exact index would not be stored (4.9 M floats a row): one pass scores every row exactly, no index
    assert rep["index"] is None
    sc = rep["scoring"]
    assert sc["mode"].startswith("one pass") and sc["width"] == 4_884_480
    assert sc["held_rows"] == sc["unique_rows"] == 32 and sc["streamed_rows"] == 0  # 32 x 19.5 MB fit the budget
    assert rep["clusters_info"]["method"]["grouping"] == "gradient-cosine-connected-components"
    assert rep["ranking"][0].get("top_span")  # spans along the exact directions


def test_attribute_with_a_narrow_projection_and_half_storage(tmp_path, smol):
    """At 1024 dims over 210 sites the data-aware fit leaves sites (and sides) without width: windows and spans
    back-project through them."""
    from gradian import api

    cfg = api.load_config(_config(tmp_path, smol), ["grads.projection_dim=1024", "grads.storage_dtype=float16",
                                                    "grads.rerank=8", "grads.fidelity_sample=16"])
    rep = api.attribute(cfg).to_dict()
    ix = rep["index"]
    assert rep["verdict"] == "attributed" and ix["dim"] == 1024 and ix["dtype"] == "float16"
    assert 0 in ix["projection"]["site_dims"]
    assert ix["projection_choice"]["setting"] == 1024 and ix["fidelity"]["rerank_rows"] == 8
    assert any(r.get("top_span") for r in rep["ranking"][:10])
