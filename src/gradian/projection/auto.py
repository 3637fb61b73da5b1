"""`grads.projection_dim: auto`: exact gradients when the exact index is small, else a projection that keeps rankings.

Exact rows cost `exact width x bytes` each: 180 KB for the demo (45k LoRA dims), 19.5 MB on a SmolLM-135M-shaped
model (r 16 on all 7 projections: 4.9M dims) and 168 MB at 8B (42M dims). Every stage after the capture reads the
index (preconditioner, scoring, clusters), so an exact index is kept only when both

* the exact width is at most `AUTO_EXACT_MAX_WIDTH` (a row any later stage handles as one small vector), and
* rows x exact width x bytes of `grads.storage_dtype` is at most `AUTO_EXACT_MAX_BYTES` (the index on disk and one
  pass of every streaming stage over it);

otherwise the index is projected to `AUTO_WIDTH` dims (`grads.projection_kind`, data-aware by default), with the
top rows re-scored exactly (`grads.rerank`) and the projected-vs-exact self-check (`grads.fidelity_sample`).
`AUTO_WIDTH` is the width `bench/index_bench.py` picked on a trained mid-size model of the demo world (see
bench/README.md): the smallest width whose re-ranked top-50 recall and top-5 % Spearman both reach 0.95 there,
rounded up to a power of two with a margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..io import human

AUTO_EXACT_MAX_WIDTH = 65_536
AUTO_EXACT_MAX_BYTES = 2 << 30
AUTO_WIDTH = 8192


def row_bytes(width: int, storage_dtype: str) -> int:
    """Bytes of one stored row: float32, or half precision plus the row's fp32 norm."""
    return width * 4 if storage_dtype == "float32" else width * 2 + 4


@dataclass(frozen=True)
class ProjectionChoice:
    """What `grads.projection_dim` resolved to: `dim` None is exact; `reason` says why, in words."""

    setting: Union[str, int, None]
    dim: Optional[int]
    exact_width: int
    reason: str

    def describe(self) -> dict:
        return {"setting": self.setting, "dim": self.dim if self.dim is not None else self.exact_width,
                "exact": self.dim is None, "exact_width": self.exact_width, "reason": self.reason}


def choose_projection(setting: Union[str, int, None], exact_width: int, rows: int, storage_dtype: str = "float32"
                      ) -> ProjectionChoice:
    """Resolve `grads.projection_dim` for an index of `rows` rows whose exact width is `exact_width`."""
    if setting is None:
        return ProjectionChoice(None, None, exact_width, "grads.projection_dim is null: exact gradients")
    if setting != "auto":
        dim = int(setting)
        if dim >= exact_width:
            return ProjectionChoice(dim, None, exact_width, f"grads.projection_dim {dim} is at least the exact width "
                                                            f"{exact_width}: exact gradients")
        return ProjectionChoice(dim, dim, exact_width, f"grads.projection_dim is {dim}")
    total = rows * row_bytes(exact_width, storage_dtype)
    if exact_width <= AUTO_EXACT_MAX_WIDTH and total <= AUTO_EXACT_MAX_BYTES:
        return ProjectionChoice("auto", None, exact_width,
                                f"auto: the exact index ({rows} rows x {exact_width} dims x {storage_dtype} = "
                                f"{human(total)}) is within {AUTO_EXACT_MAX_WIDTH} dims and "
                                f"{human(AUTO_EXACT_MAX_BYTES)}: exact gradients")
    if exact_width <= AUTO_WIDTH:
        return ProjectionChoice("auto", None, exact_width,
                                f"auto: the exact index ({human(total)}) is large, but the exact width {exact_width} "
                                f"is no wider than the projection ({AUTO_WIDTH}): exact gradients")
    why = (f"the exact width {exact_width} is above {AUTO_EXACT_MAX_WIDTH}" if exact_width > AUTO_EXACT_MAX_WIDTH
           else f"the exact index ({rows} rows x {exact_width} dims = {human(total)}) is above "
                f"{human(AUTO_EXACT_MAX_BYTES)}")
    dim = AUTO_WIDTH
    return ProjectionChoice("auto", dim, exact_width,
                            f"auto: {why}, so rows are projected to {dim} dims ({human(rows * row_bytes(dim, storage_dtype))}"
                            f" for {rows} rows) and the top grads.rerank rows re-scored exactly; the width is the one "
                            "bench/index_bench.py picked")
