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


# ------------------------------------------------------------------- every setting the docs name is a real key

ROOT = DOC.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = ("model", "data", "grads", "evaluation", "attribution", "train")
# names in code spans that look like settings and are not: a transformers method
NOT_SETTINGS = {"model.generate"}
FILE_SUFFIXES = {"jsonl", "json", "py", "yaml", "csv", "parquet", "txt", "log"}


def _ids() -> set[str]:
    """Check and flag ids: the registry's, and those of docs/checks.md's tables (flags raised while attributing)."""
    from gradian.checks import REGISTRY

    text = (ROOT / "docs" / "checks.md").read_text()
    return set(REGISTRY) | set(re.findall(r"^\|\s*`([a-z_]+\.[a-z_]+)`", text, flags=re.M))


def _named(page: Path) -> list[str]:
    """Every `section.key` a page names in inline code (fenced blocks are read as YAML below)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    names = []
    for span in re.findall(r"`([^`\n]+)`", text):
        # a whole dotted name (not a module path such as attribution.scoring.score), not a file such as train.py
        names += [n for n in re.findall(rf"(?<![\w./])((?:{'|'.join(SECTIONS)})\.[a-z_*]+)(?![\w.])", span)
                  if n.rsplit(".", 1)[1] not in FILE_SUFFIXES]
    return names


def test_every_setting_the_docs_name_exists():
    keys, ids = set(_keys(Config)), _ids()
    stale = []
    for page in PAGES:
        for name in _named(page):
            if name in keys or name in ids or name in NOT_SETTINGS:
                continue
            if name.endswith(".*") and any(k.startswith(name[:-1]) for k in keys):
                continue
            stale.append(f"{page.relative_to(ROOT)}: {name}")
    assert not stale, "named in the docs but not a Config key nor a check id: " + ", ".join(stale)


def _yaml_paths(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _yaml_paths(v, prefix + k + ".")
        else:
            yield prefix + k


def test_every_yaml_example_in_the_docs_uses_real_keys():
    keys = set(_keys(Config))
    seen = 0
    for page in PAGES:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S):
            tree = yaml.safe_load(block)
            assert isinstance(tree, dict), (page, block)
            bad = [p for p in _yaml_paths(tree) if p not in keys]
            assert not bad, f"{page.relative_to(ROOT)}: not Config keys: {bad}"
            seen += 1
    assert seen >= 4


def test_the_check_table_is_the_registry():
    from gradian.checks import checks_markdown

    table = checks_markdown()
    assert table in (ROOT / "docs" / "checks.md").read_text(), (
        "docs/checks.md's check table differs from the registry; paste gradian.checks.checks_markdown()'s output")


def test_every_doc_page_is_in_the_table_of_contents():
    toc = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+)\)", toc))
    pages = {p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".md", ".json") and p.name != "README.md"}
    assert pages <= linked, f"not in docs/README.md: {sorted(pages - linked)}"
    for page in PAGES:  # and every relative link between them resolves
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}"
