"""report.json read back: `load_report` (the typed report) and `queries_from_report` (the queries it was made from).

The only readers of a written report for the verbs that come after `attribute` (verify, fidelity): every field is
read through the typed schema, so a key renamed or retyped fails here, naming the file and the key, instead of
deep inside a retrain; and the queries are rebuilt with every field `attribute` wrote, so fidelity measures the very
query losses whose gradients the report's scores were computed from.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping, Union

from pydantic import ValidationError

from ..attribution.formulation import Formulation
from ..attribution.queries import QueryItem, new_query
from ..errors import DataError
from .schema import QueryEntry, Report

REPORT_FILE = "report.json"

# report.json holds JSON values; these QueryItem fields are not the JSON type they are read as
_AS_FIELD: dict[str, Callable[[Any], Any]] = {"span": tuple,
                                             "samples": lambda v: tuple((str(t), float(w)) for t, w in v)}


def load_report(run_dir: Path | str) -> Report:
    """OUT/report.json as a typed `schema.Report`; DataError naming the file (and the key) when it is missing, not
    JSON or not a gradian.report/1 report."""
    path = Path(run_dir) / REPORT_FILE
    if not path.exists():
        raise DataError(f"{path}: no report; run `gradian attribute CONFIG` first")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e})") from None
    return report_from(text, str(path))


def report_from(data: Union[str, Mapping[str, Any]], where: str = REPORT_FILE) -> Report:
    """A report as JSON text or as the dict `json.loads` gives, typed; DataError naming `where` and the first key
    that is not as gradian.report/1 has it (the readers' one gate: past it every value has its schema type)."""
    try:
        if isinstance(data, str):
            return Report.model_validate_json(data)
        return Report.model_validate(data)
    except ValidationError as e:
        if e.errors()[0].get("type") == "json_invalid":
            raise DataError(f"{where}: cannot be read as JSON ({e.errors()[0].get('msg')})") from None
        raise DataError(f"{schema_problem(e, where)}; not a gradian.report/1 report as this version writes it: rerun "
                        "`gradian attribute CONFIG`") from None


def schema_problem(e: ValidationError, where: str) -> str:
    """'WHERE: key a.b.0: what is wrong (N problem(s))': the first of a validation error's problems."""
    first = e.errors()[0]
    key = ".".join(str(x) for x in first.get("loc", ())) or "(top level)"
    return f"{where}: key {key}: {first.get('msg')} ({e.error_count()} problem(s))"


def query_from_entry(entry: QueryEntry, formulation: Formulation | str) -> QueryItem:
    """The `attribution.queries.QueryItem` a report's query entry was written from: every field of QueryItem that
    the entry holds (a key absent from the entry keeps `new_query`'s default); `formulation` (the report's
    `query.formulation`) when the entry has none of its own (reports written before per-item formulations)."""
    given = entry.model_dump(exclude_none=True)
    kw = {f.name: _AS_FIELD.get(f.name, _same)(given[f.name]) for f in fields(QueryItem) if f.name in given}
    kw.setdefault("formulation", formulation)
    return new_query(**kw)


def queries_from_report(report: Report) -> list[QueryItem]:
    """The failing items' queries as `attribute` built them (report.json `query.items`), in report order."""
    return [query_from_entry(e, report.query.formulation) for e in report.query.items]


def _same(v: Any) -> Any:
    return v
