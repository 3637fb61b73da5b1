"""docs/config.md lists every configuration key with the default the code really uses."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel

from gradian.config import Config

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def _keys(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for name, f in model.model_fields.items():
        if f.exclude:  # `root`: set by the loader, not a user setting
            continue
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_keys(ann, prefix + name + "."))
        else:
            out[prefix + name] = "required" if f.is_required() else f.get_default(call_default_factory=True)
    return out


def _documented() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|[^|]*\|\s*([^|]+?)\s*\|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_key_is_documented_with_its_default():
    code, doc = _keys(Config), _documented()
    assert set(code) == set(doc), f"undocumented: {sorted(set(code) - set(doc))}; stale: {sorted(set(doc) - set(code))}"
    for key, default in code.items():
        cell = doc[key]
        got = "required" if cell == "required" else yaml.safe_load(cell.strip("`"))
        assert got == default, f"docs/config.md {key}: documents {cell}, the code default is {default!r}"
