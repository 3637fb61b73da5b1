"""Loading the base model and its LoRA adapter, and finding the LoRA sites gradients are captured on."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .config import Config
from .errors import ModelError
from .runtime import configure_threads, resolve_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAPTER_NAME = "default"


@dataclass
class LoraSite:
    """One LoRA-adapted Linear: its A (r x d_in) and B (d_out x r) modules and where it sits."""

    name: str  # module path inside the model, without the PEFT wrapper prefix
    module_type: str  # e.g. "down_proj"
    layer: Optional[int]
    A: torch.nn.Linear
    B: torch.nn.Linear
    scaling: float

    @property
    def r(self) -> int:
        return self.A.out_features

    @property
    def d_in(self) -> int:
        return self.A.in_features

    @property
    def d_out(self) -> int:
        return self.B.out_features

    @property
    def numel(self) -> int:
        return self.r * (self.d_in + self.d_out)


def _clean_name(name: str) -> str:
    for prefix in ("base_model.model.", "base_model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def lora_sites(model, module_filter: Optional[list[str]] = None) -> tuple[list[LoraSite], list[str]]:
    """LoRA Linear sites in a stable order, and the names of LoRA modules that cannot be captured (skipped)."""
    from peft.tuners.lora import LoraLayer

    sites, skipped = [], []
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        clean = _clean_name(name)
        mtype = clean.rsplit(".", 1)[-1]
        m = re.search(r"\.(\d+)\.", "." + clean + ".")
        layer = int(m.group(1)) if m else None
        if ADAPTER_NAME not in mod.lora_A:
            if ADAPTER_NAME in getattr(mod, "lora_embedding_A", {}):
                skipped.append(f"{clean} (embedding LoRA)")
            continue
        A, B = mod.lora_A[ADAPTER_NAME], mod.lora_B[ADAPTER_NAME]
        if not (isinstance(A, torch.nn.Linear) and isinstance(B, torch.nn.Linear)):
            skipped.append(f"{clean} ({type(A).__name__} LoRA)")
            continue
        if getattr(mod, "use_dora", {}).get(ADAPTER_NAME, False):
            skipped.append(f"{clean} (DoRA)")
            continue
        if module_filter and mtype not in module_filter and clean not in module_filter:
            continue
        sites.append(LoraSite(clean, mtype, layer, A, B, float(mod.scaling[ADAPTER_NAME])))
    sites.sort(key=lambda s: s.name)
    return sites, skipped


def file_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def dir_fingerprint(path: str | Path) -> str:
    """Content hash of a model/adapter directory's config and weight files; a hub id hashes as its name."""
    p = Path(path)
    if not p.is_dir():
        return hashlib.sha256(str(path).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and (f.suffix in {".json", ".safetensors", ".bin", ".model", ".jinja"}):
            h.update(f.name.encode())
            h.update(file_fingerprint(f).encode())
    return h.hexdigest()[:16]


def summarize_load_error(e: BaseException, limit: int = 300) -> str:
    """One line for a loader exception; PEFT's size-mismatch error lists every tensor, keep the count and the first."""
    text = str(e)
    m = re.findall(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
                   r"the shape in current model is torch\.Size\((\[[^\]]*\])\)", text)
    if m:
        name, a, b = m[0]
        name = name.replace("base_model.model.", "").replace(".default", "")
        return f"{len(m)} LoRA tensors do not fit the base, e.g. {name}: adapter {a} vs base {b}"
    s = " ".join(text.split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _not_an_adapter_dir(base: str) -> None:
    """model.base pointing at a PEFT adapter directory is a common slip; say so instead of a tokenizer/config error."""
    p = Path(base)
    if p.is_dir() and (p / "adapter_config.json").exists() and not (p / "config.json").exists():
        raise ModelError(
            f"model.base '{base}' is a LoRA adapter directory (adapter_config.json, no config.json), not a model: set "
            "model.base to the model it was trained on and model.adapter to this directory"
        )


def read_adapter_config(path: str) -> dict:
    p = Path(path)
    cfg_file = p / "adapter_config.json"
    if p.exists() and not p.is_dir():
        raise ModelError(f"model.adapter '{path}' is a file; it must be a PEFT adapter directory "
                         "(adapter_config.json + adapter_model.safetensors)")
    if p.is_dir() and not cfg_file.exists():
        if (p / "config.json").exists():
            raise ModelError(
                f"{p}: holds a full model (config.json, no adapter_config.json): model.full_finetune. Gradian attributes "
                "over LoRA parameters; point model.adapter at a PEFT LoRA adapter directory"
            )
        raise ModelError(f"{p}: no adapter_config.json; model.adapter must be a PEFT LoRA adapter directory")
    if not p.is_dir():
        try:
            from huggingface_hub import hf_hub_download

            cfg_file = Path(hf_hub_download(path, "adapter_config.json"))
        except Exception as e:
            raise ModelError(f"model.adapter '{path}': not a local directory and not loadable from the hub ({e})") from None
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: invalid JSON or non-UTF-8 bytes
        raise ModelError(f"{cfg_file}: unreadable adapter config ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_file}: expected a JSON object (a PEFT adapter config), got {type(cfg).__name__}")
    if cfg.get("peft_type") not in (None, "LORA"):
        raise ModelError(f"{cfg_file}: peft_type is {cfg.get('peft_type')!r}: adapter.not_lora. Gradian needs a LoRA adapter")
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        raise ModelError(
            f"{cfg_file}: task_type is {cfg.get('task_type')!r}: adapter.task_type. Gradian attributes causal-LM adapters "
            "(task_type CAUSAL_LM)"
        )
    if p.is_dir() and not any((p / f).exists() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelError(f"{p}: adapter_config.json but no adapter_model.safetensors (or .bin); the adapter's weights "
                         "are missing")
    return cfg


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    base = cfg.local_or_hub(cfg.model.base, "model.base")
    _not_an_adapter_dir(base)
    try:
        tok = AutoTokenizer.from_pretrained(base, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        raise ModelError(f"model.base '{base}': cannot load a tokenizer ({summarize_load_error(e)})") from None
    if tok.pad_token_id is None:
        # Padding is masked out everywhere, so any real token serves; eos is the usual choice.
        tok.pad_token = tok.eos_token or tok.unk_token or tok.convert_ids_to_tokens(0)
    return tok


def load_base(cfg: Config, device: Optional[torch.device] = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    configure_threads(cfg.model.threads)
    base = cfg.local_or_hub(cfg.model.base, "model.base")
    _not_an_adapter_dir(base)
    try:
        mcfg = AutoConfig.from_pretrained(base, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        raise ModelError(f"model.base '{base}': cannot read a model config ({summarize_load_error(e)})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(mcfg) not in MODEL_FOR_CAUSAL_LM_MAPPING and not cfg.model.trust_remote_code:
        raise ModelError(
            f"model.base '{base}': {type(mcfg).__name__} is not a causal LM architecture (model.not_causal_lm); "
            "Gradian attributes decoder-only language models"
        )
    archs = getattr(mcfg, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        raise ModelError(
            f"model.base '{base}': architectures {archs} are not causal LM heads (model.not_causal_lm); "
            "give the causal-LM checkpoint"
        )
    dtype = None if cfg.model.dtype == "auto" else _DTYPES[cfg.model.dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, use_safetensors=None
        )
    except Exception as e:
        raise ModelError(f"model.base '{base}': cannot load the model ({summarize_load_error(e)})") from None
    model.to(device or resolve_device(cfg.model.device))
    model.eval()
    return model


def load_model(cfg: Config, adapter: Optional[str] = None, *, device: Optional[torch.device] = None):
    """Base + LoRA adapter as a PeftModel in eval mode (LoRA dropout off), LoRA weights requiring grad."""
    from peft import PeftModel

    path = adapter or cfg.local_or_hub(cfg.model.adapter, "model.adapter")
    if path is None:
        raise ModelError(
            "model.adapter is not set: model.full_finetune. Gradian attributes over a LoRA adapter; set model.adapter "
            "or run `gradian train CONFIG` first"
        )
    read_adapter_config(path)
    base = load_base(cfg, device)
    try:
        model = PeftModel.from_pretrained(base, path, is_trainable=True)
    except Exception as e:
        raise ModelError(
            f"model.adapter '{path}': cannot apply it to model.base '{cfg.model.base}' ({summarize_load_error(e)}); "
            "adapter.base_mismatch: set model.base to the model the adapter was trained on"
        ) from None
    model.eval()  # dropout (LoRA's included) off: captured gradients must be deterministic
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def model_fingerprint(cfg: Config) -> str:
    return dir_fingerprint(cfg.local_or_hub(cfg.model.base))
