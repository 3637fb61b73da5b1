"""report.json against its typed model (gradian.report.schema) and the exported JSON Schema document.

Real reports of every shape come from one tiny run (test_verify's scenario: 48 chat rows, 4 planted, about a
second of training): attributed (exact index, scores averaged over the saved epoch checkpoints), projected
(index.fidelity), smoke_test (no eval set) and declined (an adapter whose LoRA B is zero, so nothing moved, with
evaluation.require_significant). Each is validated with `Report.model_validate` and, when the `jsonschema`
package is installed (the `test` extra), against docs/report.schema.json itself.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from gradian.report.schema import Report, report_json_schema

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "docs" / "report.schema.json"
SAMPLE = Path(__file__).parent / "fixtures" / "report_sample.json"
REGENERATE = "PYTHONPATH=src python -m gradian.report.schema > docs/report.schema.json"


def _schema_validator():
    jsonschema = pytest.importorskip("jsonschema")
    doc = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(doc)
    cls.check_schema(doc)
    return cls(doc)


def _validate_both(report: dict) -> Report:
    model = Report.model_validate(report)
    try:
        validator = _schema_validator()
    except pytest.skip.Exception:
        return model
    errors = sorted(validator.iter_errors(report), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])
    return model


# ------------------------------------------------------------------------------------------------ the document


def test_committed_schema_is_in_step_with_the_models():
    generated = json.dumps(report_json_schema(), indent=2, sort_keys=True) + "\n"
    assert SCHEMA_FILE.exists(), f"{SCHEMA_FILE} is missing; generate it with `{REGENERATE}`"
    assert SCHEMA_FILE.read_text(encoding="utf-8") == generated, (
        f"docs/report.schema.json is out of date with gradian/report/schema.py; regenerate it with `{REGENERATE}`")


def test_committed_schema_is_a_valid_json_schema():
    _schema_validator()  # skipped when the `jsonschema` package (the `test` extra) is not installed


def test_schema_document_names_itself():
    doc = report_json_schema()
    assert doc["title"] == "gradian.report/1" and doc["$id"]
    assert doc["properties"]["schema"]["const"] == "gradian.report/1"
    assert {"verdict", "flags", "capability", "query", "ranking", "clusters", "spans", "index",
            "timings"} <= set(doc["required"])
    assert doc["additionalProperties"] is True  # additive keys never break an old reader


# ------------------------------------------------------------------------------------------------ real reports


def _zero_lora_b(src: Path, dst: Path) -> Path:
    """A copy of the adapter with every lora_B zeroed: the fine-tune is the base, so the capability cannot move."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    w = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: (v.zero_() if "lora_B" in k else v) for k, v in w.items()}, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from test_verify import write_tiny_run

    from gradian.pipeline import attribute
    from gradian.config import load_config
    from gradian.training.loop import train_adapter

    d = tmp_path_factory.mktemp("schema") / "run"
    cfg_path = write_tiny_run(d)
    train_adapter(load_config(cfg_path), progress=False)
    truth = json.loads((d / "truth.json").read_text())
    _zero_lora_b(d / "adapter", d / "adapter_zero")
    runs = {
        "attributed": ["grads.cache_dir=index"],
        "projected": ["output=projected", "grads.projection_dim=128", "grads.rerank=8", "grads.fidelity_sample=24",
                      "attribution.checkpoints=1"],
        "smoke_test": ["output=smoke", "grads.cache_dir=index", "data.eval=null"],
        "declined": ["output=declined", "model.adapter=adapter_zero", "evaluation.require_significant=true"],
    }
    out = {}
    for name, overrides in runs.items():
        cfg = load_config(cfg_path, overrides)
        attribute(cfg, truth=truth if name == "attributed" else None)
        out[name] = json.loads((cfg.output_dir / "report.json").read_text(encoding="utf-8"))
    return out


def test_attributed_report_validates(reports):
    r = reports["attributed"]
    m = _validate_both(r)
    assert m.verdict == "attributed" and m.capability is not None and m.index is not None
    assert m.ranking and all(row.verdict is not None for row in m.ranking)
    assert m.query.items and m.query.preconditioner is not None and m.blame is not None
    assert m.query.checkpoints is not None and m.query.checkpoints.labels == ["epoch-1"]  # the earliest alone
    assert m.index.projection is None and m.index.fidelity is None  # exact index
    assert m.truth is not None and m.metrics is not None
    # The model keeps every key: dumping it gives report.json back.
    assert m.model_dump(mode="json", by_alias=True, exclude_unset=True) == r


def test_projected_report_validates(reports):
    m = _validate_both(reports["projected"])
    assert m.verdict == "attributed"
    assert m.index.projection is not None and m.index.projection.dim == 128
    fid = m.index.fidelity
    assert fid is not None and fid.sample_rows == 24 and fid.projected is not None and fid.reranked is not None
    assert fid.reranked.pearson is None  # the reranked figures drop pearson


def test_smoke_test_report_validates(reports):
    m = _validate_both(reports["smoke_test"])
    # the rows by their exact gradient norm, from one streamed pass: no index is built
    assert m.verdict == "smoke_test" and m.capability is None and m.index is None
    assert m.ranking and all(row.verdict is None for row in m.ranking)
    assert all(row.accused is False for row in m.ranking)  # a row without the flag reads as accused (old reports)
    assert m.query.items == [] and m.query.direction == ""
    assert m.blame is None and m.windows is None


def test_declined_report_validates(reports):
    m = _validate_both(reports["declined"])
    assert m.verdict == "declined", m.verdict_text
    assert m.capability is not None and not m.capability.significant and m.index is None
    assert m.ranking == [] and m.scores_summary.n == 0
    assert any(f.id == "evaluation.not_significant" for f in m.flags)


def test_sample_fixture_validates():
    m = _validate_both(json.loads(SAMPLE.read_text(encoding="utf-8")))
    assert m.verdict == "attributed" and len(m.ranking) == 20


# ------------------------------------------------------------------------------------------------ negatives


def _sample() -> dict:
    return json.loads(SAMPLE.read_text(encoding="utf-8"))


def _broken() -> list[tuple[str, dict]]:
    out = []
    r = _sample()
    r["verdict"] = "accused"
    out.append(("verdict outside the literal", r))
    r = _sample()
    r["ranking"][3]["position"] = "131"
    out.append(("string position", r))
    r = _sample()
    r["ranking"][0]["position"] = 131.0
    out.append(("float position", r))  # JSON Schema counts 131.0 as an integer; only the model rejects it
    r = _sample()
    del r["timings"]
    out.append(("missing top-level key", r))
    r = _sample()
    del r["ranking"][0]["base_loss"]
    out.append(("missing ranking key", r))
    r = _sample()
    r["capability"]["ci"] = [-0.3]
    out.append(("ci of length 1", r))
    r = _sample()
    r["flags"][0]["level"] = "fatal"
    out.append(("flag level outside the literal", r))
    r = _sample()
    r["ranking"][0]["window_score"] = None
    out.append(("null where a key may only be absent", r))
    r = _sample()
    r["schema"] = "gradian.report/2"
    out.append(("another schema id", r))
    return out


@pytest.mark.parametrize("what,report", _broken(), ids=[w for w, _ in _broken()])
def test_invalid_reports_fail(what, report):
    with pytest.raises(ValidationError):
        Report.model_validate(report)
    if what == "float position":
        return
    try:
        validator = _schema_validator()
    except pytest.skip.Exception:
        return
    assert list(validator.iter_errors(report)), f"the JSON Schema accepted a report with a {what}"


def test_extra_keys_are_allowed():
    r = _sample()
    r["new_top_level"] = {"x": 1}
    r["ranking"][0]["new_row_key"] = 1.5
    r["capability"]["items"][0]["new_item_key"] = "y"
    m = _validate_both(copy.deepcopy(r))
    assert m.model_dump(mode="json", by_alias=True, exclude_unset=True) == r
