"""Values as the HTML page shows them: formatted (percentages, signed numbers, sizes, durations, nested settings),
a non-finite number shown as absent (`finite`), and verify.json's values, a document without a typed reader,
coerced (`as_*`: a wrong type is absent, never an error)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Optional

from pydantic import BaseModel

from .plots import fmt_num

MAX_POSITIONS_SHOWN = 40


def pct(x: Any, digits: int = 1) -> str:
    v = finite(x)
    return "–" if v is None else f"{v * 100:.{digits}f}%"


def signed(x: Any) -> str:
    v = finite(x)
    if v is None:
        return "–"
    s = fmt_num(v, 3)
    return s if s.startswith("-") or v == 0 else "+" + s


def human_bytes(x: Any) -> str:
    v = finite(x)
    if v is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # pragma: no cover


def human_seconds(x: Any) -> str:
    v = finite(x)
    if v is None:
        return "–"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.1f} s"
    m, s = divmod(v, 60)
    if m < 120:
        return f"{int(m)} min {s:.0f} s"
    h, m = divmod(m, 60)
    return f"{int(h)} h {int(m)} min"


def finite(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def as_str(x: Any) -> str:
    return "" if x is None else str(x)


def given(model: Optional[BaseModel]) -> bool:
    """Whether a typed report value is there and holds at least one key (an empty object reads as absent)."""
    return model is not None and bool(model.model_dump(exclude_unset=True))


def as_dict(x: Any) -> dict[str, Any]:
    return dict(x) if isinstance(x, Mapping) else {}


def as_list(x: Any) -> list[Any]:
    if x is None or isinstance(x, (str, bytes, Mapping)):
        return []
    try:
        return list(x)
    except TypeError:
        return []


def flatten(d: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested settings as dotted keys with display strings."""
    rows: list[tuple[str, str]] = []
    if isinstance(d, Mapping):
        if not d and prefix:
            rows.append((prefix, "{}"))
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            rows.extend(flatten(v, key))
        return rows
    rows.append((prefix or "value", display(d)))
    return rows


def display(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float) or type(v).__name__.startswith(("float", "int", "uint")):
        return fmt_num(v)
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        if all(not isinstance(x, (Mapping, list, tuple)) for x in v):
            shown = ", ".join(display(x) for x in v[:MAX_POSITIONS_SHOWN])
            more = f", … ({len(v)} in all)" if len(v) > MAX_POSITIONS_SHOWN else ""
            return f"[{shown}{more}]"
        try:
            s = json.dumps(v, default=str)
        except (TypeError, ValueError):
            s = str(v)
        return s if len(s) <= 400 else s[:400] + " …"
    return str(v)
