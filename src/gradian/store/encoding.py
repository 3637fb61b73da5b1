"""How index rows are stored: float32 as is, half types as unit rows plus an fp32 norm, bfloat16 as its bits.

Explicit little-endian dtypes, so an index written on one machine reads the same on any other; numpy only, so
writing an index never needs torch.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

STORAGE_DTYPES = ("float32", "float16", "bfloat16")
DISK_DTYPE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
NORMS_DTYPE = np.dtype("<f4")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits, the same rounding `torch.Tensor.to(torch.bfloat16)` does
    (a test checks bit equality). Done in numpy so writing an index never needs to import torch. Inputs are
    finite (checked in `add`), so the NaN branch torch has is not needed."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(DISK_DTYPE["bfloat16"])


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32, so widening is exact.
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(vectors: np.ndarray, storage_dtype: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """float32 rows -> (data, norms). Half types store unit vectors plus an fp32 norm: LoRA gradients of ~1e-6
    are float16 subnormals (4 bits of mantissa or none), while unit entries sit well inside its normal range."""
    if storage_dtype == "float32":
        return np.ascontiguousarray(vectors, dtype=DISK_DTYPE["float32"]), None
    v = vectors.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", v, v))
    unit = (v / np.where(norms > 0, norms, 1.0)[:, None]).astype(np.float32)
    if storage_dtype == "float16":
        data = unit.astype(DISK_DTYPE["float16"])
    else:
        data = f32_to_bf16_bits(unit)
    return np.ascontiguousarray(data), norms.astype(NORMS_DTYPE)


def decode(data: np.ndarray, norms: Optional[np.ndarray], storage_dtype: str) -> np.ndarray:
    if storage_dtype == "float32":
        return np.asarray(data, dtype=np.float32)  # a memory-mapped slice stays a view: no copy
    unit = data.astype(np.float32) if storage_dtype == "float16" else bf16_bits_to_f32(data)
    unit *= np.asarray(norms, dtype=np.float32)[:, None]
    return unit


def as_float32(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; checked by duck type so this module never imports torch
        x = x.detach().cpu().float().numpy()
    return np.asarray(x, dtype=np.float32)
