"""What every model of report.json shares (`report.schema`): extra keys allowed, strict types, keys that may be
absent but are never null."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


def _drop_default(schema: dict) -> None:
    schema.pop("default", None)


def _absent(description: str) -> Any:
    """A key that may be missing from report.json but is never null when present."""
    return Field(None, description=description, json_schema_extra=_drop_default)


Pair = Annotated[list[float], Field(min_length=2, max_length=2)]
IntPair = Annotated[list[int], Field(min_length=2, max_length=2)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
