"""Loading the base model and its LoRA adapters, and finding the LoRA sites gradients are captured on.

The loaders here are the only ones: `gradian diagnose` calls them too. Each failure is a `ModelError` carrying the
id of its setup check (`model.load_failed`, `model.not_causal_lm`, `model.full_finetune`, `adapter.unreadable`,
`adapter.not_lora`, `adapter.task_type`, `adapter.base_mismatch`, `tokenizer.load_failed`, `device.unavailable`).

Several adapters (the final one and earlier checkpoints) share one base: `load_model` wraps the base once as a
`PeftModel` with the final adapter as `ADAPTER_NAME`; `add_adapter` loads another under its own name and
`use_adapter` makes it the active one, so N checkpoints cost one base load.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..config import Config
from ..errors import ModelError
from ..distributed import current
from ..runtime import configure_threads

# On AVX512-BF16 CPUs bitsandbytes (imported by PEFT whenever it is installed) tries an optional hub kernel package
# and logs its absence; the portable path is used either way (`_fixed_bnb_path`), so that line is noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

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


def lora_sites(model, module_filter: Optional[list[str]] = None, adapter_name: Optional[str] = None
               ) -> tuple[list[LoraSite], list[str]]:
    """LoRA Linear sites of adapter `adapter_name` (default: the model's active adapter) in a stable order, and the
    names of the LoRA modules that cannot be captured (skipped)."""
    from peft.tuners.lora import LoraLayer

    name = adapter_name or _active_adapter(model)
    sites, skipped = [], []
    for path, mod in model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        clean = _clean_name(path)
        mtype = clean.rsplit(".", 1)[-1]
        m = re.search(r"\.(\d+)\.", "." + clean + ".")
        layer = int(m.group(1)) if m else None
        if name not in mod.lora_A:
            if name in getattr(mod, "lora_embedding_A", {}):
                skipped.append(f"{clean} (embedding LoRA)")
            continue
        A, B = mod.lora_A[name], mod.lora_B[name]
        if not (isinstance(A, torch.nn.Linear) and isinstance(B, torch.nn.Linear)):
            skipped.append(f"{clean} ({type(A).__name__} LoRA)")
            continue
        if getattr(mod, "use_dora", {}).get(name, False):
            skipped.append(f"{clean} (DoRA)")
            continue
        if module_filter and mtype not in module_filter and clean not in module_filter:
            continue
        sites.append(LoraSite(clean, mtype, layer, A, B, float(mod.scaling[name])))
    sites.sort(key=lambda s: s.name)
    return sites, skipped


def no_sites_error(adapter: str, module_filter: Optional[list[str]], skipped: list[str]) -> ModelError:
    what = f" matching grads.module_filter {module_filter}" if module_filter else ""
    return ModelError(f"model.adapter '{adapter}': no LoRA Linear sites{what} to capture gradients on"
                      + (f" (skipped: {', '.join(skipped[:5])})" if skipped else ""),
                      check="adapter.skipped_modules",
                      fix="target Linear layers (q_proj, v_proj, ...) when training the adapter"
                      + ("; or widen grads.module_filter" if what else ""))


def _active_adapter(model) -> str:
    name = getattr(model, "active_adapter", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return name if isinstance(name, str) else ADAPTER_NAME


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
            "model.base to the model it was trained on and model.adapter to this directory", check="model.load_failed"
        )


# ------------------------------------------------------------------------------------------------ the adapter


def adapter_ref(cfg: Config) -> str:
    """model.adapter resolved (a local directory or a hub id); model.full_finetune when it is unset, a file, or a
    full model's directory."""
    value = cfg.model.adapter
    if value is None:
        raise ModelError("model.adapter is not set: model.full_finetune. Gradian attributes over a LoRA adapter; set "
                         "model.adapter or run `gradian train CONFIG` first", check="model.full_finetune")
    ref = cfg.local_or_hub(value, "model.adapter")
    p = Path(ref)
    if p.exists() and not p.is_dir():
        raise ModelError(f"model.adapter '{value}' is a file; it must be a PEFT adapter directory "
                         "(adapter_config.json + adapter_model.safetensors)", check="model.full_finetune")
    if p.is_dir() and not (p / "adapter_config.json").exists() and (p / "config.json").exists():
        raise ModelError(
            f"model.adapter '{value}': {p} holds a full model (config.json, no adapter_config.json): "
            "model.full_finetune. Gradian attributes over LoRA parameters; point model.adapter at a PEFT LoRA adapter "
            "directory", check="model.full_finetune")
    return ref


def read_adapter_config(path: str) -> dict:
    """The adapter's adapter_config.json as a dict, with the file it came from under "__file__" (a local directory,
    or a hub id through the hub cache); adapter.unreadable when there is none or it is not a JSON object."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ModelError(f"model.adapter '{path}' is a file; it must be a PEFT adapter directory "
                         "(adapter_config.json + adapter_model.safetensors)", check="model.full_finetune")
    cfg_file = p / "adapter_config.json"
    if p.is_dir() and not cfg_file.exists():
        if (p / "config.json").exists():
            raise ModelError(
                f"{p}: holds a full model (config.json, no adapter_config.json): model.full_finetune. Gradian attributes "
                "over LoRA parameters; point model.adapter at a PEFT LoRA adapter directory", check="model.full_finetune")
        raise ModelError(f"{p}: no adapter_config.json; model.adapter must be a PEFT LoRA adapter directory",
                         check="adapter.unreadable")
    if not p.is_dir():
        try:
            from huggingface_hub import hf_hub_download

            cfg_file = Path(hf_hub_download(path, "adapter_config.json"))
        except Exception as e:
            raise ModelError(f"model.adapter '{path}': not a local directory and not loadable from the hub "
                             f"({summarize_load_error(e)})", check="adapter.unreadable") from None
    try:
        d = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: invalid JSON or non-UTF-8 bytes
        raise ModelError(f"{cfg_file}: unreadable adapter config ({summarize_load_error(e)})",
                         check="adapter.unreadable") from None
    if not isinstance(d, dict):
        raise ModelError(f"{cfg_file}: expected a JSON object (a PEFT adapter config), got {type(d).__name__}",
                         check="adapter.unreadable")
    d["__file__"] = str(cfg_file)
    return d


def check_lora_config(d: dict) -> None:
    """adapter.not_lora / adapter.task_type: a LoRA adapter for causal LM (unset fields count as such)."""
    f = d.get("__file__", "adapter_config.json")
    if d.get("peft_type") not in (None, "LORA"):
        raise ModelError(f"{f}: peft_type is {d.get('peft_type')!r}: adapter.not_lora. Gradian needs a LoRA adapter",
                         check="adapter.not_lora")
    if d.get("task_type") not in (None, "CAUSAL_LM"):
        raise ModelError(f"{f}: task_type is {d.get('task_type')!r}: adapter.task_type. Gradian attributes causal-LM "
                         "adapters (task_type CAUSAL_LM)", check="adapter.task_type")


def check_adapter_weights(path: str) -> None:
    p = Path(path)
    if p.is_dir() and not any((p / f).exists() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelError(f"{p}: adapter_config.json but no adapter_model.safetensors (or .bin); the adapter's weights "
                         "are missing", check="adapter.unreadable")


def lora_adapter_config(path: str) -> dict:
    """read_adapter_config + check_lora_config + check_adapter_weights: an adapter Gradian can attribute over."""
    d = read_adapter_config(path)
    check_lora_config(d)
    check_adapter_weights(path)
    return d


# ------------------------------------------------------------------------------------------------ the base


def base_ref(cfg: Config) -> str:
    """model.base resolved: a local directory relative to the config, or a hub id (config.paths otherwise)."""
    return cfg.local_or_hub(cfg.model.base, "model.base")


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    base = base_ref(cfg)
    _not_an_adapter_dir(base)
    try:
        tok = AutoTokenizer.from_pretrained(base, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        raise ModelError(f"model.base '{base}': cannot load a tokenizer ({summarize_load_error(e)})",
                         check="tokenizer.load_failed") from None
    if tok.pad_token_id is None:
        # Padding is masked out everywhere, so any real token serves; eos is the usual choice.
        tok.pad_token = tok.eos_token or tok.unk_token or tok.convert_ids_to_tokens(0)
    return tok


def load_base_config(cfg: Config):
    """The base's transformers config (model.load_failed when there is none)."""
    from transformers import AutoConfig

    base = base_ref(cfg)
    _not_an_adapter_dir(base)
    p = Path(base)
    if p.is_dir() and not (p / "config.json").exists():
        raise ModelError(f"model.base '{base}': no config.json in this directory", check="model.load_failed")
    try:
        return AutoConfig.from_pretrained(base, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        raise ModelError(f"model.base '{base}': cannot read a model config ({summarize_load_error(e)})",
                         check="model.load_failed") from None


def check_causal(cfg: Config, mcfg) -> None:
    """model.not_causal_lm: a decoder-only architecture with a causal-LM head."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    base = base_ref(cfg)
    if type(mcfg) not in MODEL_FOR_CAUSAL_LM_MAPPING and not cfg.model.trust_remote_code:
        raise ModelError(
            f"model.base '{base}': {type(mcfg).__name__} (model_type '{getattr(mcfg, 'model_type', '?')}') is not a "
            "causal LM architecture (model.not_causal_lm); Gradian attributes decoder-only language models",
            check="model.not_causal_lm")
    archs = getattr(mcfg, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        raise ModelError(
            f"model.base '{base}': config.json architectures {archs} are not causal LM heads (model.not_causal_lm; a "
            "sequence-classification or encoder checkpoint); give the causal-LM checkpoint", check="model.not_causal_lm")


def device_of(cfg: Config) -> torch.device:
    """`model.device` resolved: `auto` picks CUDA, else CPU. MPS only when named: its kernels are not deterministic
    enough to be a default. Under torchrun on CUDA each rank takes its own GPU (`cuda:LOCAL_RANK`) for `auto` and
    `cuda`. Here, beside the loader that places the model, because nothing else asks."""
    name = cfg.model.device
    r = current()
    if r.active and name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device(f"cuda:{r.local_rank}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"model.device is '{name}' but CUDA is not available here; use 'auto' or 'cpu'",
                         check="device.unavailable")
    if name == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ModelError("model.device is 'mps' but MPS is not available here; use 'auto' or 'cpu'",
                         check="device.unavailable")
    return torch.device(name)


QUANT_EXTRA = "pip install 'gradian[quant]'"


def quantization_config(cfg: Config):
    """transformers' `BitsAndBytesConfig` for `model.quantization` (None for none). bitsandbytes is imported here
    only: it is an optional extra, and a missing one is a `ModelError` naming how to install it."""
    q = cfg.model.quantization
    if q == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelError(f"model.quantization is {q}, which loads the base through bitsandbytes, and bitsandbytes is "
                         f"not installed: {QUANT_EXTRA} (bitsandbytes >= 0.46 runs 4-bit on CPU too), or set "
                         "model.quantization: none", check="model.load_failed",
                         fix=f"{QUANT_EXTRA}, or set model.quantization: none") from None
    from transformers import BitsAndBytesConfig

    compute = _DTYPES.get(cfg.model.dtype, torch.float32)
    if q == "nf4":
        # The LoRA branch and every activation run in model.dtype; only the frozen base weights are 4-bit.
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    # LLM.int8 casts fp32 inputs to fp16 on every call and logs it each time; the cast is part of int8's numerics.
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    return BitsAndBytesConfig(load_in_8bit=True)


def load_base(cfg: Config, device: Optional[torch.device] = None):
    """The base model in eval mode on its device, after the config checks (model.load_failed, model.not_causal_lm);
    quantized through bitsandbytes when `model.quantization` says so."""
    from transformers import AutoModelForCausalLM

    configure_threads(cfg.model.threads)
    base = base_ref(cfg)
    check_causal(cfg, load_base_config(cfg))
    device = device or device_of(cfg)
    dtype = None if cfg.model.dtype == "auto" else _DTYPES[cfg.model.dtype]
    qc = quantization_config(cfg)
    # A quantized model is placed by from_pretrained (bitsandbytes packs the weights on their device; .to() refuses)
    extra = {} if qc is None else {"quantization_config": qc, "device_map": {"": str(device)}}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, use_safetensors=None, **extra
        )
    except Exception as e:
        raise ModelError(f"model.base '{base}': cannot load the model"
                         + (f" with model.quantization {cfg.model.quantization}" if qc is not None else "")
                         + f" ({summarize_load_error(e)})", check="model.load_failed") from None
    if qc is None:
        model.to(device)
    else:
        _fixed_bnb_path(model)
    model.eval()
    return model


def _fixed_bnb_path(model) -> None:
    """bitsandbytes repacks a 4-bit weight for CPUs with AVX512-BF16 (absmax rounded to bf16) on the first forward
    without grad, in place: gradients would then depend on which forward came first (generation before the index,
    or not) and on the CPU. Keep every Linear4bit on the one portable kernel path."""
    for m in model.modules():
        if getattr(m, "support_avx512bf16_for_cpu", False):
            m.support_avx512bf16_for_cpu = False


# ------------------------------------------------------------------------------------------------ base + adapters


def attach_adapter(base, path: str, cfg: Config):
    """`base` wrapped as a PeftModel with the LoRA adapter at `path` as `ADAPTER_NAME`, in eval mode (dropout off:
    captured gradients must be deterministic), its LoRA weights requiring grad (adapter.base_mismatch when the
    tensors do not fit)."""
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(base, path, adapter_name=ADAPTER_NAME, is_trainable=True)
    except Exception as e:
        raise ModelError(
            f"model.adapter '{path}': cannot apply it to model.base '{cfg.model.base}' ({summarize_load_error(e)}); "
            "adapter.base_mismatch: set model.base to the model the adapter was trained on",
            check="adapter.base_mismatch") from None
    model.eval()
    _grad_only(model, ADAPTER_NAME)
    return model


def load_model(cfg: Config, adapter: Optional[str] = None, *, device: Optional[torch.device] = None):
    """Base + LoRA adapter (`adapter`, default model.adapter) as a PeftModel; see `attach_adapter`."""
    path = adapter or adapter_ref(cfg)
    lora_adapter_config(path)
    return attach_adapter(load_base(cfg, device), path, cfg)


def add_adapter(model, path: str, name: str, cfg: Config) -> None:
    """Load another LoRA adapter (an earlier checkpoint) onto the same base under `name` (not made active)."""
    lora_adapter_config(path)
    try:
        model.load_adapter(path, adapter_name=name, is_trainable=True)
    except Exception as e:
        raise ModelError(f"checkpoint adapter '{path}': cannot apply it to model.base '{cfg.model.base}' "
                         f"({summarize_load_error(e)}); adapter.base_mismatch", check="adapter.base_mismatch") from None
    model.eval()


def _grad_only(model, name: str) -> None:
    """LoRA weights of adapter `name` require grad, every other parameter not (captured gradients are those)."""
    tag = f".{name}."
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n and tag in n + ".")


@contextmanager
def use_adapter(model, name: str) -> Iterator[None]:
    """Make adapter `name` the active one (its LoRA weights the only ones requiring grad) for the block."""
    prev = _active_adapter(model)
    model.set_adapter(name)
    _grad_only(model, name)
    model.eval()
    try:
        yield
    finally:
        model.set_adapter(prev)
        _grad_only(model, prev)
        model.eval()


def drop_adapter(model, name: str) -> None:
    if name != ADAPTER_NAME and name in getattr(model, "peft_config", {}):
        model.delete_adapter(name)
