"""`train.backend: unsloth`: the recipe mapped onto unsloth's `FastLanguageModel` API, trained by TRL's SFTTrainer.

unsloth runs on NVIDIA GPUs only. On a machine without one this backend says so and stops (exit 2) before importing
anything of unsloth's. The mapping: `FastLanguageModel.from_pretrained(model.base, max_seq_length, dtype,
load_in_4bit=False)` (gradian attributes over a full-precision base), `FastLanguageModel.get_peft_model(r,
lora_alpha, lora_dropout, target_modules, bias="none", use_gradient_checkpointing=False, random_state=seed)`, then
the TRL backend's SFTConfig, dataset and in-place removal (`training.trl`). unsloth's fused kernels are not
bit-reproducible across runs, so verify compares retrain with retrain (its reference retrain is the `tuned` side).
`bench/gpu_backends.sh` trains the demo with this backend and with `trl` on a GPU and compares capability and top-k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from ..errors import TrainingError

UNSLOTH_EXTRA = "pip install 'gradian[unsloth]' on a machine with an NVIDIA GPU"


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise TrainingError("train.backend: unsloth needs an NVIDIA GPU (unsloth runs on CUDA only) and this machine "
                            "has none (torch.cuda.is_available() is False); set train.backend: trl (TRL's "
                            "SFTTrainer, also on CPU) or hf (gradian's own loop)")


def import_unsloth():
    require_gpu()
    try:
        from unsloth import FastLanguageModel
    except ImportError as e:
        raise TrainingError(f"train.backend: unsloth needs the unsloth package, which is not installed ({e}); "
                            f"{UNSLOTH_EXTRA}") from None
    return FastLanguageModel


def load_unsloth_base(cfg, hp: dict, seed: int):
    """(PEFT model, tokenizer) from unsloth's loader with the recipe's LoRA settings."""
    import torch

    FastLanguageModel = import_unsloth()
    from ..setup.model import base_ref

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype)
    model, tok = FastLanguageModel.from_pretrained(model_name=base_ref(cfg), max_seq_length=hp["max_seq_length"],
                                                   dtype=dtype, load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(
        model, r=hp["lora_r"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
        target_modules=hp["target_modules"], bias="none", use_gradient_checkpointing=False, random_state=seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def train_unsloth(cfg, *, exclude: Iterable[int] = (), out_dir: Optional[Path] = None, recipe=None,
                  progress: bool = True, **kw) -> Path:
    """The TRL backend with unsloth's model and LoRA (see the module docstring)."""
    require_gpu()
    from .trl import train_trl

    return train_trl(cfg, exclude=exclude, out_dir=out_dir, recipe=recipe, progress=progress,
                     model_factory=load_unsloth_base, backend_name="unsloth", **kw)
