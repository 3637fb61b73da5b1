"""What the setup checks estimate and look up about the machine and the model, before anything is loaded: memory,
cores, parameter counts from a config, quantization settings (pure functions over configs and the OS)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from ..config import Config
from ..io import human  # noqa: F401  (the checks' messages use it from here)


def short(e: BaseException, n: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 1] + "…"


def blocking_file(p: Path) -> Optional[Path]:
    """The existing non-directory at or above p that would stop `mkdir -p p`, if any."""
    for q in [p, *p.parents]:
        if q.exists():
            return None if q.is_dir() else q
    return None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def mem_available() -> Optional[int]:
    """Bytes of memory available to a new allocation on this host (MemAvailable), without psutil."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None


def free_memory(device) -> tuple[Optional[int], str]:
    import torch

    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free), f"free on {device}"
        except Exception:  # pragma: no cover - driver trouble
            return None, str(device)
    if device.type == "cpu":
        return mem_available(), "available host memory"
    return None, str(device)


def text_config(mcfg):
    get = getattr(mcfg, "get_text_config", None)
    try:
        return get() if get else mcfg
    except Exception:  # pragma: no cover
        return mcfg


def vocab_rows(mcfg) -> Optional[int]:
    v = getattr(text_config(mcfg), "vocab_size", None)
    return int(v) if isinstance(v, int) else None


def param_estimate(mcfg) -> Optional[int]:
    """Parameters of a Llama-like decoder from its config (embeddings, attention with GQA, gated MLP)."""
    c = text_config(mcfg)
    try:
        h, L, V = int(c.hidden_size), int(c.num_hidden_layers), int(c.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return None
    nh = int(getattr(c, "num_attention_heads", None) or max(h // 64, 1))
    kv = int(getattr(c, "num_key_value_heads", None) or nh)
    hd = int(getattr(c, "head_dim", None) or h // nh)
    inter = int(getattr(c, "intermediate_size", None) or 4 * h)
    attn = 2 * h * nh * hd + 2 * h * kv * hd
    mlp = 3 * h * inter
    emb = V * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return emb + L * (attn + mlp)


def dtype_bytes(cfg: Config, mcfg=None) -> int:
    name = cfg.model.dtype
    if name == "auto" and mcfg is not None:
        name = str(getattr(mcfg, "dtype", None) or getattr(mcfg, "torch_dtype", None) or "float32")
    return 2 if ("16" in name) else 4


def quant_bits(qc: Any) -> tuple[Optional[int], str]:
    if qc is None:
        return None, ""
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "quantized"))
    if qc.get("load_in_4bit"):
        return 4, method
    if qc.get("load_in_8bit"):
        return 8, method
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
    return (int(bits) if isinstance(bits, (int, float)) else 4), method


QUANT_NAME = re.compile(r"(?i)(bnb[-_]?4bit|bnb[-_]?8bit|[-_.]4bit|[-_.]8bit|gptq|awq|[-_]int4|[-_]int8|nf4)")


def same_model_ref(a: str, b: str, root: Optional[str]) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if root is not None:
        pa = pa if pa.is_absolute() else Path(root) / pa
    if pa.exists() and pb.exists():
        try:
            return pa.resolve() == pb.resolve()
        except OSError:  # pragma: no cover
            return False
    # A hub id against a local copy of it: compare the last path component ("Llama-3.1-8B").
    return Path(a.rstrip("/")).name.lower() == Path(b.rstrip("/")).name.lower()


def weights_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in {".safetensors", ".bin"})
